"""The disk KV tier's files (issue 18) and the execution of the scheduler's disk plans (core/disk_tier.py decides).

Layout: DIR/<fingerprint's first 16 hex digits>/<block hash as 16 hex digits>.kv, and fingerprint.json saying what
the fingerprint covers (for people). A file is a header (magic, the whole fingerprint, the block hash, the payload's
size and crc32) and the block's K/V: per layer, K then V of the block in the cache's storage order. Files are
written under a temporary name and renamed (atomic on POSIX), so a block's name never holds a partial file.

The fingerprint covers the model (per weight file: name, size, sha256 of its first and last MiB; config.json whole;
not the path: a moved model keeps its cache), the KV layout (layers, KV heads, head dim, block size, dtype, storage
order), the device type (CPU and CUDA kernels may round K/V differently), the block-hash scheme and this file
format. Another model or layout therefore uses another subdirectory and never lists these files; a load checks the
header and the crc32 again, so a file copied or damaged behind the engine's back is never used either.

Nothing here stops the engine: a store that cannot be written is logged and skipped (a later load of it fails); a
load whose file is missing, short, foreign or damaged is returned as failed, and the scheduler recomputes those
tokens (``ModelRunnerOutput.kv_load_failures``). No fsync: a power loss can lose recent files, never use a bad one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import torch

from folio.core.block_hash import BLOCK_HASH_VERSION
from folio.core.sched_output import DiskStore

logger = logging.getLogger("folio")

FORMAT_VERSION = 1
_MAGIC = b"FOLIOKV\x01"
_HEADER = struct.Struct("<8s32sQQI")  # magic, fingerprint (sha256), block hash, payload bytes, payload crc32
_NAME = re.compile(r"^([0-9a-f]{16})\.kv$")
_SAMPLE_BYTES = 2**20


def _file_identity(path: Path) -> dict[str, Any]:
    """Name, size and sha256 of the first and last MiB: cheap, and a different checkpoint differs in them."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(_SAMPLE_BYTES)).hexdigest()
        f.seek(max(0, size - _SAMPLE_BYTES))
        tail = hashlib.sha256(f.read(_SAMPLE_BYTES)).hexdigest()
    return {"name": path.name, "size": size, "head_sha256": head, "tail_sha256": tail}


def model_identity(model_path: str) -> list[dict[str, Any]]:
    """The identity of a GGUF file, or of a Hugging Face directory's config.json (whole) and *.safetensors."""
    path = Path(model_path)
    if path.is_file():
        return [_file_identity(path)]
    files = [_file_identity(p) for p in sorted(path.glob("*.safetensors"))]
    config = path / "config.json"
    if config.is_file():
        files.append({"name": config.name, "sha256": hashlib.sha256(config.read_bytes()).hexdigest()})
    return files


def kv_fingerprint(model_path: str, layout: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(sha256 hex digest, what it covers) of a model and its KV layout; see the module docstring."""
    described = {
        "format_version": FORMAT_VERSION,
        "block_hash_version": BLOCK_HASH_VERSION,
        "model": model_identity(model_path),
        "kv_layout": layout,
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    return digest, described


def resolve_num_disk_blocks(size_gib: float, file_bytes: int, available_bytes: int) -> int:
    """Block files in ``size_gib`` GiB. ValueError naming --kv-offloading-disk-size when that is more than
    ``available_bytes`` (free space plus this tier's own files) or holds no block."""
    asked = int(size_gib * 2**30)
    if asked > available_bytes:
        raise ValueError(
            f"--kv-offloading-disk-size {size_gib:g} GiB ({asked} bytes) is more than the disk space available: "
            f"{available_bytes / 2**30:.2f} GiB ({available_bytes} bytes, free space plus the tier's own files)"
        )
    if asked < file_bytes:
        raise ValueError(f"--kv-offloading-disk-size {size_gib:g} GiB holds no KV block (one needs {file_bytes} bytes)")
    return asked // file_bytes


class DiskKVFiles:
    """One directory of block files for one fingerprint: listing, atomic writes, checked reads, deletes."""

    def __init__(self, root: str, fingerprint: str, described: dict[str, Any], payload_bytes: int) -> None:
        self.fingerprint = bytes.fromhex(fingerprint)
        self.payload_bytes = payload_bytes
        self.file_bytes = _HEADER.size + payload_bytes
        self.directory = Path(root) / fingerprint[:16]
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(".*.tmp"):  # a write cut short by a crash
                stale.unlink(missing_ok=True)
            probe = self.directory / f".probe.{os.getpid()}.tmp"
            probe.write_bytes(b"ok")
            probe.unlink()
            (self.directory / "fingerprint.json").write_text(json.dumps(described, indent=1, sort_keys=True))
        except OSError as e:
            raise ValueError(f"--kv-offloading-disk-path {root}: cannot create or write {self.directory}: {e}") from e
        self._warned = False

    def path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}.kv"

    def listing(self) -> list[int]:
        """The block hashes with a file here, least recently used (oldest modification time) first."""
        found = []
        for entry in os.scandir(self.directory):
            match = _NAME.match(entry.name)
            if match is not None and entry.is_file():
                found.append((entry.stat().st_mtime_ns, entry.name, int(match.group(1), 16)))
        return [block_hash for _, _, block_hash in sorted(found)]

    def available_bytes(self) -> int:
        """Free space on the file system plus what this tier's files already take (they count in its size)."""
        own = sum(entry.stat().st_size for entry in os.scandir(self.directory) if _NAME.match(entry.name))
        return shutil.disk_usage(self.directory).free + own

    def write(self, block_hash: int, payload: memoryview) -> None:
        path = self.path(block_hash)
        tmp = path.with_name(f".{path.name}.tmp")
        header = _HEADER.pack(_MAGIC, self.fingerprint, block_hash, len(payload), zlib.crc32(payload))
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if not self._warned:  # once: a full disk would otherwise log every block
                logger.warning("KV disk tier: cannot write %s (%s); such blocks are recomputed when needed", path, e)
                self._warned = True

    def read_into(self, block_hash: int, out: memoryview) -> bool:
        """Fill ``out`` with the block's payload; False (``out`` undefined) if the file is missing, short, longer,
        of another fingerprint or block, or damaged. Marks the file used (its modification time: the LRU order a
        restart reads back)."""
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                if len(header) != _HEADER.size:
                    return False
                magic, fingerprint, stored_hash, size, crc = _HEADER.unpack(header)
                if (magic, fingerprint, stored_hash, size) != (_MAGIC, self.fingerprint, block_hash, len(out)):
                    return False
                if f.readinto(out) != len(out) or f.read(1) or zlib.crc32(out) != crc:
                    return False
            os.utime(path)
        except OSError:
            return False
        return True

    def delete(self, block_hash: int) -> None:
        self.path(block_hash).unlink(missing_ok=True)


class DiskKVTransfer:
    """Executes a step's disk plans between block files and the host tier's / the device's caches (storage order)."""

    def __init__(self, files: DiskKVFiles, host_caches: list[torch.Tensor], device_caches: list[torch.Tensor]) -> None:
        self.files = files
        self.host_caches = host_caches
        self.device_caches = device_caches

    def delete_and_store(self, deletes: list[int], stores: list[DiskStore]) -> None:
        """Run before the host tier's copies: a store reads a host block that they may overwrite."""
        for block_hash in deletes:
            self.files.delete(block_hash)
        if not self.device_caches:  # the no-op model keeps no K/V
            return
        for from_device, caches in ((False, self.host_caches), (True, self.device_caches)):
            batch = [store for store in stores if store.from_device == from_device]
            if batch:
                blocks = _gather(caches, [store.block_id for store in batch])  # [n, layers, 2, ...] on the CPU
                for store, block in zip(batch, blocks, strict=True):
                    self.files.write(store.block_hash, block.view(torch.uint8).numpy().data.cast("B"))

    def load(self, loads: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(block hash, device block id) pairs read into the device cache; returns those that failed."""
        if not loads or not self.device_caches:
            return []
        cache = self.device_caches[0]
        staging = torch.empty((len(loads), self.files.payload_bytes), dtype=torch.uint8)
        done: list[tuple[int, int]] = []  # (staging row, device block id)
        failed: list[tuple[int, int]] = []
        for index, (block_hash, device_block_id) in enumerate(loads):
            if self.files.read_into(block_hash, staging[index].numpy().data.cast("B")):
                done.append((index, device_block_id))
            else:
                failed.append((block_hash, device_block_id))
        if done:
            rows = torch.tensor([index for index, _ in done], dtype=torch.long)
            block_shape = (len(self.device_caches), *cache[:, 0].shape)  # [layers, 2, ...]: one block
            blocks = staging.index_select(0, rows).view(cache.dtype).view(len(done), *block_shape)
            blocks = blocks.to(cache.device)
            dst = torch.tensor([block_id for _, block_id in done], dtype=torch.long, device=cache.device)
            for layer, device_cache in enumerate(self.device_caches):
                device_cache.index_copy_(1, dst, blocks[:, layer].transpose(0, 1))
        return failed


def _gather(caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """Blocks ``block_ids`` of every layer as one contiguous CPU tensor [n, layers, 2, ...]: a file's payload each."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
    stacked = torch.stack([cache.index_select(1, idx) for cache in caches])  # [layers, 2, n, ...]
    return stacked.transpose(0, 2).transpose(1, 2).contiguous().cpu()  # [n, layers, 2, ...]


def open_disk_tier(
    path: str, size_gib: float, model_path: str, layout: dict[str, Any], payload_bytes: int, block_size: int
) -> tuple[DiskKVFiles, int, list[int]]:
    """The tier's directory for this model and layout, its capacity in blocks and the hashes found there (oldest
    first); logs both. ValueError naming the flag for a directory that cannot be written or a size that does not
    fit the disk."""
    fingerprint, described = kv_fingerprint(model_path, layout)
    files = DiskKVFiles(path, fingerprint, described, payload_bytes)
    num_blocks = resolve_num_disk_blocks(size_gib, files.file_bytes, files.available_bytes())
    hashes = files.listing()
    excess = len(hashes) - num_blocks
    logger.info(
        "KV disk tier: %d blocks of %d tokens (%.2f GiB) in %s; %d blocks found warm%s",
        num_blocks,
        block_size,
        num_blocks * files.file_bytes / 2**30,
        files.directory,
        min(len(hashes), num_blocks),
        f" (the {excess} oldest of {len(hashes)} files are deleted)" if excess > 0 else "",
    )
    return files, num_blocks, hashes

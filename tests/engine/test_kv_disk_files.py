"""The disk tier on the worker side (folio/worker/kv_disk.py): the block files written from host and device blocks
and read back into device blocks byte for byte (both cache layouts, float32 and bfloat16, CPU and CUDA where
present), the header checks that keep a foreign, damaged or short file from being used, the fingerprint (weights,
dtype, layout; not the path), the listing order, and the start-up errors naming the flags."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from folio.cli import build_parser, engine_args_from
from folio.config import CacheConfig, EngineArgs
from folio.core.sched_output import DiskStore
from folio.worker.kv_cache_shape import KVCacheShape
from folio.worker.kv_disk import DiskKVFiles, DiskKVTransfer, kv_fingerprint, open_disk_tier, resolve_num_disk_blocks
from folio.worker.kv_offload import HostKVCache, storage_view

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
LAYOUT = {"num_layers": 3, "block_size": 4, "num_kv_heads": 2, "head_dim": 8, "dtype": "torch.float32"}


def _model_file(directory: Path, content: bytes) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.gguf"
    path.write_bytes(content)
    return str(path)


def _transfer(tmp_path: Path, shape: KVCacheShape, device: torch.device, seed: int) -> DiskKVTransfer:
    """Random device (6 blocks) and host (5 blocks) caches, and block files for them under tmp_path."""
    gen = torch.Generator().manual_seed(seed)
    device_caches = shape.allocate(6, device)
    for cache in device_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(shape.dtype))
    host = HostKVCache(
        shape.num_layers, 5, shape.block_size, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.head_major, False
    )
    for cache in host.caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(shape.dtype))
    fingerprint, described = kv_fingerprint(_model_file(tmp_path / "model", b"weights"), {"dtype": str(shape.dtype)})
    files = DiskKVFiles(str(tmp_path / "disk"), fingerprint, described, shape.bytes_per_block)
    storage = [storage_view(cache, shape.head_major) for cache in device_caches]
    return DiskKVTransfer(files, host.caches, storage)


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_major", [False, True], ids=["token_major", "head_major"])
def test_blocks_round_trip_through_files(tmp_path: Path, device: torch.device, dtype: torch.dtype, head_major: bool):
    shape = KVCacheShape(3, 4, 2, 8, dtype, head_major)
    transfer = _transfer(tmp_path, shape, device, seed=1)
    host, dev = transfer.host_caches, transfer.device_caches
    expected = {
        0xA: [cache[:, 3].clone() for cache in host],
        0xB: [cache[:, 1].clone() for cache in host],
        0xC: [cache[:, 2].clone().cpu() for cache in dev],
    }
    transfer.delete_and_store([], [DiskStore(0xA, 3), DiskStore(0xB, 1), DiskStore(0xC, 2, from_device=True)])
    assert sorted(transfer.files.listing()) == [0xA, 0xB, 0xC]
    assert all(os.path.getsize(transfer.files.path(h)) == transfer.files.file_bytes for h in expected)
    untouched = [cache[:, 0].clone() for cache in dev]
    assert transfer.load([(0xC, 5), (0xA, 4), (0xB, 1)]) == []
    for block_hash, block_id in ((0xC, 5), (0xA, 4), (0xB, 1)):
        for layer, cache in enumerate(dev):
            assert torch.equal(cache[:, block_id].cpu(), expected[block_hash][layer]), (hex(block_hash), layer)
    assert all(torch.equal(cache[:, 0], before) for cache, before in zip(dev, untouched, strict=True))
    transfer.delete_and_store([0xA], [])
    assert sorted(transfer.files.listing()) == [0xB, 0xC]
    assert transfer.load([(0xA, 2)]) == [(0xA, 2)]  # deleted: the load fails, nothing is written


def test_foreign_damaged_or_short_files_are_never_used(tmp_path: Path) -> None:
    shape = KVCacheShape(3, 4, 2, 8, torch.float32)
    transfer = _transfer(tmp_path, shape, torch.device("cpu"), seed=2)
    files = transfer.files
    transfer.delete_and_store([], [DiskStore(h, h) for h in range(4)])
    before = [cache.clone() for cache in transfer.device_caches]
    shutil.copy(files.path(0), files.path(0x10))  # another block's file under this name: its header names block 0
    data = bytearray(files.path(1).read_bytes())
    data[-1] ^= 0xFF  # one payload byte flipped: the crc32 differs
    files.path(1).write_bytes(bytes(data))
    files.path(2).write_bytes(files.path(2).read_bytes()[:-4])  # short
    files.path(3).write_bytes(files.path(3).read_bytes() + b"x")  # longer
    other_fingerprint, described = kv_fingerprint(_model_file(tmp_path / "other", b"other weights"), {})
    other = DiskKVFiles(str(tmp_path / "disk"), other_fingerprint, described, files.payload_bytes)
    assert other.directory != files.directory and other.listing() == []  # another model lists nothing of these
    shutil.copy(files.path(0), other.path(0))  # this model's file planted in the other model's directory
    loads = [(0x10, 0), (1, 1), (2, 2), (3, 3)]
    assert transfer.load(loads) == loads
    assert DiskKVTransfer(other, transfer.host_caches, transfer.device_caches).load([(0, 4)]) == [(0, 4)]
    assert all(torch.equal(cache, old) for cache, old in zip(transfer.device_caches, before, strict=True))
    assert transfer.load([(0, 5)]) == []  # the intact file still loads


def test_fingerprint_covers_weights_and_layout_not_the_path(tmp_path: Path) -> None:
    def digest(path: str, layout: dict[str, object] = LAYOUT) -> str:
        return kv_fingerprint(path, layout)[0]

    model = _model_file(tmp_path / "a", b"x" * 3_000_000)
    moved = _model_file(tmp_path / "b", b"x" * 3_000_000)
    assert digest(model) == digest(moved)
    assert digest(model) != digest(_model_file(tmp_path / "c", b"x" * 2_999_999 + b"y"))  # last byte differs
    assert digest(model) != digest(model, {**LAYOUT, "dtype": "torch.bfloat16"})
    assert digest(model) != digest(model, {**LAYOUT, "block_size": 8})
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"num_hidden_layers": 2}')
    (hf / "model.safetensors").write_bytes(b"w" * 100)
    first = digest(str(hf))
    (hf / "config.json").write_text('{"num_hidden_layers": 3}')
    assert digest(str(hf)) != first


def test_listing_is_oldest_first_and_ignores_other_files(tmp_path: Path) -> None:
    files = DiskKVFiles(str(tmp_path), "ab" * 32, {}, 16)
    for age, block_hash in enumerate([0x3, 0x1, 0x2]):
        files.write(block_hash, memoryview(bytes(16)))
        os.utime(files.path(block_hash), ns=(10**18 + age * 10**9, 10**18 + age * 10**9))
    (files.directory / "notes.txt").write_text("not a block")
    (files.directory / f".{files.path(0x9).name}.tmp").write_bytes(b"cut short")
    assert files.listing() == [0x3, 0x1, 0x2]
    assert files.read_into(0x3, memoryview(bytearray(16)))  # a load makes it the most recently used
    assert files.listing() == [0x1, 0x2, 0x3]
    reopened = DiskKVFiles(str(tmp_path), "ab" * 32, {}, 16)  # a restart removes the partial write
    assert not list(reopened.directory.glob("*.tmp")) and reopened.listing() == [0x1, 0x2, 0x3]


def test_start_up_errors_name_the_flags(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--kv-offloading-disk-size 2 GiB \(2147483648 bytes\) is more than the disk"):
        resolve_num_disk_blocks(2.0, 1000, available_bytes=2**30)
    with pytest.raises(ValueError, match="--kv-offloading-disk-size 1e-09 GiB holds no KV block"):
        resolve_num_disk_blocks(1e-9, 1000, available_bytes=2**30)
    assert resolve_num_disk_blocks(0.5, 2**20, available_bytes=2**30) == 512
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=f"--kv-offloading-disk-path {blocker}/sub: cannot create or write"):
        open_disk_tier(str(blocker / "sub"), 0.01, _model_file(tmp_path / "m", b"w"), LAYOUT, 1024, 4)
    free = shutil.disk_usage(tmp_path).free / 2**30
    with pytest.raises(ValueError, match="is more than the disk space available"):
        open_disk_tier(str(tmp_path / "d"), free * 2 + 1, _model_file(tmp_path / "m", b"w"), LAYOUT, 1024, 4)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_offloading_disk_path": "/x", "kv_offloading_disk_size": -1.0}, "kv_offloading_disk_size must be >= 0"),
        ({"kv_offloading_disk_path": "/x", "kv_offloading_disk_size": float("nan")}, "kv_offloading_disk_size must"),
        ({"kv_offloading_disk_path": "/x"}, "kv_offloading_disk_path needs kv_offloading_disk_size"),
        ({"kv_offloading_disk_size": 1.0}, "kv_offloading_disk_size needs kv_offloading_disk_path"),
        ({"kv_offloading_disk_path": "/x", "kv_offloading_disk_size": 1.0, "kv_offloading_size": 0.0}, "host KV tier"),
        (
            {"kv_offloading_disk_path": "/x", "kv_offloading_disk_size": 1.0, "enable_prefix_caching": False},
            "needs enable_prefix_caching",
        ),
    ],
)
def test_config_errors_name_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheConfig(**{"kv_offloading_size": 1.0, **fields})  # type: ignore[arg-type]


def test_flags_reach_the_engine_config() -> None:
    ns = build_parser().parse_args(
        ["serve", "--kv-offloading-size", "1", "--kv-offloading-disk-path", "/d", "--kv-offloading-disk-size", "2.5"]
    )
    args = engine_args_from(ns)
    assert (args.kv_offloading_disk_path, args.kv_offloading_disk_size) == ("/d", 2.5)
    cache = args.create_engine_config("m.gguf", 2048).cache_config
    assert (cache.kv_offloading_disk_path, cache.kv_offloading_disk_size) == ("/d", 2.5)
    with pytest.raises(ValueError, match="host KV tier"):
        EngineArgs(kv_offloading_disk_path="/d", kv_offloading_disk_size=1.0).create_engine_config("m.gguf", 2048)

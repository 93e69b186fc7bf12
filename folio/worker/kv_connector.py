"""The worker's side of the KV transfer (disaggregated prefill): blocks' bytes out of the KV cache and back in.

A block's payload is every layer's K and V of that block, [layers, 2, block_size, num_kv_heads, head_dim] in the
cache's dtype, in that logical order whatever the cache's storage order (a head-major cache is read through its
token-major view), so that two instances whose attention backends store K/V differently still exchange blocks. The
fingerprint names what the bytes mean: the model (kv_disk.model_identity: its files, not its path) and the layout
(layers, block size, KV heads, head dim, dtype); a receiver loads only blocks of its own fingerprint and size.

Producer: ``WorkerKVConnector.finish_step`` runs after the step's forward (its K/V are written), sends each planned
request's prompt blocks (folio/kv_transfer/wire.py) and waits for the acks. Consumer: ``RemoteKVLoader.load`` runs
before the forward with the other tiers' loads; a refused block fails its request's load, which is recomputed.
"""

from __future__ import annotations

import logging
import time

import torch

from folio.core.sched_output import KVSend, KVTransferResult, ModelRunnerOutput, RemoteLoad, SchedulerOutput
from folio.kv_transfer import wire
from folio.worker.kv_cache_shape import KVCacheShape
from folio.worker.kv_disk import kv_fingerprint

logger = logging.getLogger("folio")

SEND_TIMEOUT_S = 10.0  # per socket operation: a consumer that does not answer fails the send, not the step


def kv_layout_fingerprint(model_path: str, shape: KVCacheShape) -> bytes:
    """sha256 of the model's identity and the payload's layout (32 bytes)."""
    layout = {
        "payload": "kv_transfer, [layers, 2, block_size, kv_heads, head_dim]",
        "num_layers": shape.num_layers,
        "block_size": shape.block_size,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "dtype": str(shape.dtype),
    }
    digest, _ = kv_fingerprint(model_path, layout)
    return bytes.fromhex(digest)


def gather_payloads(caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """The blocks' payloads as one contiguous CPU tensor of uint8 [n, bytes per block], in ``block_ids`` order."""
    cache = caches[0]  # [2, num_blocks, block_size, num_kv_heads, head_dim], any storage order
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    out = torch.empty((len(block_ids), len(caches), *cache[:, 0].shape), dtype=cache.dtype, device=cache.device)
    for layer, layer_cache in enumerate(caches):
        out[:, layer] = layer_cache.index_select(1, idx).transpose(0, 1)  # [n, 2, block_size, heads, dim]
    return out.cpu().view(len(block_ids), -1).view(torch.uint8)


def scatter_payloads(caches: list[torch.Tensor], block_ids: list[int], payloads: torch.Tensor) -> None:
    """``payloads`` (uint8 [n, bytes per block], as ``gather_payloads`` made them) into blocks ``block_ids``."""
    cache = caches[0]
    blocks = payloads.view(cache.dtype).view(len(block_ids), len(caches), *cache[:, 0].shape).to(cache.device)
    dst = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    for layer, layer_cache in enumerate(caches):
        layer_cache.index_copy_(1, dst, blocks[:, layer].transpose(0, 1))


class RemoteKVLoader:
    """Copies received blocks into fresh device blocks; refuses those of another fingerprint or size."""

    def __init__(self, caches: list[torch.Tensor], fingerprint: bytes, bytes_per_block: int) -> None:
        self.caches = caches
        self.fingerprint = fingerprint
        self.bytes_per_block = bytes_per_block
        self.num_failed = 0  # since the last ``take_num_failed``

    def load(self, loads: list[RemoteLoad]) -> list[tuple[int, int]]:
        """Returns the (block hash, device block id) of the loads refused."""
        good, failed = [], []
        for load in loads:
            if load.fingerprint == self.fingerprint and len(load.payload) == self.bytes_per_block:
                good.append(load)
            else:
                failed.append((load.block_hash, load.block_id))
        if failed:
            logger.warning("KV transfer: %d received blocks are of another model or KV layout: recomputed", len(failed))
        if good:
            rows = torch.stack([torch.frombuffer(load.payload, dtype=torch.uint8) for load in good])
            scatter_payloads(self.caches, [load.block_id for load in good], rows)
        self.num_failed += len(failed)
        return failed

    def take_num_failed(self) -> int:
        num_failed, self.num_failed = self.num_failed, 0
        return num_failed


class WorkerKVConnector:
    """The producer's sends after each step (and the consumer's failed-load count, reported with them)."""

    def __init__(self, caches: list[torch.Tensor], fingerprint: bytes, loader: RemoteKVLoader | None) -> None:
        self.caches = caches
        self.fingerprint = fingerprint
        self.loader = loader
        self._failing: set[tuple[str, int]] = set()  # destinations whose last send failed (logged once)

    def finish_step(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Send the step's planned blocks (not those of requests whose loads failed: their K/V were not computed);
        sets ``output.kv_transfer`` when anything happened."""
        num_failed_loads = self.loader.take_num_failed() if self.loader is not None else 0
        sends = [send for send in sched.kv_sends if send.req_id not in output.kv_load_failures]
        if not sends and not num_failed_loads:
            return
        result = KVTransferResult(num_failed_loads=num_failed_loads)
        start = time.perf_counter()
        for send in sends:
            self._send(send, result)
        result.send_seconds = time.perf_counter() - start if sends else 0.0
        output.kv_transfer = result

    def _send(self, send: KVSend, result: KVTransferResult) -> None:
        payloads = gather_payloads(self.caches, send.block_ids)
        destination = (send.host, send.port)
        try:
            wire.send_blocks(
                send.host, send.port, self.fingerprint, send.block_hashes, _bytes_view(payloads), SEND_TIMEOUT_S
            )
        except OSError as e:
            result.num_failed_sends += 1
            if destination not in self._failing:
                logger.warning(
                    "KV transfer: cannot send %s's blocks to %s:%d (%s); its decode recomputes them",
                    send.req_id,
                    send.host,
                    send.port,
                    e,
                )
                self._failing.add(destination)
            return
        self._failing.discard(destination)
        result.num_sent_blocks += len(send.block_ids)
        result.num_sent_bytes += payloads.numel()


def _bytes_view(payloads: torch.Tensor) -> memoryview:
    return memoryview(payloads.reshape(-1).numpy().data).cast("B")

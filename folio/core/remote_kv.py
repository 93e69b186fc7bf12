"""Blocks received from a prefill instance (disaggregated prefill), as a prefix-cache tier under the device's.

``RemoteKVStore``: block hash -> the block's raw K/V bytes (all layers, as the producer's worker laid them out) and
the producer's KV-layout fingerprint; LRU, bounded by ``kv_buffer_size`` bytes. The receiver thread
(folio/kv_transfer/receiver.py) puts, the scheduler's thread gets and pops: a lock guards it.
``RemoteKVTier``: the KV cache manager's side. A prefix lookup continues its chain here after the device, host and
disk tiers; each hit is taken out of the store when it is planned as a load into a fresh device block (the device's
prefix cache holds it from then on), and the worker copies the bytes in before the forward. A load the worker cannot
do (another model or layout) fails like a disk load: the request recomputes those tokens. Only bytes here: the
engine core stays torch-free.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from folio.core.sched_output import RemoteLoad


@dataclass(eq=False)
class RemoteBlock:
    block_hash: int
    fingerprint: bytes  # the producer's KV layout (worker/kv_connector.py); the consumer's worker checks it
    payload: bytearray  # [layers, 2 (K, V), block_size, kv_heads, head_dim] in the model's dtype


class RemoteKVStore:
    """Received blocks by hash, least recently used first, at most ``capacity_bytes`` of payload."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"kv_buffer_size must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[int, RemoteBlock] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.num_received_blocks_total = 0
        self.num_received_bytes_total = 0
        self.num_evicted_blocks_total = 0  # dropped unused to make room

    def put(self, blocks: Sequence[RemoteBlock]) -> int:
        """Store ``blocks`` (a hash held already is replaced); returns how many were stored. A block larger than the
        whole store is refused. Callers put a prompt's blocks tail first, so that when they do not all fit the head of
        the chain (the part a lookup can use) is what stays."""
        num_stored = 0
        with self._lock:
            for block in blocks:
                size = len(block.payload)
                self.num_received_blocks_total += 1
                self.num_received_bytes_total += size
                if size > self.capacity_bytes:
                    continue
                old = self._blocks.pop(block.block_hash, None)
                if old is not None:
                    self.nbytes -= len(old.payload)
                while self.nbytes + size > self.capacity_bytes:
                    _, victim = self._blocks.popitem(last=False)
                    self.nbytes -= len(victim.payload)
                    self.num_evicted_blocks_total += 1
                self._blocks[block.block_hash] = block
                self.nbytes += size
                num_stored += 1
        return num_stored

    def get(self, block_hash: int) -> RemoteBlock | None:
        """The block (now the most recently used), or None."""
        with self._lock:
            block = self._blocks.get(block_hash)
            if block is not None:
                self._blocks.move_to_end(block_hash)
            return block

    def pop(self, block_hash: int) -> RemoteBlock | None:
        with self._lock:
            block = self._blocks.pop(block_hash, None)
            if block is not None:
                self.nbytes -= len(block.payload)
            return block

    def hashes(self) -> list[int]:
        """Every hash held, least recently used first."""
        with self._lock:
            return list(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def usage(self) -> float:
        """Fraction of the capacity holding payload."""
        return self.nbytes / self.capacity_bytes


class RemoteKVTier:
    """Lookups in the store, this step's load plans, and the counts for metrics."""

    def __init__(self, store: RemoteKVStore) -> None:
        self.store = store
        self._loads: list[RemoteLoad] = []
        self.num_loaded_blocks_total = 0  # loads planned (remote prefix hits)
        # Used as the external prefix-cache counters when there is no host tier (which counts them otherwise).
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0

    def find(self, block_hash: int) -> RemoteBlock | None:
        return self.store.get(block_hash)

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.external_prefix_cache_queries += num_query_tokens
        self.external_prefix_cache_hits += num_hit_tokens

    def load_hits(self, blocks: Sequence[RemoteBlock], device_block_ids: Sequence[int]) -> None:
        """Plan loads of hits into fresh device blocks (same order); the hits leave the store (the caller holds them
        since the lookup, so a receiver's eviction in between changes nothing)."""
        for block, device_block_id in zip(blocks, device_block_ids, strict=True):
            self.store.pop(block.block_hash)
            self._loads.append(RemoteLoad(block.block_hash, device_block_id, block.fingerprint, block.payload))
        self.num_loaded_blocks_total += len(blocks)

    def take_plans(self) -> list[RemoteLoad]:
        """This step's loads, emptied."""
        loads, self._loads = self._loads, []
        return loads

    def find_leaks(self) -> list[str]:
        return [f"plans not taken: {len(self._loads)} remote loads"] if self._loads else []


@dataclass
class KVTransferStats:
    """Cumulative counts for metrics (the engine core's snapshot): the consumer's receives and loads, the producer's
    sends."""

    num_received_blocks: int = 0
    num_received_bytes: int = 0
    num_evicted_blocks: int = 0  # received blocks dropped from the full store before any request used them
    num_loaded_blocks: int = 0  # received blocks loaded into the device as prefix-cache hits
    num_failed_loads: int = 0  # received blocks the worker refused (another model or KV layout): recomputed
    buffer_usage: float = 0.0  # fraction of kv_buffer_size holding received blocks
    num_sent_blocks: int = 0
    num_sent_bytes: int = 0
    send_seconds: float = 0.0
    num_failed_sends: int = 0

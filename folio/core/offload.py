"""The host KV tier's bookkeeping: host block ids, hash -> host block map, ref counts and LRU, and the copy plans.

The host tier is a second ``BlockPool`` (ids 0 .. num_host_blocks - 1) whose blocks stand for host memory the
worker owns. This module only decides; the worker executes a step's plans before its forward, in the order of
``SchedulerOutput``: every store (device -> host), then every load (host -> device), then copy-on-write.

Who holds a host block (ref_count):
  * a swapped-out request, once per block it swapped out (``swapped``), until it resumes or ends;
  * a load planned this step (``_pinned``), until ``take_plans`` hands the plans out at the end of ``schedule()``:
    a host block being loaded in a step must not be reused by a store of the same step.
A host block with ref_count 0 is free: in the LRU free queue, still findable by its hash (a prefix cache that
survives device eviction) until a store reuses it. Stored and loaded blocks go to the tail (most recently used).
With a disk tier (core/disk_tier.py), the pool's ``on_evict`` writes a cached host block to disk before a store or
a swap-out reuses it; ``stored_from`` tells it where a host block stored earlier in the same step still is.
"""

from __future__ import annotations

from collections.abc import Sequence

from folio.core.block_pool import BlockPool, KVCacheBlock


class HostKVTier:
    """Host blocks, their prefix-cache map, swapped requests' blocks, and this step's store/load plans."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.swapped: dict[str, list[KVCacheBlock]] = {}  # request id -> its host blocks, in block-table order
        self._pinned: list[KVCacheBlock] = []  # sources of this step's loads (one reference each)
        self._stores: list[tuple[int, int]] = []  # (device block id, host block id)
        self._loads: list[tuple[int, int]] = []  # (host block id, device block id)
        # host block id -> the device block its last store of this step reads: a host block dropped again in the same
        # step holds that device block's K/V, not its own yet (the disk tier stores it from there)
        self.stored_from: dict[int, int] = {}
        self.num_blocks_to_cpu_total = 0  # stores planned
        self.num_blocks_to_device_total = 0  # loads planned
        self.external_prefix_cache_queries = 0  # tokens looked up here (those not found on the device)
        self.external_prefix_cache_hits = 0  # of which found here

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of host blocks held (swapped or being loaded); cached-but-free blocks count as free."""
        return self.pool.get_usage()

    def store_evicted(self, device_block_id: int, block_hash: int) -> None:
        """A cached device block is about to be reused: plan to save it here unless its hash is here already.

        Takes the LRU free host block (dropping whatever hash it held); does nothing if every host block is held.
        """
        if self.pool.get_cached_block(block_hash) is not None or self.pool.get_num_free_blocks() == 0:
            return
        (host_block,) = self.pool.get_new_blocks(1)
        self.pool.cache_full_blocks([host_block], [block_hash])
        self.pool.free_blocks([host_block])  # free but cached: at the LRU tail
        self._plan_store(device_block_id, host_block.block_id)

    def find_chain(self, block_hashes: Sequence[int]) -> list[KVCacheBlock]:
        """The host blocks of the longest prefix of ``block_hashes`` held here (stops at the first missing)."""
        blocks = []
        for block_hash in block_hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.external_prefix_cache_queries += num_query_tokens
        self.external_prefix_cache_hits += num_hit_tokens

    def pin(self, host_blocks: Sequence[KVCacheBlock]) -> None:
        """Hold prefix hits until ``take_plans``. Call before taking the device blocks they load into: taking those
        may evict device blocks whose stores would otherwise reuse these very host blocks."""
        self.pool.touch(host_blocks)
        self._pinned.extend(host_blocks)

    def load_hits(self, host_blocks: Sequence[KVCacheBlock], device_block_ids: Sequence[int]) -> None:
        """Plan loads of pinned prefix hits into fresh device blocks (same order)."""
        self._plan_loads(host_blocks, device_block_ids)

    def can_swap_out(self, block_hashes: Sequence[int | None]) -> bool:
        """Whether ``swap_out`` with these hashes would succeed (enough free host blocks)."""
        shared = [self.pool.get_cached_block(h) for h in block_hashes if h is not None]
        shared_blocks = [block for block in shared if block is not None]
        num_reused_free = sum(1 for block in shared_blocks if block.ref_count == 0)
        num_fresh = len(block_hashes) - len(shared_blocks)
        return num_fresh <= self.pool.get_num_free_blocks() - num_reused_free

    def swap_out(self, request_id: str, device_block_ids: Sequence[int], block_hashes: Sequence[int | None]) -> bool:
        """Take a preempted request's computed blocks: ``block_hashes[i]`` is device block i's hash, None for a
        partial or unhashed block. A hash already here is shared (no store); every other block gets a host block
        and a store. Returns False and changes nothing when the host tier cannot take them all."""
        if request_id in self.swapped:
            raise ValueError(f"request {request_id} is swapped out already")
        if len(device_block_ids) != len(block_hashes):
            raise ValueError(f"{len(device_block_ids)} blocks but {len(block_hashes)} hashes")
        if not self.can_swap_out(block_hashes):
            return False
        host_blocks: list[KVCacheBlock | None] = [
            self.pool.get_cached_block(h) if h is not None else None for h in block_hashes
        ]
        self.pool.touch(block for block in host_blocks if block is not None)
        for index, device_block_id in enumerate(device_block_ids):
            if host_blocks[index] is not None:
                continue
            (host_block,) = self.pool.get_new_blocks(1)
            block_hash = block_hashes[index]
            if block_hash is not None:
                self.pool.cache_full_blocks([host_block], [block_hash])
            host_blocks[index] = host_block
            self._plan_store(device_block_id, host_block.block_id)
        self.swapped[request_id] = [block for block in host_blocks if block is not None]
        return True

    def num_swapped_blocks(self, request_id: str) -> int | None:
        """How many blocks the request has swapped out here; None if it is not swapped out."""
        blocks = self.swapped.get(request_id)
        return None if blocks is None else len(blocks)

    def swap_in(self, request_id: str, device_block_ids: Sequence[int]) -> None:
        """Plan loads of a swapped request's blocks into ``device_block_ids`` (same order); its references become
        this step's pins, released by ``take_plans``."""
        host_blocks = self.swapped.pop(request_id)
        if len(device_block_ids) != len(host_blocks):
            raise ValueError(f"{len(host_blocks)} swapped blocks but {len(device_block_ids)} device blocks")
        self._pinned.extend(host_blocks)
        self._plan_loads(host_blocks, device_block_ids)

    def free_swapped(self, request_id: str) -> None:
        """A swapped request ended: drop its references (no-op if it is not swapped out)."""
        host_blocks = self.swapped.pop(request_id, None)
        if host_blocks:
            self.pool.free_blocks(host_blocks)

    def take_plans(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (stores, loads), emptied; the loaded host blocks are unpinned (to the LRU tail)."""
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        self.stored_from.clear()
        pinned, self._pinned = self._pinned, []
        self.pool.free_blocks(pinned)
        return stores, loads

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only while no host block is held. Returns success."""
        return self.pool.reset_prefix_cache()

    def find_leaks(self) -> list[str]:
        """Problems once every request ended: swapped requests left, pins or plans not taken, held blocks."""
        problems = []
        if self.swapped:
            problems.append(f"swapped requests still hold host blocks: {sorted(self.swapped)}")
        if self._pinned or self._stores or self._loads:
            problems.append(f"plans not taken: {len(self._stores)} stores, {len(self._loads)} loads")
        problems.extend(self.pool.find_leaks())
        return problems

    def _plan_store(self, device_block_id: int, host_block_id: int) -> None:
        self._stores.append((device_block_id, host_block_id))
        self.stored_from[host_block_id] = device_block_id
        self.num_blocks_to_cpu_total += 1

    def _plan_loads(self, host_blocks: Sequence[KVCacheBlock], device_block_ids: Sequence[int]) -> None:
        for host_block, device_block_id in zip(host_blocks, device_block_ids, strict=True):
            self._loads.append((host_block.block_id, device_block_id))
        self.num_blocks_to_device_total += len(host_blocks)

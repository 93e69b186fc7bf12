"""KV blocks, their ref counts, the LRU free queue and the prefix-cache map ``block_hash -> block``.

A block is in exactly one of two states:
  * in use: ref_count >= 1 (one per request whose block list holds it), NOT in the free queue;
  * free: ref_count == 0, in the free queue. A free block may still carry a hash: its K/V stay valid and a
    prefix hit can revive it (``touch``) until ``get_new_blocks`` pops it for reuse, which evicts the hash.
So the free queue doubles as the eviction order: the head is evicted first (least recently freed).
All num_blocks blocks are usable (no reserved null block): the worker pads unused block-table entries with 0
and never reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class KVCacheBlock:
    """One KV block. Identity equality (eq=False): two blocks are never "equal", and the links are not compared."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is in the prefix-cache map
    # Intrusive links of the free queue; None when not linked (or at the ends).
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly-linked list threaded through the blocks themselves: O(1) popleft, append and remove-from-middle.

    A ``collections.deque`` cannot remove from the middle in O(1), which a prefix hit on a free block needs.
    Order is LRU: freed blocks are appended at the tail, eviction pops the head.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (the least recently freed block). Raises ValueError when empty."""
        block = self._head
        if block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the tail (most recently freed, evicted last)."""
        block.prev_free_block = self._tail
        block.next_free_block = None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free_block = block
        self._tail = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is. The caller guarantees it is in this queue (ref_count == 0)."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None:
            self._head = next_block
        else:
            prev_block.next_free_block = next_block
        if next_block is None:
            self._tail = prev_block
        else:
            next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail, i.e. in eviction order. O(n): for tests and debugging."""
        blocks = []
        block = self._head
        while block is not None:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class BlockPool:
    """Owns every KV block: hands out free ones, tracks ref counts, and keeps the prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        # Initially blocks are handed out in id order: 0, 1, 2, ...
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # One block per hash: when two blocks hold the same tokens, the first one cached is the one hits find.
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        # Called as (block id, block hash) when a cached block is about to be reused: its K/V are still intact
        # until the step's forward, so a lower tier can plan to save them (core/offload.py). None: dropped.
        self.on_evict: Callable[[int, int], None] | None = None

    def find_leaks(self) -> list[str]:
        """Problems once every request ended: a block still referenced, or fewer free blocks than the pool holds."""
        held = [(block.block_id, block.ref_count) for block in self.blocks if block.ref_count != 0]
        problems = []
        if self.get_num_free_blocks() != self.num_blocks:
            problems.append(f"{self.get_num_free_blocks()} of {self.num_blocks} blocks free")
        if held:
            problems.append(f"(block id, ref_count) not 0: {held}")
        return problems

    def get_num_free_blocks(self) -> int:
        """Free blocks, including free blocks that still hold cached K/V (they are evictable)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use (ref_count >= 1), in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the free-queue head, each with ref_count 1.

        A popped block that carried a hash is evicted from the prefix cache: its K/V are about to be overwritten.
        Raises ValueError (and changes nothing) if fewer blocks are free.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks, only {self.get_num_free_blocks()} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            assert block.ref_count == 0, f"free block {block.block_id} has ref_count {block.ref_count}"
            self._evict_cached_block(block)
            block.ref_count = 1
            new_blocks.append(block)
        return new_blocks

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
        block.block_hash = None

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """The block holding the K/V of the prefix that ends with this block hash, in use or free; else None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block; a free (cached) block leaves the free queue: it is revived."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_block_queue.remove(block)
            block.ref_count += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; a block reaching 0 goes to the free-queue tail, in the given order.

        The order is the eviction order among them (first given, first evicted); see ``KVCacheManager.free``.
        Its hash stays: the block can still be hit until it is reused.
        """
        for block in ordered_blocks:
            if block.ref_count <= 0:
                raise AssertionError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int]) -> int:
        """Enter full blocks into the prefix cache: ``blocks[i]`` holds the K/V whose chain hash is ``block_hashes[i]``.

        A block already cached is skipped; if another block already has the hash, the first one stays and this
        block is left uncached (so that eviction of either one stays a single map lookup).
        Returns the number of blocks newly cached. No-op when caching is disabled.
        """
        if not self.enable_caching:
            return 0
        if len(blocks) != len(block_hashes):
            raise ValueError(f"{len(blocks)} blocks but {len(block_hashes)} hashes")
        num_cached = 0
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            num_cached += 1
        return num_cached

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after weights change). Only when no block is in use; returns success."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

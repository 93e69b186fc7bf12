"""The disk KV tier's bookkeeping: which block hashes have a file, in LRU order, and this step's plans.

It sits under the host tier (core/offload.py). A cached host block about to be reused (the host tier's LRU drop)
is written here first unless its hash has a file already; a prefix lookup continues its chain here after the
device and host tiers, and those hits are loaded straight into fresh device blocks. Files are named by block hash
inside a directory fingerprinted by the model and the KV layout (worker/kv_disk.py), so the index is a set of
hashes: a restarted server rebuilds it from the directory listing (``block_hashes``, oldest first) and finds its
prefix cache warm. The worker does every file operation; this module only decides.

Capacity is in blocks. At capacity a store drops the least recently used hash (its file is deleted), never one
being loaded this step (pinned until ``take_plans``). Plans stay consistent within a step: a hash dropped and then
stored again keeps its file (the delete is cancelled: a hash names the same K/V), and a hash stored and then
dropped again is never written. A load can still fail (a file deleted or damaged behind the engine's back): the
worker reports it, the request recomputes those tokens, and ``forget`` drops the hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from folio.core.block_pool import BlockPool
from folio.core.sched_output import DiskStore, KVDiskPlans


class DiskKVTier:
    """Hashes with a file (LRU first), this step's pins, and its store / load / delete plans."""

    def __init__(self, num_blocks: int, block_hashes: Sequence[int] = ()) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_disk_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # hash -> None, least recently used first
        self._pinned: set[int] = set()  # sources of this step's loads
        self._stores: dict[int, DiskStore] = {}  # by hash, in plan order
        self._loads: list[tuple[int, int]] = []  # (block hash, device block id)
        self._deletes: dict[int, None] = {}  # an ordered set of hashes whose files go
        listing = list(dict.fromkeys(block_hashes))
        num_excess = max(0, len(listing) - num_blocks)  # a restart with a smaller size: the oldest files go
        self._deletes.update(dict.fromkeys(listing[:num_excess]))
        self._lru.update(dict.fromkeys(listing[num_excess:]))
        self.num_warm_blocks = len(self._lru)  # found at start
        self.num_blocks_to_disk_total = 0  # stores handed to the worker
        self.num_blocks_from_disk_total = 0  # loads handed to the worker
        self.num_failed_loads_total = 0  # loads the worker could not do (``forget``)

    @property
    def usage(self) -> float:
        """Fraction of the capacity holding a block."""
        return len(self._lru) / self.num_blocks

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def hashes(self) -> list[int]:
        """Every hash held, least recently used first (for tests and the flush)."""
        return list(self._lru)

    def store(self, block_hash: int, block_id: int, from_device: bool = False) -> None:
        """Keep the block's K/V here (see ``DiskStore`` for the source): a hash held already only becomes the most
        recently used. At capacity the LRU unpinned hash is dropped; with every hash pinned nothing is stored."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return
        if len(self._lru) >= self.num_blocks and not self._drop_lru():
            return
        self._lru[block_hash] = None
        if block_hash in self._deletes:  # dropped earlier in this step: its file is still there
            del self._deletes[block_hash]
            return
        self._stores[block_hash] = DiskStore(block_hash, block_id, from_device)

    def store_cached_blocks(self, pool: BlockPool, from_device: bool) -> None:
        """Plan stores of every block the pool's prefix cache holds (free ones, oldest first, then held ones)."""
        free = pool.free_block_queue.get_all_free_blocks()
        held = [block for block in pool.blocks if block.ref_count > 0]
        for block in [*free, *held]:
            if block.block_hash is not None and pool.get_cached_block(block.block_hash) is block:
                self.store(block.block_hash, block.block_id, from_device)

    def _drop_lru(self) -> bool:
        victim = next((h for h in self._lru if h not in self._pinned), None)
        if victim is None:
            return False
        del self._lru[victim]
        if self._stores.pop(victim, None) is None:  # written before this step: delete the file
            self._deletes[victim] = None
        return True

    def pin(self, block_hashes: Iterable[int]) -> None:
        """Hold prefix hits until ``take_plans`` (most recently used now). Call before taking the device blocks they
        load into: the evictions that takes may drop host blocks into this tier, which must not drop these."""
        for block_hash in block_hashes:
            self._lru.move_to_end(block_hash)
            self._pinned.add(block_hash)

    def load_hits(self, block_hashes: Sequence[int], device_block_ids: Sequence[int]) -> None:
        """Plan loads of pinned prefix hits into fresh device blocks (same order)."""
        for block_hash, device_block_id in zip(block_hashes, device_block_ids, strict=True):
            if block_hash not in self._pinned:
                raise ValueError(f"disk block {block_hash:#x} is loaded without a pin")
            self._loads.append((block_hash, device_block_id))

    def forget(self, block_hashes: Iterable[int]) -> None:
        """The worker could not load these: drop them (their files, if any, are deleted)."""
        for block_hash in block_hashes:
            if block_hash in self._lru and block_hash not in self._pinned:
                del self._lru[block_hash]
                if self._stores.pop(block_hash, None) is None:
                    self._deletes[block_hash] = None
            self.num_failed_loads_total += 1

    def reset(self) -> bool:
        """Forget every hash (their files are deleted); only while nothing is pinned. Returns success."""
        if self._pinned:
            return False
        for block_hash in list(self._lru):
            del self._lru[block_hash]
            if self._stores.pop(block_hash, None) is None:
                self._deletes[block_hash] = None
        return True

    def take_plans(self) -> KVDiskPlans:
        """This step's plans, emptied; the loads' hashes are unpinned."""
        plans = KVDiskPlans(list(self._stores.values()), self._loads, list(self._deletes))
        self._stores, self._loads, self._deletes = {}, [], {}
        self._pinned.clear()
        self.num_blocks_to_disk_total += len(plans.stores)
        self.num_blocks_from_disk_total += len(plans.loads)
        return plans

    def find_leaks(self) -> list[str]:
        """Problems once every request ended: pins or plans not taken."""
        if self._pinned or self._stores or self._loads:
            return [f"plans not taken: {len(self._stores)} stores, {len(self._loads)} loads, {len(self._pinned)} pins"]
        return []

"""The prefix-cache tiers under the device's, as the KV cache manager sees them: host, disk, remote.

A prefix lookup continues its chain past the device's blocks here, block by block: a host block (core/offload.py),
else a hash the disk tier holds (core/disk_tier.py), else a block received from a prefill instance
(core/remote_kv.py); it stops at the first block in none of them. The hits are loaded into the first fresh device
blocks the request gets: host and disk hits are pinned first (taking device blocks may evict device blocks into the
host tier, and host blocks into the disk tier, which must not reuse or drop them); a remote hit is held by reference.
"""

from __future__ import annotations

from collections.abc import Sequence

from folio.core.block_pool import KVCacheBlock
from folio.core.disk_tier import DiskKVTier
from folio.core.offload import HostKVTier
from folio.core.remote_kv import RemoteBlock, RemoteKVTier

# A hit past the device: a host block, a block hash held by the disk tier, or a received block.
LowerHit = KVCacheBlock | int | RemoteBlock


class LowerTiers:
    """The tiers that exist (None for the others), and the chain and load plans over them."""

    def __init__(
        self, host_tier: HostKVTier | None, disk_tier: DiskKVTier | None, remote_tier: RemoteKVTier | None
    ) -> None:
        self.host_tier = host_tier
        self.disk_tier = disk_tier
        self.remote_tier = remote_tier

    def __bool__(self) -> bool:
        return self.host_tier is not None or self.remote_tier is not None

    def find_chain(self, block_hashes: Sequence[int]) -> list[LowerHit]:
        """Per hash its host block, else the hash if the disk tier holds it, else the received block; stops at the
        first block in none of them."""
        hits: list[LowerHit] = []
        for block_hash in block_hashes:
            hit = self._find(block_hash)
            if hit is None:
                break
            hits.append(hit)
        return hits

    def _find(self, block_hash: int) -> LowerHit | None:
        if self.host_tier is not None:
            block = self.host_tier.pool.get_cached_block(block_hash)
            if block is not None:
                return block
        if self.disk_tier is not None and block_hash in self.disk_tier:
            return block_hash
        return self.remote_tier.find(block_hash) if self.remote_tier is not None else None

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """The external prefix-cache counts: the host tier's when there is one, else the remote tier's."""
        recorder = self.host_tier if self.host_tier is not None else self.remote_tier
        if recorder is not None:
            recorder.record_query(num_query_tokens, num_hit_tokens)

    def pin(self, hits: Sequence[LowerHit]) -> None:
        if self.host_tier is not None:
            self.host_tier.pin([hit for hit in hits if isinstance(hit, KVCacheBlock)])
        if self.disk_tier is not None:
            self.disk_tier.pin([hit for hit in hits if isinstance(hit, int)])

    def plan_loads(self, req_id: str, hits: Sequence[LowerHit], fresh_block_ids: list[int]) -> None:
        """Hits, or a swapped request's blocks, are loaded into the first fresh device blocks."""
        pairs = list(zip(hits, fresh_block_ids, strict=False))
        host_pairs = [(hit, block_id) for hit, block_id in pairs if isinstance(hit, KVCacheBlock)]
        if host_pairs and self.host_tier is not None:
            self.host_tier.load_hits([hit for hit, _ in host_pairs], [block_id for _, block_id in host_pairs])
        disk_pairs = [(hit, block_id) for hit, block_id in pairs if isinstance(hit, int)]
        if disk_pairs and self.disk_tier is not None:
            self.disk_tier.load_hits([hit for hit, _ in disk_pairs], [block_id for _, block_id in disk_pairs])
        remote_pairs = [(hit, block_id) for hit, block_id in pairs if isinstance(hit, RemoteBlock)]
        if remote_pairs and self.remote_tier is not None:
            self.remote_tier.load_hits([hit for hit, _ in remote_pairs], [block_id for _, block_id in remote_pairs])
        if self.host_tier is not None and (num_swapped := self.host_tier.num_swapped_blocks(req_id)) is not None:
            self.host_tier.swap_in(req_id, fresh_block_ids[:num_swapped])

    def store_to_disk(self, host_block_id: int, block_hash: int) -> None:
        """The host pool's on_evict: a cached host block is about to be reused; keep its K/V on disk. If this step
        stored it from a device block, its K/V are still in that device block only (stores run before loads)."""
        assert self.host_tier is not None and self.disk_tier is not None
        device_block_id = self.host_tier.stored_from.get(host_block_id)
        if device_block_id is None:
            self.disk_tier.store(block_hash, host_block_id)
        else:
            self.disk_tier.store(block_hash, device_block_id, from_device=True)

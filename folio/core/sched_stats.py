"""SchedulerStats: the scheduler's snapshot for metrics (the server's /metrics and the periodic log line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from folio.core.disk_tier import DiskKVTier
from folio.core.offload import HostKVTier
from folio.core.remote_kv import KVTransferStats, RemoteKVTier
from folio.core.spec_decode import SpecDecodingStats

if TYPE_CHECKING:
    from folio.core.kv_cache_manager import KVCacheManager


@dataclass
class SchedulerStats:
    """A snapshot for metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions_total: int  # every preemption, swapped or recomputed
    # KV occupancy: tokens whose K/V the running requests hold (a shared prefix counts once per request), and the
    # slots of every block in use (block_size x blocks with ref_count >= 1). live / held is the fraction of the
    # allocated KV memory that holds live tokens; paging keeps it near 1, a max-length allocation would not.
    num_kv_live_tokens: int = 0
    num_kv_held_slots: int = 0
    # Host KV tier (core/offload.py); all 0 without one.
    kv_offload_blocks_to_cpu_total: int = 0  # stores planned (evicted prefix blocks and swapped-out blocks)
    kv_offload_blocks_to_device_total: int = 0  # loads planned (host prefix hits and swapped-in blocks)
    kv_offload_cpu_usage: float = 0.0  # fraction of host blocks held; cached-but-free counts as free
    external_prefix_cache_queries: int = 0  # tokens looked up past the device (host, disk, received blocks)
    external_prefix_cache_hits: int = 0  # of which found there
    num_swapped_preemptions_total: int = 0  # preemptions done by swap
    # Disk KV tier (core/disk_tier.py); all 0 without one.
    kv_offload_blocks_to_disk_total: int = 0  # files written (host blocks dropped, and the shutdown flush)
    kv_offload_blocks_from_disk_total: int = 0  # files loaded into device blocks (disk prefix hits)
    kv_offload_disk_usage: float = 0.0  # fraction of the disk tier's blocks holding a block
    kv_offload_disk_failed_loads_total: int = 0  # loads the worker could not do (missing or foreign file)
    # Speculative decoding: the scheduler's cumulative counts since start (all 0 when nothing was drafted).
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    kv_transfer: KVTransferStats | None = None  # disaggregated prefill (set by the engine core); None: off

    @classmethod
    def snapshot(
        cls,
        kv: KVCacheManager,
        num_running: int,
        num_waiting: int,
        num_preemptions_total: int,
        num_swapped_preemptions_total: int,
        num_kv_live_tokens: int,
        spec_decoding: SpecDecodingStats | None = None,
    ) -> SchedulerStats:
        """The scheduler's counts, with every KV figure read from the cache manager and its tiers (and a copy of
        the speculative decoding counts: the scheduler goes on adding to its own)."""
        stats = cls(
            num_running=num_running,
            num_waiting=num_waiting,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions_total=num_preemptions_total,
            num_kv_live_tokens=num_kv_live_tokens,
            num_kv_held_slots=kv.num_used_blocks * kv.block_size,
            num_swapped_preemptions_total=num_swapped_preemptions_total,
            spec_decoding=spec_decoding.snapshot() if spec_decoding is not None else SpecDecodingStats(),
        )
        stats.set_tiers(kv.host_tier, kv.disk_tier, kv.remote_tier)
        return stats

    def set_tiers(self, host: HostKVTier | None, disk: DiskKVTier | None, remote: RemoteKVTier | None = None) -> None:
        """Fill the host and disk tiers' fields from their counters (left 0 for a tier that does not exist); without
        a host tier, the received blocks' tier counts the external prefix-cache queries and hits."""
        if remote is not None:
            self.external_prefix_cache_queries = remote.external_prefix_cache_queries
            self.external_prefix_cache_hits = remote.external_prefix_cache_hits
        if host is not None:
            self.kv_offload_blocks_to_cpu_total = host.num_blocks_to_cpu_total
            self.kv_offload_blocks_to_device_total = host.num_blocks_to_device_total
            self.kv_offload_cpu_usage = host.usage
            self.external_prefix_cache_queries = host.external_prefix_cache_queries
            self.external_prefix_cache_hits = host.external_prefix_cache_hits
        if disk is not None:
            self.kv_offload_blocks_to_disk_total = disk.num_blocks_to_disk_total
            self.kv_offload_blocks_from_disk_total = disk.num_blocks_from_disk_total
            self.kv_offload_disk_usage = disk.usage
            self.kv_offload_disk_failed_loads_total = disk.num_failed_loads_total

"""SchedulerStats: the scheduler's snapshot for metrics (the server's /metrics and the periodic log line)."""

from __future__ import annotations

from dataclasses import dataclass


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
    external_prefix_cache_queries: int = 0  # tokens looked up in the host tier (those not found on the device)
    external_prefix_cache_hits: int = 0  # of which found there
    num_swapped_preemptions_total: int = 0  # preemptions done by swap

"""The disk KV tier's metrics from scheduler snapshots (issue 18): the to_disk / from_disk directions of
folio:kv_offload_blocks_total and the failed-load counter advance by the cumulative counts' differences, the usage
gauge follows the last snapshot, and all are exposed at 0 before the first step."""

from __future__ import annotations

from folio.engine.stats import IterationStats, SchedulerStats
from folio.server.metrics import PrometheusStatLogger
from tests.server.conftest import direction_values

KEYS = [
    ("folio:kv_offload_blocks_total", "to_disk"),
    ("folio:kv_offload_blocks_total", "from_disk"),
    ("folio:kv_offload_disk_usage_perc", ""),
    ("folio:kv_offload_disk_failed_loads_total", ""),
]


def _snapshot(to_disk: int, from_disk: int, usage: float, failed: int) -> SchedulerStats:
    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0)
    stats.kv_offload_blocks_to_disk_total = to_disk
    stats.kv_offload_blocks_from_disk_total = from_disk
    stats.kv_offload_disk_usage = usage
    stats.kv_offload_disk_failed_loads_total = failed
    return stats


def test_disk_tier_counters_follow_the_snapshots() -> None:
    prom = PrometheusStatLogger("m")
    assert [direction_values(prom)[key] for key in KEYS] == [0.0] * 4
    prom.record(_snapshot(5, 2, 0.25, 1), IterationStats())
    prom.record(_snapshot(9, 2, 0.5, 1), IterationStats())
    prom.record(SchedulerStats(0, 0, 0.0, 0, 0, 0), IterationStats())  # no disk tier: nothing moves back
    assert [direction_values(prom)[key] for key in KEYS] == [9.0, 2.0, 0.0, 1.0]
    assert direction_values(prom)[("folio:kv_offload_blocks_total", "to_cpu")] == 0.0  # the host tier's own directions

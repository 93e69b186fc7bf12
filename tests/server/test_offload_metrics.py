"""The host KV tier's metrics (issue 18) from scheduler snapshots: counters advance by the cumulative counts'
differences, the usage gauge follows the last snapshot, a snapshot without the fields counts 0, and the periodic
line adds the CPU tier's usage and hit rate only when a host tier exists."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from folio.engine.stats import IterationStats, SchedulerStats
from folio.server.metrics import LoggingStatLogger, PrometheusStatLogger
from tests.server.conftest import direction_values


@dataclass
class TieredStats(SchedulerStats):
    """A snapshot with the host tier's fields, as the core's SchedulerStats carries them."""

    kv_offload_blocks_to_cpu_total: int = 0
    kv_offload_blocks_to_device_total: int = 0
    kv_offload_cpu_usage: float = 0.0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_swapped_preemptions_total: int = 0


def _snapshot(**fields: float) -> TieredStats:
    return TieredStats(0, 0, 0.0, 0, 0, 0, **fields)  # type: ignore[arg-type]


def test_host_tier_counters_follow_the_snapshots() -> None:
    prom = PrometheusStatLogger("m")
    values = direction_values(prom)
    for key in [
        ("folio:kv_offload_blocks_total", "to_cpu"),
        ("folio:kv_offload_blocks_total", "to_device"),
        ("folio:kv_offload_cpu_usage_perc", ""),
        ("folio:external_prefix_cache_queries_total", ""),
        ("folio:external_prefix_cache_hits_total", ""),
        ("folio:num_swapped_preemptions_total", ""),
    ]:
        assert values[key] == 0.0, key  # exposed before the first step
    prom.record(_snapshot(kv_offload_blocks_to_cpu_total=5, kv_offload_cpu_usage=0.25), IterationStats())
    prom.record(
        _snapshot(
            kv_offload_blocks_to_cpu_total=7,
            kv_offload_blocks_to_device_total=3,
            kv_offload_cpu_usage=0.5,
            external_prefix_cache_queries=64,
            external_prefix_cache_hits=48,
            num_swapped_preemptions_total=2,
        ),
        IterationStats(),
    )
    prom.record(SchedulerStats(0, 0, 0.0, 0, 0, 0), IterationStats())  # no host-tier fields: nothing moves back
    values = direction_values(prom)
    assert values[("folio:kv_offload_blocks_total", "to_cpu")] == 7
    assert values[("folio:kv_offload_blocks_total", "to_device")] == 3
    assert values[("folio:kv_offload_cpu_usage_perc", "")] == 0.0  # the last snapshot's
    assert values[("folio:external_prefix_cache_queries_total", "")] == 64
    assert values[("folio:external_prefix_cache_hits_total", "")] == 48
    assert values[("folio:num_swapped_preemptions_total", "")] == 2


@pytest.mark.parametrize("host_tier", [False, True])
def test_periodic_line_adds_the_cpu_tier(host_tier: bool, caplog: pytest.LogCaptureFixture) -> None:
    line = LoggingStatLogger(interval_s=3600.0, host_tier=host_tier)
    line.record(_snapshot(kv_offload_cpu_usage=0.125, external_prefix_cache_queries=100), IterationStats())
    line.record(
        _snapshot(kv_offload_cpu_usage=0.5, external_prefix_cache_queries=200, external_prefix_cache_hits=50),
        IterationStats(),
    )
    with caplog.at_level(logging.INFO, logger="folio"):
        line.log()
        line.record(
            _snapshot(kv_offload_cpu_usage=0.5, external_prefix_cache_queries=300, external_prefix_cache_hits=150),
            IterationStats(),
        )
        line.log()
    first, second = [r.getMessage() for r in caplog.records]
    if host_tier:
        assert first.endswith("CPU KV cache usage: 50.0%, CPU prefix cache hit rate: 25.0%")
        assert second.endswith("CPU prefix cache hit rate: 100.0%")  # this interval only: 100 of 100
    else:
        assert "CPU" not in first + second

"""Speculative decoding's metrics from scheduler snapshots, in process: vLLM's counters under folio: advance by the
cumulative counts' differences (every series at 0 from the start, only with speculation on), and the periodic line
adds the interval's mean acceptance length and per-position acceptance rates."""

from __future__ import annotations

import logging

import pytest

from folio.core.spec_decode import SpecDecodingStats
from folio.engine.stats import IterationStats, SchedulerStats
from folio.server.metrics import LoggingStatLogger, PrometheusStatLogger
from tests.server.conftest import parse_metrics

NAMES = ["num_drafts", "num_draft_tokens", "num_accepted_tokens"]


def _snapshot(drafts: list[tuple[int, int]]) -> SchedulerStats:
    """A snapshot whose cumulative counts are those of the (draft tokens, accepted) verifications given."""
    stats = SpecDecodingStats()
    for num_draft_tokens, num_accepted in drafts:
        stats.observe(num_draft_tokens, num_accepted)
    return SchedulerStats(0, 0, 0.0, 0, 0, 0, spec_decoding=stats)


def _values(prom: PrometheusStatLogger) -> dict[str, float]:
    values = parse_metrics(prom.render().decode())
    return {k: v for k, v in values.items() if k.startswith("folio:spec_decode") and "_created" not in k}


def test_counters_follow_the_cumulative_counts() -> None:
    prom = PrometheusStatLogger("m", num_speculative_tokens=3)
    per_pos = 'folio:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="%d"}'
    assert _values(prom) == {
        **{f'folio:spec_decode_{name}_total{{engine="0",model_name="m"}}': 0.0 for name in NAMES},
        **{per_pos % i: 0.0 for i in range(3)},
    }
    prom.record(_snapshot([(3, 2)]), IterationStats())
    prom.record(_snapshot([(3, 2), (3, 3), (2, 0)]), IterationStats())
    prom.record(_snapshot([(3, 2), (3, 3), (2, 0)]), IterationStats())  # nothing new: nothing moves
    values = _values(prom)
    assert [values[f'folio:spec_decode_{name}_total{{engine="0",model_name="m"}}'] for name in NAMES] == [3, 8, 5]
    assert [values[per_pos % i] for i in range(3)] == [2, 2, 1]


def test_no_speculation_no_series() -> None:
    prom = PrometheusStatLogger("m")
    prom.record(_snapshot([(3, 2)]), IterationStats())
    assert _values(prom) == {}


@pytest.mark.parametrize("spec_decode", [False, True])
def test_periodic_line_adds_the_acceptance(spec_decode: bool, caplog: pytest.LogCaptureFixture) -> None:
    line = LoggingStatLogger(interval_s=3600.0, spec_decode=spec_decode)
    with caplog.at_level(logging.INFO, logger="folio"):
        line.record(_snapshot([(4, 4), (4, 1)]), IterationStats())
        line.log()
        line.record(_snapshot([(4, 4), (4, 1), (4, 0), (2, 2)]), IterationStats())  # this interval: 2 drafts
        line.log()
        line.log()  # nothing drafted since: no part
    first, second, third = [r.getMessage() for r in caplog.records]
    if spec_decode:
        assert first.endswith(
            "Mean acceptance length: 3.50, Avg draft acceptance rate: 62.5%, "
            "Per-position acceptance rate: 1.000, 0.500, 0.500, 0.500"
        )
        assert second.endswith(
            "Mean acceptance length: 2.00, Avg draft acceptance rate: 33.3%, "
            "Per-position acceptance rate: 0.500, 0.500, 0.000, 0.000"
        )
    assert "acceptance" not in third + ("" if spec_decode else first + second)

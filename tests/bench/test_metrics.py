"""Arrival schedule and vLLM's serving metrics computed from synthetic timestamps."""

from __future__ import annotations

import numpy as np
import pytest

from folio.bench.metrics import RequestResult, arrival_offsets, compute_metrics, is_good, parse_goodput


def test_gamma_arrivals_end_at_n_over_rate() -> None:
    offsets = arrival_offsets(50, 4.0, 0.5, seed=7)
    assert offsets[-1] == pytest.approx(50 / 4.0)
    assert offsets == sorted(offsets) and offsets[0] > 0
    assert offsets == arrival_offsets(50, 4.0, 0.5, seed=7)
    assert arrival_offsets(5, float("inf"), 1.0, seed=0) == [0.0] * 5


def test_poisson_mean_interval() -> None:
    offsets = np.asarray(arrival_offsets(20000, 10.0, 1.0, seed=1))
    gaps = np.diff(np.concatenate([[0.0], offsets]))
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)  # rescaled to end at N/rate exactly
    assert gaps.std() == pytest.approx(0.1, rel=0.05)  # exponential: std == mean


def _result(prompt_len: int, ttft: float, itl: list[float], output_tokens: int) -> RequestResult:
    return RequestResult(
        prompt_len=prompt_len, success=True, ttft=ttft, itl=itl, e2el=ttft + sum(itl), output_tokens=output_tokens
    )


def test_metrics_from_synthetic_timestamps() -> None:
    a = _result(10, 0.100, [0.020, 0.030, 0.010], 4)  # e2el 0.160, tpot (0.160-0.100)/3 = 0.020
    b = _result(20, 0.300, [0.100], 2)  # e2el 0.400, tpot 0.100
    c = _result(5, 0.050, [], 1)  # one token: no tpot
    failed = RequestResult(prompt_len=7, error="HTTP 500")
    m = compute_metrics([a, b, c, failed], duration_s=2.0, slos_ms=parse_goodput(["ttft:200", "tpot:50"]))
    assert a.tpot == pytest.approx(0.020) and b.tpot == pytest.approx(0.100) and c.tpot is None
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 1, 35, 7)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(21.0)
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["mean_tpot_ms"] == pytest.approx(60.0)
    assert m["mean_itl_ms"] == pytest.approx(40.0)
    assert m["p50_itl_ms"] == pytest.approx(25.0)
    assert m["mean_e2el_ms"] == pytest.approx((160 + 400 + 50) / 3)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100.0, 300.0, 50.0]))
    assert m["p99_e2el_ms"] == pytest.approx(np.percentile([160.0, 400.0, 50.0], 99))
    # goodput: a (ttft 100, tpot 20) and c (ttft 50, tpot counted as 0) are good; b misses both SLOs
    assert m["goodput_completed"] == 2 and m["request_goodput"] == pytest.approx(1.0)
    assert compute_metrics([a], 1.0, {})["request_goodput"] is None


def test_goodput_e2el_and_parsing() -> None:
    a = RequestResult(prompt_len=1, success=True, ttft=0.1, itl=[0.1, 0.1], e2el=0.3, output_tokens=3)
    assert is_good(a, {"e2el": 300.0}) and not is_good(a, {"e2el": 299.0})
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError):
        parse_goodput(["ttft"])

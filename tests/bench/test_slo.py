"""SLO terms, goodput bounds and the sweep's recommendation, on synthetic per-point results (no server)."""

from __future__ import annotations

from typing import Any

import pytest

from folio.bench.slo import SloTerm, parse_slo, per_request_bounds, recommend, violations


def _result(req_s: float, goodput: float | None, failed: int = 0, **latency_ms: float) -> dict[str, Any]:
    result: dict[str, Any] = {
        "request_throughput": req_s,
        "request_goodput": goodput,
        "completed": 10 - failed,
        "failed": failed,
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "p50", "p90", "p99"):
            result[f"{stat}_{metric}_ms"] = latency_ms.get(f"{metric}_{stat}", 1.0)
    return result


def _point(seqs: int, tokens: int, result: dict[str, Any]) -> dict[str, Any]:
    return {"max_num_seqs": seqs, "max_num_batched_tokens": tokens, "result": result}


def test_parse_slo() -> None:
    terms = parse_slo(["ttft_p99_ms=500", "tpot_p99=100", "e2el_mean_ms=2000.5", "itl_p50_ms=20"])
    assert terms == [
        SloTerm("ttft", "p99", 500.0),
        SloTerm("tpot", "p99", 100.0),
        SloTerm("e2el", "mean", 2000.5),
        SloTerm("itl", "p50", 20.0),
    ]
    assert [t.key for t in terms] == ["p99_ttft_ms", "p99_tpot_ms", "mean_e2el_ms", "p50_itl_ms"]
    assert parse_slo(None) == []
    for bad in ("ttft_p95_ms=500", "foo_p99_ms=1", "ttft_p99_ms=-1", "ttft_p99_ms=abc", "ttft=5"):
        with pytest.raises(ValueError, match="slo"):
            parse_slo([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_slo(["ttft_p99_ms=1", "ttft_p99=2"])


def test_per_request_bounds_take_the_largest_limit_and_skip_itl() -> None:
    terms = parse_slo(["ttft_p50_ms=200", "ttft_p99_ms=500", "tpot_p90_ms=80", "itl_p99_ms=50"])
    assert per_request_bounds(terms) == {"ttft": 500.0, "tpot": 80.0}


def test_violations_name_the_term_and_failures() -> None:
    terms = parse_slo(["ttft_p99_ms=500", "tpot_p99_ms=100"])
    assert violations(_result(1.0, 1.0, ttft_p99=420, tpot_p99=80), terms) == []
    assert violations(_result(1.0, 1.0, ttft_p99=420, tpot_p99=130), terms) == ["p99 TPOT 130 ms > 100"]
    assert violations(_result(1.0, 1.0, failed=2), terms) == ["2 of 10 requests failed"]


def test_recommends_highest_goodput_among_settings_meeting_the_slo() -> None:
    terms = parse_slo(["ttft_p99_ms=500", "tpot_p99_ms=100"])
    points = [
        _point(8, 512, _result(1.0, 1.0, ttft_p99=300, tpot_p99=50)),
        _point(32, 2048, _result(3.2, 3.1, ttft_p99=420, tpot_p99=80)),
        _point(64, 2048, _result(3.5, 2.0, ttft_p99=450, tpot_p99=130)),  # faster, but misses the TPOT bound
        _point(64, 512, _result(9.0, 9.0, failed=1)),  # a failed request disqualifies
    ]
    rec = recommend(points, terms)
    assert rec["recommended"] == 1 and rec["closest"] is None
    assert rec["text"][0] == (
        "Recommended: max_num_seqs=32, max_num_batched_tokens=2048: goodput 3.10 req/s, the highest of the 2 of 4 "
        "settings that meet the SLO (p99 TTFT 420 ms <= 500, p99 TPOT 80 ms <= 100)."
    )
    assert "  64/2048 had higher throughput (3.50 req/s) but p99 TPOT 130 ms > 100." in rec["text"]
    assert "  64/512 had higher throughput (9.00 req/s) but 1 of 10 requests failed." in rec["text"]


def test_ties_go_to_higher_throughput_then_the_earlier_point() -> None:
    points = [_point(1, 1, _result(2.0, 1.0)), _point(2, 1, _result(3.0, 1.0)), _point(3, 1, _result(3.0, 1.0))]
    assert recommend(points, parse_slo(["ttft_p99_ms=10"]))["recommended"] == 1


def test_no_setting_meets_the_slo_names_the_closest() -> None:
    terms = parse_slo(["ttft_p99_ms=500", "tpot_p99_ms=100"])
    points = [
        _point(8, 512, _result(1.0, 0.5, ttft_p99=1000, tpot_p99=90)),  # 2.0x
        _point(32, 512, _result(2.0, 0.8, ttft_p99=620, tpot_p99=110)),  # 1.24x: closest
        _point(64, 512, _result(3.0, 0.0, failed=3)),  # failures rank last
    ]
    rec = recommend(points, terms)
    assert rec["recommended"] is None and rec["closest"] == 1
    assert rec["text"][0].startswith("No setting meets the SLO (p99 TTFT <= 500 ms, p99 TPOT <= 100 ms)")
    assert rec["text"][1] == (
        "Closest: max_num_seqs=32, max_num_batched_tokens=512: p99 TTFT 620 ms > 500; p99 TPOT 110 ms > 100 "
        "(goodput 0.80 req/s)."
    )


def test_without_slo_goodput_is_throughput() -> None:
    points = [_point(1, 1, _result(2.0, None)), _point(2, 1, _result(3.0, None))]
    rec = recommend(points, [])
    assert rec["recommended"] == 1
    assert rec["text"] == [
        "Recommended: max_num_seqs=2, max_num_batched_tokens=1: goodput 3.00 req/s, the highest of the 2 settings "
        "(no --slo given: goodput is the request throughput)."
    ]

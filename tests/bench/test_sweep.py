"""`folio bench sweep`: flag handling in-process, and a real two-point sweep of `folio serve` subprocesses."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from folio.bench.slo import SLO_METRICS, parse_slo, recommend
from folio.bench.sweep import _make_point, _point_summary, format_sweep_table
from folio.cli import main
from tests.server.conftest import folio_script
from tests.small_engine import TEST_KV_BYTES

NUM_PROMPTS = 4


def test_pass_through_flags_are_checked_before_any_server_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sweep", "--max-num-seqs", "8"]) == 2
    assert "use --max-num-seqs-grid" in capsys.readouterr().err
    assert main(["bench", "sweep", "--no-such-flag=1"]) == 2
    assert "folio serve takes --no-such-flag=1" in capsys.readouterr().err
    assert main(["bench", "sweep", "--slo", "ttft_p95_ms=5"]) == 2
    with pytest.raises(SystemExit):  # other commands still refuse unknown flags
        main(["bench", "latency", "--max-model-len-typo", "5"])
    assert "unrecognized arguments: --max-model-len-typo" in capsys.readouterr().err


def test_a_point_that_misses_the_slo_says_why() -> None:
    """A setting whose run breaks a term or lost requests: not meeting, each reason named in its point, its
    summary line and its table row (marked ~, the closest, when no setting meets the SLO)."""
    terms = parse_slo(["ttft_p99_ms=500", "tpot_p99_ms=100"])
    result = {f"{stat}_{metric}_ms": 50.0 for stat in ("mean", "p50", "p90", "p99") for metric in SLO_METRICS}
    result |= {"p99_tpot_ms": 130.0, "completed": 9, "failed": 1, "request_throughput": 2.0}
    result |= {"request_goodput": 1.5, "output_throughput": 40.0}
    point = _make_point(4, 256, result, terms)
    reasons = ["1 of 10 requests failed", "p99 TPOT 130 ms > 100"]
    assert (point["meets_slo"], point["violations"], point["goodput"]) == (False, reasons, 1.5)
    assert _point_summary(point, terms).endswith("misses the SLO: 1 of 10 requests failed; p99 TPOT 130 ms > 100")
    recommendation = recommend([point], terms)
    assert (recommendation["recommended"], recommendation["closest"]) == (None, 0)
    (row,) = [line for line in format_sweep_table([point], terms, recommendation).splitlines() if "256" in line]
    assert row.startswith("~") and row.endswith("  1 of 10 requests failed; p99 TPOT 130 ms > 100")


def test_sweep_two_settings_against_folio_serve(tmp_path: Path) -> None:
    result_path, plot_path = tmp_path / "sweep.json", tmp_path / "sweep.png"
    args = [folio_script(), "bench", "sweep", "--max-num-seqs-grid", "1,4", "--max-num-batched-tokens-grid", "256"]
    args += ["--slo", "ttft_p99_ms=600000", "tpot_p99_ms=600000", "--num-prompts", str(NUM_PROMPTS)]
    args += ["--random-input-len", "16", "--random-output-len", "4", "--seed", "3"]
    args += ["--save-result", str(result_path), "--plot-path", str(plot_path), "--server-log-dir", str(tmp_path)]
    args += ["--max-model-len", "512", "--kv-cache-memory-bytes", str(TEST_KV_BYTES), "--dtype", "float32"]
    args += ["--no-cpu-huge-pages"]  # passed on to folio serve, as tests/small_engine.py says
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads(result_path.read_text())
    points = report["points"]
    assert [(p["max_num_seqs"], p["max_num_batched_tokens"]) for p in points] == [(1, 256), (4, 256)]
    assert report["serve_args"][:2] == ["--max-model-len", "512"]
    assert [t["key"] for t in report["slo"]] == ["p99_ttft_ms", "p99_tpot_ms"]
    for point in points:
        result = point["result"]
        assert result["completed"] == NUM_PROMPTS and result["failed"] == 0
        assert result["total_output_tokens"] == NUM_PROMPTS * 4
        # 600 s bounds are hang guards no run that finished under the 600 s timeout can exceed: both settings meet
        # the SLO, with nothing to report (the missing path: test_a_point_that_misses_the_slo_says_why).
        assert (point["meets_slo"], point["violations"]) == (True, [])
        assert point["goodput"] == result["request_goodput"] <= result["request_throughput"]

    # the recommendation is the point with the highest goodput among those meeting the SLO
    meeting = [i for i, p in enumerate(points) if p["meets_slo"]]
    best = report["recommended"]
    assert best in meeting
    assert points[best]["goodput"] == max(points[i]["goodput"] for i in meeting)
    chosen = report["recommended_setting"]
    assert chosen == {k: points[best][k] for k in ("max_num_seqs", "max_num_batched_tokens")}
    expected = (
        f"Recommended: max_num_seqs={chosen['max_num_seqs']}, max_num_batched_tokens="
        f"{chosen['max_num_batched_tokens']}: goodput {points[best]['goodput']:.2f} req/s, the highest of the "
        f"{len(meeting)} of 2 settings that meet the SLO"
    )
    assert expected in proc.stdout and report["recommendation"][0].startswith(expected)
    # the table has one row per setting, the recommended one starred
    rows = [m.groups() for line in proc.stdout.splitlines() if (m := re.match(r"([* ~]) +(\d+) +(\d+) ", line))]
    assert [r[1:] for r in rows] == [("1", "256"), ("4", "256")]
    assert [r[0] for r in rows].count("*") == 1 and rows[best][0] == "*"
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.glob("serve_*.log")) == ["serve_1_256.log", "serve_4_256.log"]

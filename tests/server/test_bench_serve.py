"""A real run of `folio bench serve` (a subprocess of the CLI) against the shared `folio serve`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.server.conftest import ServerProcess, folio_script


def test_bench_serve_against_folio_serve(server: ServerProcess, tmp_path: Path) -> None:
    result_path, plot_path = tmp_path / "result.json", tmp_path / "plot.png"
    proc = subprocess.run(
        [folio_script(), "bench", "serve", "--base-url", server.base_url, "--dataset-name", "random"]
        + ["--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8", "--request-rate", "20"]
        + ["--seed", "1", "--goodput", "e2el:600000", "--save-result", str(result_path), "--plot-path", str(plot_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Serving Benchmark Result" in proc.stdout
    result = json.loads(result_path.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_input_tokens"] == 8 * 32
    assert result["total_output_tokens"] == 64
    assert result["goodput_completed"] == 8
    assert result["model"] == "SmolLM2-135M-Instruct"
    assert all(0 < t <= e for t, e in zip(result["ttfts"], result["e2els"], strict=True))
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    # at most one choice-bearing message per token (a server may merge tokens or skip empty text): <= 7 gaps
    assert all(len(itl) <= 7 for itl in result["itls"])
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

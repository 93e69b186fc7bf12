"""The README's results table and plot, from the W1 runs of the peer scripts (same machine, same session).

    .venv/bin/python benchmarks/peer_transformers.py --output-json bench_results/peer_transformers.json
    .venv/bin/python benchmarks/peer_llamacpp.py --request-rate 0.5
    .venv/bin/python benchmarks/peer_vllm.py --request-rate 0.5
    .venv/bin/python benchmarks/w1_report.py            # -> markdown table on stdout, docs/w1_peers.png

Reads bench_results/: the newest 64-prompt result of each server (label) at each rate, and the offline figures
(Folio's LLM.generate, transformers' static batches, the FLOP ceiling) from peer_transformers.json. Every ratio is
Folio over the peer.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench_results"


def newest_serve_results(num_prompts: int) -> dict[tuple[str, float], dict[str, Any]]:
    """(label, rate) -> the newest result JSON of that server at that rate (file names carry the timestamp)."""
    found: dict[tuple[str, float], dict[str, Any]] = {}
    for path in sorted(RESULTS.glob(f"peer_*_n{num_prompts}_*.json")):
        result = json.loads(path.read_text())
        rate = float(result["request_rate"]) if result["request_rate"] not in (None, "inf") else math.inf
        found[(result["server_label"], rate)] = result
    return found


def offline_rows(offline: dict[str, Any]) -> list[tuple[str, float]]:
    rows = [("Folio LLM.generate (offline)", offline["folio_output_tokens_per_second"])]
    batches = offline["transformers_output_tokens_per_second"]
    best = max(batches, key=lambda b: batches[b])
    rows.append((f"transformers generate, static batch {best} (best of {', '.join(batches)})", batches[best]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--plot", default=str(REPO / "docs" / "w1_peers.png"))
    ns = parser.parse_args()
    serve = newest_serve_results(ns.num_prompts)
    offline_path = RESULTS / "peer_transformers.json"
    offline = json.loads(offline_path.read_text()) if offline_path.exists() else None

    print("| engine (W1: 64 prompts, 128 tokens each, greedy) | output tok/s | p99 TTFT ms | p99 TPOT ms |")
    print("| --- | --- | --- | --- |")
    bars: list[tuple[str, float]] = []
    if offline is not None:
        short_names = ("folio\noffline", "transformers\nstatic batch")
        for (label, tps), short in zip(offline_rows(offline), short_names, strict=True):
            print(f"| {label} | {tps:.1f} | | |")
            bars.append((short, tps))
    for (label, rate), r in sorted(serve.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        how = "saturation, 64 in flight" if math.isinf(rate) else f"Poisson {rate:g} req/s"
        print(
            f"| {label} server, {how} | {r['output_throughput']:.1f} | {r['p99_ttft_ms']:.0f} | "
            f"{r['p99_tpot_ms']:.1f} |"
        )
        if math.isinf(rate):
            bars.append((f"{label}\nserver", r["output_throughput"]))
    if offline is not None:
        print(
            f"\nFLOP ceiling: {offline['ceiling_output_tokens_per_second']:.0f} output tok/s at a measured "
            f"{offline['matmul_flops'] / 1e9:.0f} GFLOP/s GEMM"
        )

    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [b[0] for b in bars]
    values = [b[1] for b in bars]
    colors = ["tab:blue" if n.lower().startswith("folio") else "tab:gray" for n in names]
    ax.bar(names, values, color=colors)
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    if offline is not None:
        ceiling = offline["ceiling_output_tokens_per_second"]
        ax.axhline(ceiling, color="tab:red", linestyle="--", label="float32 FLOP ceiling")
        ax.legend()
    ax.set_ylabel("output tokens / s")
    ax.set_title("W1 on 2 CPU cores (SmolLM2-135M): Folio vs peers, same machine, same session")
    plt.setp(ax.get_xticklabels(), fontsize=8)
    fig.tight_layout()
    fig.savefig(ns.plot, dpi=110)
    print(f"\nplot: {ns.plot}")


if __name__ == "__main__":
    main()

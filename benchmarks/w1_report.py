"""The README's results table and plot, from the W1 runs of the peer scripts (same machine, same session).

    .venv/bin/python benchmarks/peer_transformers.py --output-json bench_results/peer_transformers.json
    .venv/bin/python benchmarks/peer_vllm_offline.py
    .venv/bin/python benchmarks/peer_llamacpp.py --folio-args '--dtype bfloat16' --request-rate 2
    .venv/bin/python benchmarks/peer_vllm.py --request-rate 2
    .venv/bin/python benchmarks/peer_vllm.py --skip-peer --folio-args '--dtype bfloat16' --request-rate 2
    .venv/bin/python benchmarks/w1_report.py            # -> markdown table on stdout, docs/w1_peers.png

Reads bench_results/: the newest 64-prompt result of each server (label) at each rate, the offline figures of
Folio and vLLM per dtype with the FLOP ceilings (peer_vllm_offline.json), and transformers' static batches
(peer_transformers.json).
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


_SHORT = {"bfloat16": "bf16", "float32": "fp32"}


def server_name(label: str) -> str:
    """The peer scripts label `folio serve` without --dtype flags "folio": it runs float32 (their default)."""
    return "folio-float32" if label == "folio" else label


def offline_rows(transformers: dict[str, Any] | None, vllm: dict[str, Any] | None) -> list[tuple[str, str, float]]:
    """(table label, plot label, output tok/s) of every offline run: Folio and vLLM per dtype (best run of
    peer_vllm_offline.py), transformers' best static batch (peer_transformers.py)."""
    rows = []
    for dtype, runs in (vllm or {}).items():
        rows.append((f"Folio LLM.generate, {dtype} (offline)", f"folio\noffline {_SHORT[dtype]}", max(runs["folio"])))
        rows.append((f"vLLM CPU LLM.generate, {dtype} (offline)", f"vllm\noffline {_SHORT[dtype]}", max(runs["vllm"])))
    if transformers is not None:
        if vllm is None:
            rows.append(
                (
                    "Folio LLM.generate, float32 (offline)",
                    "folio\noffline fp32",
                    transformers["folio_output_tokens_per_second"],
                )
            )
        batches = transformers["transformers_output_tokens_per_second"]
        best = max(batches, key=lambda b: batches[b])
        label = f"transformers generate, float32, static batch {best} (best of {', '.join(batches)})"
        rows.append((label, "transformers\nstatic batch", batches[best]))
    return rows


def ceilings(transformers: dict[str, Any] | None, vllm: dict[str, Any] | None) -> dict[str, float]:
    """dtype -> W1's FLOP ceiling in output tok/s, as measured by the peer scripts."""
    found = {dtype: runs["flop_ceiling"]["output_tokens_per_second"] for dtype, runs in (vllm or {}).items()}
    if transformers is not None:
        found.setdefault("float32", transformers["ceiling_output_tokens_per_second"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--plot", default=str(REPO / "docs" / "w1_peers.png"))
    ns = parser.parse_args()
    serve = newest_serve_results(ns.num_prompts)
    loaded = {}
    for name in ("peer_transformers", "peer_vllm_offline"):
        path = RESULTS / f"{name}.json"
        loaded[name] = json.loads(path.read_text()) if path.exists() else None
    transformers, vllm = loaded["peer_transformers"], loaded["peer_vllm_offline"]

    print("| engine (W1: 64 prompts, 128 tokens each, greedy) | output tok/s | p99 TTFT ms | p99 TPOT ms |")
    print("| --- | --- | --- | --- |")
    bars: list[tuple[str, float]] = []
    for label, short, tps in offline_rows(transformers, vllm):
        print(f"| {label} | {tps:.1f} | | |")
        bars.append((short, tps))
    for (label, rate), r in sorted(serve.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        how = "saturation, 64 in flight" if math.isinf(rate) else f"Poisson {rate:g} req/s"
        print(
            f"| {server_name(label)} server, {how} | {r['output_throughput']:.1f} | {r['p99_ttft_ms']:.0f} | "
            f"{r['p99_tpot_ms']:.1f} |"
        )
        if math.isinf(rate):
            bars.append((f"{server_name(label)}\nserver", r["output_throughput"]))
    lines = ceilings(transformers, vllm)
    for dtype, tps in lines.items():
        print(f"\nFLOP ceiling, {dtype}: {tps:.0f} output tok/s")

    fig, ax = plt.subplots(figsize=(11, 4.8))
    names = [b[0] for b in bars]
    values = [b[1] for b in bars]
    colors = ["tab:blue" if n.lower().startswith("folio") else "tab:gray" for n in names]
    ax.bar(names, values, color=colors)
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    for (dtype, tps), style in zip(lines.items(), ("--", ":"), strict=False):
        ax.axhline(tps, color="tab:red", linestyle=style, label=f"{dtype} FLOP ceiling ({tps:.0f})")
    if lines:
        ax.legend(fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title("W1 on 2 CPU cores (SmolLM2-135M): Folio vs peers, same machine, same session")
    plt.setp(ax.get_xticklabels(), fontsize=7)
    fig.tight_layout()
    fig.savefig(ns.plot, dpi=110)
    print(f"\nplot: {ns.plot}")


if __name__ == "__main__":
    main()

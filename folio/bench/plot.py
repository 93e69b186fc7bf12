"""PNGs of a serve run's latency distributions and of a sweep (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from folio.bench.metrics import RequestResult
from folio.bench.slo import SloTerm


def plot_latency_distributions(results: list[RequestResult], path: str, title: str) -> None:
    """Four histograms (ms): TTFT, TPOT, ITL and E2EL of the successful requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.success]
    series = {
        "TTFT": [r.ttft * 1000 for r in done],
        "TPOT": [t * 1000 for r in done if (t := r.tpot) is not None],
        "ITL": [gap * 1000 for r in done for gap in r.itl],
        "E2EL": [r.e2el * 1000 for r in done],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items(), strict=True):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 2)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "-"), (90, "--"), (99, ":")):
                value = float(np.percentile(values, q))
                ax.axvline(value, color="tab:red", linestyle=style, label=f"p{q} {value:.1f} ms")
            ax.legend(fontsize=8)
        ax.set_title(f"{name} ({len(values)} samples)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(points: list[dict[str, Any]], terms: list[SloTerm], recommendation: dict[str, Any], path: str) -> None:
    """Two panels over the settings ("seqs/batched"): request throughput and goodput (req/s), then the SLO's
    latency statistics (ms) with each limit as a dashed line; the recommended setting's label is starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{p['max_num_seqs']}/{p['max_num_batched_tokens']}" for p in points]
    if recommendation["recommended"] is not None:
        labels[recommendation["recommended"]] += " *"
    x = np.arange(len(points))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7, 1.1 * len(points) + 3), 8), sharex=True)
    width = 0.4
    top.bar(x - width / 2, [p["request_throughput"] for p in points], width, label="throughput", color="tab:gray")
    top.bar(x + width / 2, [p["goodput"] for p in points], width, label="goodput", color="tab:green")
    for i, point in enumerate(points):
        if not point["meets_slo"]:
            top.annotate("SLO missed", (x[i], point["request_throughput"]), ha="center", va="bottom", fontsize=7)
    top.set_ylabel("requests/s")
    top.legend(fontsize=8)
    top.set_title("per setting max_num_seqs/max_num_batched_tokens (* recommended)", fontsize=10)
    keys = [t.key for t in terms] or ["p99_ttft_ms", "p99_tpot_ms"]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bar = 0.8 / len(keys)
    for j, key in enumerate(keys):
        color = colors[j % len(colors)]
        values = [p["result"][key] for p in points]
        bottom.bar(x - 0.4 + bar * (j + 0.5), values, bar, color=color, label=key.replace("_", " "))
        for term in terms:
            if term.key == key:
                bottom.axhline(term.limit_ms, color=color, linestyle="--", linewidth=1)
    bottom.set_yscale("log")
    bottom.set_ylabel("ms (dashed: SLO limit)")
    bottom.legend(fontsize=8)
    bottom.set_xticks(x, labels, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

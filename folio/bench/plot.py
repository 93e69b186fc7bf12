"""PNG of the latency distributions of a serve run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import numpy as np

from folio.bench.metrics import RequestResult


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

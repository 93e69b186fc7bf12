"""Online-serving metrics with vLLM's definitions, computed from per-request timestamps (pure Python + numpy).

Per request (all in seconds, from the moment the request was sent):
- TTFT: to the first SSE data message whose ``choices`` is non-empty (a "choice-bearing" message).
- ITL: the gaps between consecutive choice-bearing messages.
- E2EL: to the last choice-bearing message.
- TPOT: (E2EL - TTFT) / (output tokens - 1), only for requests with more than one output token; output tokens come
  from ``usage.completion_tokens``.
Goodput counts the completed requests whose TTFT, TPOT and E2EL are all within the given SLOs (vLLM counts a
one-token request's TPOT as 0 there). Aggregates are reported in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one streamed request measured; ``success`` is False on an HTTP error or a stream with no choices."""

    prompt_len: int
    success: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1) for more than one token; None otherwise."""
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s after the start) of ``num_requests`` requests.

    Gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)) -- mean 1/rate; burstiness 1 is a Poisson process,
    lower is burstier -- then rescaled so the last request goes out at exactly N/rate, as vLLM does. An infinite
    rate sends everything at once.
    """
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    target_end = num_requests / request_rate
    if offsets[-1] > 0:
        offsets = offsets * (target_end / offsets[-1])
    return [float(x) for x in offsets]


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {GOODPUT_METRICS}, got {spec!r}")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {ms}")
        slos[name] = ms
    return slos


def is_good(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Within every SLO; a request with one output token has TPOT 0 here (vLLM's rule)."""
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2el}
    return all(limit / 1000 >= values[name] for name, limit in slos_ms.items())  # compared in s, as vLLM does


def summarize_ms(values_s: list[float]) -> dict[str, float]:
    """mean/median/std and the percentiles of a list of seconds, in ms; all 0 for an empty list (as vLLM)."""
    arr = np.asarray(values_s, dtype=np.float64) * 1000 if values_s else np.zeros(1)
    stats = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in PERCENTILES:
        stats[f"p{p}"] = float(np.percentile(arr, p))
    return stats


def compute_metrics(results: list[RequestResult], duration_s: float, slos_ms: dict[str, float]) -> dict[str, Any]:
    """The benchmark's aggregate result: counts, throughputs (per second) and latency statistics (ms)."""
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    tpots = [t for r in done if (t := r.tpot) is not None]
    itls = [gap for r in done for gap in r.itl]
    good = sum(1 for r in done if is_good(r, slos_ms)) if slos_ms else None
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "goodput_completed": good,
    }
    for name, values in (
        ("ttft", [r.ttft for r in done]),
        ("tpot", tpots),
        ("itl", itls),
        ("e2el", [r.e2el for r in done]),
    ):
        for stat, value in summarize_ms(values).items():
            out[f"{stat}_{name}_ms"] = value
    return out

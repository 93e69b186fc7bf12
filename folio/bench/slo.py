"""Service-level objectives for `folio bench sweep`: parsing, checking a run, goodput, and the recommendation.

An SLO term bounds one statistic of one latency metric over a whole run, in ms: ``ttft_p99_ms=500`` means "the
run's p99 TTFT is at most 500 ms". Metrics: ttft, tpot, itl, e2el; statistics: p50, p90, p99, mean. The values
checked are those `folio bench serve` reports (folio.bench.metrics), so a term's key is ``{stat}_{metric}_ms``.

A setting *meets the SLO* when every term holds for its run and no request failed. Its *goodput* is vLLM's
per-request goodput (folio.bench.metrics.is_good): completed requests per second whose own TTFT, TPOT and E2EL
are within the bounds, where a metric's per-request bound is the largest limit given for it (``ttft_p50_ms=200
ttft_p99_ms=500`` -> a request is good with TTFT <= 500 ms: the p99 term is what every request must fit under).
ITL has no per-request bound (vLLM's goodput has none either); its terms are checked on the run only. With no
per-request bound at all, goodput is the request throughput.

Why both: run percentiles are what an operator's SLO states, and a setting that breaks them is not a candidate
however much it serves; among the settings that keep them, per-request goodput ranks the useful throughput.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from folio.bench.metrics import GOODPUT_METRICS

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_STATS = ("p50", "p90", "p99", "mean")
_TERM = re.compile(r"^(?P<metric>[a-z0-9]+)_(?P<stat>[a-z0-9]+?)(?:_ms)?=(?P<limit>.+)$")


@dataclass(frozen=True)
class SloTerm:
    metric: str  # one of SLO_METRICS
    stat: str  # one of SLO_STATS
    limit_ms: float

    @property
    def key(self) -> str:
        """The result key of the statistic: "p99_ttft_ms"."""
        return f"{self.stat}_{self.metric}_ms"

    @property
    def label(self) -> str:
        """For people: "p99 TTFT"."""
        return f"{self.stat} {self.metric.upper()}"


def parse_slo(specs: list[str] | None) -> list[SloTerm]:
    """``["ttft_p99_ms=500", "tpot_p99_ms=100"]`` -> terms; the ``_ms`` suffix is optional. ValueError names the
    malformed term and the accepted metrics and statistics."""
    terms: list[SloTerm] = []
    for spec in specs or []:
        match = _TERM.match(spec.strip())
        if not match or match["metric"] not in SLO_METRICS or match["stat"] not in SLO_STATS:
            raise ValueError(
                f"--slo takes METRIC_STAT_ms=LIMIT with METRIC in {SLO_METRICS} and STAT in {SLO_STATS}, "
                f"e.g. ttft_p99_ms=500; got {spec!r}"
            )
        try:
            limit = float(match["limit"])
        except ValueError:
            raise ValueError(f"--slo {spec!r}: the limit must be a number of ms") from None
        if not limit >= 0:
            raise ValueError(f"--slo {spec!r}: the limit must be >= 0 ms")
        if any(t.key == f"{match['stat']}_{match['metric']}_ms" for t in terms):
            raise ValueError(f"--slo gives {match['metric']}_{match['stat']} twice")
        terms.append(SloTerm(match["metric"], match["stat"], limit))
    return terms


def per_request_bounds(terms: list[SloTerm]) -> dict[str, float]:
    """The per-request goodput bounds (ms) for folio.bench.metrics: the largest limit per metric, ITL left out."""
    bounds: dict[str, float] = {}
    for term in terms:
        if term.metric in GOODPUT_METRICS:
            bounds[term.metric] = max(bounds.get(term.metric, 0.0), term.limit_ms)
    return bounds


def goodput(result: dict[str, Any]) -> float:
    """Requests/s that met the per-request bounds; the request throughput when there were none."""
    value = result.get("request_goodput")
    return float(result["request_throughput"] if value is None else value)


def violations(result: dict[str, Any], terms: list[SloTerm]) -> list[str]:
    """Why a run misses the SLO, one phrase per broken term ("p99 TPOT 130 ms > 100"); [] when it meets it."""
    found = []
    if result["failed"]:
        found.append(f"{result['failed']} of {result['failed'] + result['completed']} requests failed")
    for term in terms:
        value = float(result[term.key])
        if value > term.limit_ms:
            found.append(f"{term.label} {value:.0f} ms > {term.limit_ms:g}")
    return found


def slo_excess(result: dict[str, Any], terms: list[SloTerm]) -> tuple[int, float]:
    """How far a run is from the SLO, for "the closest setting": (failed requests, the largest value / limit)."""
    worst = 0.0
    for term in terms:
        value = float(result[term.key])
        ratio = value / term.limit_ms if term.limit_ms > 0 else (math.inf if value > 0 else 0.0)
        worst = max(worst, ratio)
    return int(result["failed"]), worst


def describe_terms(result: dict[str, Any], terms: list[SloTerm]) -> str:
    """Every term's value against its limit: "p99 TTFT 420 ms <= 500, p99 TPOT 80 ms <= 100"."""
    parts = []
    for term in terms:
        value = float(result[term.key])
        parts.append(f"{term.label} {value:.0f} ms {'<=' if value <= term.limit_ms else '>'} {term.limit_ms:g}")
    return ", ".join(parts)


def setting_name(point: dict[str, Any]) -> str:
    return f"max_num_seqs={point['max_num_seqs']}, max_num_batched_tokens={point['max_num_batched_tokens']}"


def short_name(point: dict[str, Any]) -> str:
    """ "64/2048": max_num_seqs / max_num_batched_tokens."""
    return f"{point['max_num_seqs']}/{point['max_num_batched_tokens']}"


def recommend(points: list[dict[str, Any]], terms: list[SloTerm]) -> dict[str, Any]:
    """The setting with the highest goodput among those meeting the SLO (ties: higher request throughput, then
    the earlier grid point), and the sentences that say why.

    Each point carries "max_num_seqs", "max_num_batched_tokens" and "result" (the benchmark's result dict).
    Returns {"recommended": index or None, "closest": index or None, "text": [lines]}; "closest" is set only when
    no point meets the SLO (the smallest (failures, largest value / limit)).
    """
    if not points:
        raise ValueError("no sweep points to recommend from")
    meeting = [i for i, p in enumerate(points) if not violations(p["result"], terms)]
    slo_text = ", ".join(f"{t.label} <= {t.limit_ms:g} ms" for t in terms) or "no --slo given"
    if not meeting:
        closest = min(range(len(points)), key=lambda i: slo_excess(points[i]["result"], terms))
        point = points[closest]
        return {
            "recommended": None,
            "closest": closest,
            "text": [
                f"No setting meets the SLO ({slo_text}) among {len(points)} settings.",
                f"Closest: {setting_name(point)}: {'; '.join(violations(point['result'], terms))} "
                f"(goodput {goodput(point['result']):.2f} req/s).",
            ],
        }
    best = max(meeting, key=lambda i: (goodput(points[i]["result"]), points[i]["result"]["request_throughput"], -i))
    chosen = points[best]["result"]
    among = (
        f"the {len(meeting)} of {len(points)} settings that meet the SLO ({describe_terms(chosen, terms)})"
        if terms
        else f"the {len(points)} settings (no --slo given: goodput is the request throughput)"
    )
    text = [f"Recommended: {setting_name(points[best])}: goodput {goodput(chosen):.2f} req/s, the highest of {among}."]
    for i, point in enumerate(points):
        result = point["result"]
        if i in meeting or (
            result["request_throughput"] <= chosen["request_throughput"] and goodput(result) <= goodput(chosen)
        ):
            continue
        higher = (
            f"higher throughput ({result['request_throughput']:.2f} req/s)"
            if result["request_throughput"] > chosen["request_throughput"]
            else f"higher goodput ({goodput(result):.2f} req/s)"
        )
        text.append(f"  {short_name(point)} had {higher} but {'; '.join(violations(result, terms))}.")
    return {"recommended": best, "closest": None, "text": text}

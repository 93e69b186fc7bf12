"""`folio bench sweep`: `folio bench serve`'s benchmark over a grid of scheduler settings, and the best one.

Each (max_num_seqs, max_num_batched_tokens) point of the grid gets a fresh `folio serve` subprocess on 127.0.0.1
(no state carried over: prefix cache, allocator, warm-up), one untimed warm-up request, then the same seeded
request set and arrival schedule as `folio bench serve` with the same flags, run in-process against it. Flags
the sweep does not know are passed to every server (``--max-model-len 512``, ``--model PATH``, ``--dtype``, ...);
the request set draws from the vocabulary of the served ``--tokenizer`` / ``--model``.

The recommendation is folio.bench.slo's: the highest goodput among settings whose run meets every SLO term.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from folio.bench.copy_edit import render_chat_for
from folio.bench.datasets import SampleRequest, add_dataset_args, requests_from_args
from folio.bench.metrics import RequestResult, compute_metrics
from folio.bench.serve import add_load_args, benchmark_server, check_load_args, dataset_vocabulary, model_name
from folio.bench.server_proc import ServeProcess
from folio.bench.slo import SloTerm, goodput, parse_slo, per_request_bounds, recommend, violations

# Flags the sweep sets on every server itself.
_OWNED_SERVE_FLAGS = {
    "--max-num-seqs": "--max-num-seqs-grid",
    "--max-num-batched-tokens": "--max-num-batched-tokens-grid",
    "--port": None,
    "--host": None,
}
_WARMUP_OUTPUT_LEN = 4
_DEFAULT_LATENCY_KEYS = ("p99_ttft_ms", "p99_tpot_ms", "p99_e2el_ms")
_MAX_LATENCY_COLUMNS = 4


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sweep")
    g.add_argument(
        "--max-num-seqs-grid", type=_int_list, default=[256], metavar="N,N,...", help="values of max_num_seqs"
    )
    g.add_argument(
        "--max-num-batched-tokens-grid",
        type=_int_list,
        default=[2048],
        metavar="N,N,...",
        help="values of max_num_batched_tokens; the grid is every pair (default 2048)",
    )
    g.add_argument(
        "--slo",
        nargs="+",
        default=None,
        metavar="METRIC_STAT_ms=LIMIT",
        help="bounds on the run's statistics, e.g. ttft_p99_ms=500 tpot_p99_ms=100; METRIC: ttft, tpot, itl, "
        "e2el; STAT: p50, p90, p99, mean. Goodput counts requests within each metric's largest bound (vLLM's "
        "per-request goodput; ITL only on the run)",
    )
    g.add_argument("--save-result", default="sweep_result.json", metavar="PATH", help="JSON of every point")
    g.add_argument("--plot-path", default="sweep_result.png", metavar="PATH", help="PNG: goodput and latency")
    g.add_argument(
        "--server-log-dir",
        default=None,
        metavar="DIR",
        help="keep each server's log here (default: a temporary directory, removed at the end)",
    )
    add_load_args(parser.add_argument_group("load (as folio bench serve)"))
    add_dataset_args(parser)


def check_serve_args(serve_args: list[str]) -> argparse.Namespace:
    """Parses the pass-through flags as `folio serve` would, so a typo fails before any server starts."""
    from folio.cli import add_serve_args
    from folio.engine_flags import add_engine_args

    for arg in serve_args:
        name = arg.split("=", 1)[0]
        if name in _OWNED_SERVE_FLAGS:
            instead = _OWNED_SERVE_FLAGS[name]
            raise ValueError(f"the sweep sets {name} on each server itself" + (f"; use {instead}" if instead else ""))
    parser = argparse.ArgumentParser(prog="folio serve (flags passed on by folio bench sweep)", allow_abbrev=False)
    add_serve_args(parser)
    add_engine_args(parser)
    ns, unknown = parser.parse_known_args(serve_args)
    if unknown:
        raise ValueError(f"neither folio bench sweep nor folio serve takes {' '.join(unknown)}")
    return ns


def _failed_result(requests: list[SampleRequest], error: str, slos: dict[str, float]) -> dict[str, Any]:
    """The result of a point whose server never served: every request failed with ``error``."""
    results = [RequestResult(prompt_len=r.prompt_len, error=error) for r in requests]
    result = compute_metrics(results, 1.0, slos)
    result["errors"] = [error]
    return result


def run_point(
    serve_args: list[str],
    requests: list[SampleRequest],
    ns: argparse.Namespace,
    slos: dict[str, float],
    log_path: Path,
) -> dict[str, Any]:
    """One grid point: fresh server, warm-up request, the timed benchmark, server stopped. A server that does not
    start gives a point whose requests all failed (the sweep goes on; the error is in the point)."""
    server = ServeProcess(serve_args, log_path)
    try:
        try:
            server.start()
        except RuntimeError as e:
            print(f"  {e}", flush=True)
            return _failed_result(requests, str(e).splitlines()[0], slos)
        model = asyncio.run(model_name(server.base_url))
        warmup = [SampleRequest(requests[0].prompt_token_ids, min(_WARMUP_OUTPUT_LEN, requests[0].output_len))]
        warmup_ns = argparse.Namespace(**{**vars(ns), "request_rate": float("inf"), "max_concurrency": None})
        benchmark_server(server.base_url, model, warmup, warmup_ns, {})
        result, _ = benchmark_server(server.base_url, model, requests, ns, slos)
        return result
    finally:
        server.stop()


def cmd_bench_sweep(ns: argparse.Namespace) -> int:
    """Runs every grid point, prints the table and the recommendation, writes the JSON and the PNG."""
    terms = parse_slo(ns.slo)
    check_load_args(ns)
    serve_args: list[str] = list(getattr(ns, "extra_args", []) or [])
    serve_ns = check_serve_args(serve_args)
    model_path = serve_ns.model or serve_ns.model_positional
    vocab_size, special_ids, tokenize = dataset_vocabulary(ns.dataset_name, serve_ns.tokenizer or model_path)
    render_chat = render_chat_for(ns.dataset_name, serve_ns.tokenizer or model_path)
    requests = requests_from_args(ns, vocab_size, special_ids, tokenize, render_chat)
    slos = per_request_bounds(terms)
    grid = [(s, b) for s in ns.max_num_seqs_grid for b in ns.max_num_batched_tokens_grid]
    print(
        f"Sweeping {len(grid)} settings (max_num_seqs x max_num_batched_tokens), each on a fresh folio serve "
        f"{' '.join(serve_args)}: {len(requests)} requests, rate {ns.request_rate} req/s, max concurrency "
        f"{ns.max_concurrency}",
        flush=True,
    )
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="folio-sweep-") as tmp:
        log_dir = Path(ns.server_log_dir or tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for index, (max_num_seqs, max_num_batched_tokens) in enumerate(grid):
            print(
                f"[{index + 1}/{len(grid)}] max_num_seqs={max_num_seqs}, "
                f"max_num_batched_tokens={max_num_batched_tokens}",
                flush=True,
            )
            args = [*serve_args, "--max-num-seqs", str(max_num_seqs)]
            args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
            log_path = log_dir / f"serve_{max_num_seqs}_{max_num_batched_tokens}.log"
            result = run_point(args, requests, ns, slos, log_path)
            point = _make_point(max_num_seqs, max_num_batched_tokens, result, terms)
            points.append(point)
            print(f"  {_point_summary(point, terms)}", flush=True)
    recommendation = recommend(points, terms)
    print(format_sweep_table(points, terms, recommendation))
    print("\n".join(recommendation["text"]))
    report = _report(ns, serve_args, terms, slos, points, recommendation)
    if ns.save_result:
        Path(ns.save_result).write_text(json.dumps(report, indent=2))
        print(f"Wrote {ns.save_result}")
    if ns.plot_path:
        from folio.bench.plot import plot_sweep

        plot_sweep(points, terms, recommendation, ns.plot_path)
        print(f"Wrote {ns.plot_path}")
    return 0 if any(p["result"]["completed"] for p in points) else 1


def _make_point(
    max_num_seqs: int, max_num_batched_tokens: int, result: dict[str, Any], terms: list[SloTerm]
) -> dict[str, Any]:
    broken = violations(result, terms)
    return {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "meets_slo": not broken,
        "violations": broken,
        "goodput": goodput(result),
        "request_throughput": result["request_throughput"],
        "result": result,
    }


def _point_summary(point: dict[str, Any], terms: list[SloTerm]) -> str:
    result = point["result"]
    latencies = ", ".join(f"{_label(k)} {result[k]:.0f} ms" for k in _latency_keys(terms))
    verdict = "meets the SLO" if point["meets_slo"] else "misses the SLO: " + "; ".join(point["violations"])
    return f"{result['request_throughput']:.2f} req/s, goodput {point['goodput']:.2f} req/s, {latencies}: {verdict}"


def _latency_keys(terms: list[SloTerm]) -> list[str]:
    """The latency columns: the SLO's statistics first, then p99 TTFT / TPOT / E2EL, at most four."""
    keys = [t.key for t in terms]
    keys += [k for k in _DEFAULT_LATENCY_KEYS if k not in keys]
    return keys[: max(_MAX_LATENCY_COLUMNS, len(terms))]


def _label(key: str) -> str:
    """ "p99_ttft_ms" -> "p99 TTFT"."""
    stat, metric, _ = key.split("_")
    return f"{stat} {metric.upper()}"


def format_sweep_table(points: list[dict[str, Any]], terms: list[SloTerm], recommendation: dict[str, Any]) -> str:
    """One row per setting: throughput, goodput, the latency columns (ms) and the SLO verdict; * marks the
    recommended row, ~ the closest one when none meets the SLO."""
    keys = _latency_keys(terms)
    header = f"  {'seqs':>6} {'batched':>8} {'req/s':>7} {'goodput':>8} {'out tok/s':>10}"
    header += "".join(f" {_label(k):>10}" for k in keys) + "  SLO"
    lines = ["{s:{c}^{w}}".format(s=f" Sweep Result ({len(points)} settings) ", c="=", w=len(header) + 16)]
    lines += [header]
    for index, point in enumerate(points):
        result = point["result"]
        mark = "*" if index == recommendation["recommended"] else "~" if index == recommendation["closest"] else " "
        row = f"{mark} {point['max_num_seqs']:>6} {point['max_num_batched_tokens']:>8} "
        row += f"{result['request_throughput']:>7.2f} {point['goodput']:>8.2f} {result['output_throughput']:>10.1f}"
        row += "".join(f" {result[k]:>10.1f}" for k in keys)
        row += "  met" if point["meets_slo"] else "  " + "; ".join(point["violations"])
        lines.append(row)
    lines.append("=" * (len(header) + 16))
    lines.append("latencies in ms; seqs = max_num_seqs, batched = max_num_batched_tokens; * recommended")
    return "\n".join(lines)


def _report(
    ns: argparse.Namespace,
    serve_args: list[str],
    terms: list[SloTerm],
    slos: dict[str, float],
    points: list[dict[str, Any]],
    recommendation: dict[str, Any],
) -> dict[str, Any]:
    best = recommendation["recommended"]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "grid": {"max_num_seqs": ns.max_num_seqs_grid, "max_num_batched_tokens": ns.max_num_batched_tokens_grid},
        "serve_args": serve_args,
        "dataset_name": ns.dataset_name,
        "num_prompts": ns.num_prompts,
        "seed": ns.seed,
        "request_rate": ns.request_rate if ns.request_rate != float("inf") else "inf",
        "burstiness": ns.burstiness,
        "max_concurrency": ns.max_concurrency,
        "slo": [{"metric": t.metric, "stat": t.stat, "limit_ms": t.limit_ms, "key": t.key} for t in terms],
        "per_request_goodput_bounds_ms": slos,
        "points": points,
        "recommended": best,
        "recommended_setting": None
        if best is None
        else {k: points[best][k] for k in ("max_num_seqs", "max_num_batched_tokens")},
        "closest": recommendation["closest"],
        "recommendation": recommendation["text"],
    }

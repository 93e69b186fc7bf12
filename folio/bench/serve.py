"""`folio bench serve`: drives any OpenAI-compatible server with a seeded request set and arrival schedule.

The client does not need the served model's weights: prompts are token ids drawn from the vocabulary of
``--tokenizer`` (default: Folio's default model), so Folio, llama.cpp and vLLM all see the same input ids.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from datetime import datetime, timezone
from typing import Any

import httpx

from folio.bench.client import fetch_model_name, send_completion
from folio.bench.copy_edit import render_chat_for
from folio.bench.datasets import SampleRequest, add_dataset_args, requests_from_args
from folio.bench.metrics import RequestResult, arrival_offsets, compute_metrics, parse_goodput


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `folio bench serve`, with vLLM's names."""
    g = parser.add_argument_group("serve benchmark")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default http://127.0.0.1:8000)")
    g.add_argument("--model", default=None, help="model name to send (default: the first one GET /v1/models lists)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="model file or directory whose vocabulary random prompts draw from and which tokenizes custom text "
        "prompts (default: Folio's default model)",
    )
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:5000 (ms); a request is good if it meets all of them",
    )
    g.add_argument("--save-result", default=None, metavar="PATH", help="write the result as JSON to PATH")
    g.add_argument("--plot-path", default=None, metavar="PATH", help="write a PNG of the latency distributions")
    add_load_args(g)
    add_dataset_args(parser)


def add_load_args(g: argparse._ArgumentGroup) -> None:
    """The arrival schedule and concurrency flags, shared by `folio bench serve` and `folio bench sweep`."""
    g.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second; arrivals follow a Gamma process ending at num_prompts/rate "
        "(default inf: all at once)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of the inter-arrival times: 1 = Poisson, < 1 burstier, > 1 more uniform (default 1)",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take (default 600)")


def dataset_vocabulary(dataset_name: str, tokenizer: str | None) -> tuple[int, list[int], Any]:
    """(vocab size, special ids to avoid, tokenize function or None) of the model or tokenizer at ``tokenizer``
    (default: Folio's default model); the tokenizer loads only for custom text."""
    from folio.model.model_files import default_model_path, load_tokenizer, read_model_spec

    path = tokenizer or default_model_path()
    if dataset_name == "w1":
        return 0, [], None
    if dataset_name == "custom":
        tokenizer = load_tokenizer(path)
        return len(tokenizer), list(tokenizer.all_special_ids), lambda text: list(tokenizer.encode(text))
    spec = read_model_spec(path)
    special = [i for i in (spec.bos_token_id, *spec.eos_token_ids) if i is not None]
    return spec.vocab_size, special, None


async def run_requests(
    base_url: str,
    model: str,
    requests: list[SampleRequest],
    offsets: list[float],
    max_concurrency: int | None,
    timeout_s: float,
) -> tuple[list[RequestResult], float]:
    """Sends each request at its offset (at most ``max_concurrency`` in flight); returns results and duration."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
        start = time.perf_counter()

        async def one(request: SampleRequest, offset: float) -> RequestResult:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                return await send_completion(client, base_url, model, request)
            async with semaphore:
                return await send_completion(client, base_url, model, request)

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
        return list(results), time.perf_counter() - start


def format_table(result: dict[str, Any]) -> str:
    """The one-screen summary, in vLLM's layout."""
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = ".2f") -> None:
        text = format(value, fmt) if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Request rate configured (req/s):", result["request_rate"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            row(
                f"{stat.capitalize() if stat[0] != 'p' else stat.upper()} {name.upper()} (ms):",
                result[f"{stat}_{name}_ms"],
            )
    lines.append("=" * 60)
    return "\n".join(lines)


def benchmark_server(
    base_url: str, model: str, requests: list[SampleRequest], ns: argparse.Namespace, slos: dict[str, float]
) -> tuple[dict[str, Any], list[RequestResult]]:
    """One benchmark run against a live server: the arrival schedule of the load flags in ``ns``, then vLLM's
    metrics (goodput with per-request ``slos`` in ms). Returns the result dict and the per-request results."""
    offsets = arrival_offsets(len(requests), ns.request_rate, ns.burstiness, ns.seed)
    results, duration = asyncio.run(
        run_requests(base_url, model, requests, offsets, ns.max_concurrency, ns.request_timeout)
    )
    result = compute_metrics(results, duration, slos)
    result.update(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        base_url=base_url,
        model=model,
        dataset_name=ns.dataset_name,
        num_prompts=len(requests),
        seed=ns.seed,
        request_rate=ns.request_rate if ns.request_rate != float("inf") else "inf",
        burstiness=ns.burstiness,
        max_concurrency=ns.max_concurrency,
        goodput_slos_ms=slos or None,
        errors=sorted({r.error for r in results if r.error})[:10],
    )
    return result, results


def check_load_args(ns: argparse.Namespace) -> None:
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {ns.max_concurrency}")


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    """Runs the benchmark; exit 1 if no request succeeded (the table and JSON are still written)."""
    slos = parse_goodput(ns.goodput)
    check_load_args(ns)
    base_url = ns.base_url.rstrip("/")
    vocab_size, special_ids, tokenize = dataset_vocabulary(ns.dataset_name, ns.tokenizer)
    render_chat = render_chat_for(ns.dataset_name, ns.tokenizer)
    requests = requests_from_args(ns, vocab_size, special_ids, tokenize, render_chat)
    model = ns.model or asyncio.run(model_name(base_url))
    print(
        f"Benchmarking {model} at {base_url}: {len(requests)} requests, rate {ns.request_rate} req/s, "
        f"burstiness {ns.burstiness}, max concurrency {ns.max_concurrency}",
        flush=True,
    )
    result, results = benchmark_server(base_url, model, requests, ns, slos)
    result.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_tokens for r in results],
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        e2els=[r.e2el for r in results],
    )
    print(format_table(result))
    for error in result["errors"]:
        print(f"error: {error}")
    if ns.save_result:
        with open(ns.save_result, "w") as f:
            json.dump(result, f, indent=2)
    if ns.plot_path:
        from folio.bench.plot import plot_latency_distributions

        plot_latency_distributions(results, ns.plot_path, f"{model} @ {base_url}, rate {ns.request_rate} req/s")
    return 0 if result["completed"] > 0 else 1


async def model_name(base_url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        return await fetch_model_name(client, base_url)

"""Data parallelism on this machine (docs/scale_out.md, "Data parallelism"): a fresh `folio serve` per setting,
the same seeded request set through `folio bench serve`'s client, then the server's own counters from /metrics
(prefix-cache hits / queries and requests per engine core). Settings alternate within each round.

w1: W1 (64 prompts of 20-200 tokens, 128 new tokens, greedy, EOS ignored), all at once: one engine core of 2
threads against 2 cores of 1 thread (the router on its default rule).

prefix: a prefix-heavy load (``prefix_repetition``: 16 prefixes of 512 tokens, each shared by 8 of 128 prompts,
a 64-token suffix each, 32 new tokens), Poisson arrivals, with a KV cache too small for every prefix on one core
of the pair: one core of 2 threads and 2 x the blocks, against 2 cores of 1 thread routed by prefix, by load and
round robin. The hit rate is the cores' summed prefix_cache_hits / prefix_cache_queries (tokens).

    python benchmarks/data_parallel.py w1 --rounds 2
    python benchmarks/data_parallel.py prefix --rounds 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import httpx

from folio.bench.datasets import requests_from_args
from folio.bench.serve import add_serve_bench_args, benchmark_server, dataset_vocabulary
from folio.bench.server_proc import ServeProcess
from folio.cli import build_parser

TOTAL_THREADS = 2  # every setting gets the machine's 2 cores: 1 core x 2 threads or 2 cores x 1 thread
PREFIX_BLOCKS_PER_CORE = 384  # 6144 tokens: 12 of the 16 prefixes, less the running requests' blocks


def settings(workload: str) -> list[tuple[str, list[str]]]:
    if workload == "w1":
        return [("dp=1 (2 threads)", []), ("dp=2 (1 thread each), prefix", ["-dp", "2"])]
    one = ["--num-gpu-blocks-override", str(2 * PREFIX_BLOCKS_PER_CORE)]
    two = ["-dp", "2", "--num-gpu-blocks-override", str(PREFIX_BLOCKS_PER_CORE)]
    return [
        (f"dp=1 (2 threads, {2 * PREFIX_BLOCKS_PER_CORE} blocks)", one),
        (f"dp=2 (1 thread, {PREFIX_BLOCKS_PER_CORE} blocks each), prefix", [*two, "--data-parallel-routing", "prefix"]),
        ("dp=2, load", [*two, "--data-parallel-routing", "load"]),
        ("dp=2, round_robin", [*two, "--data-parallel-routing", "round_robin"]),
    ]


def load_args(workload: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_bench_args(parser)
    if workload == "w1":
        argv = ["--dataset-name", "w1", "--num-prompts", "64"]
    else:
        argv = ["--dataset-name", "prefix_repetition", "--num-prompts", "128", "--request-rate", "8"]
        argv += ["--prefix-repetition-prefix-len", "512", "--prefix-repetition-suffix-len", "64"]
        argv += ["--prefix-repetition-num-prefixes", "16", "--prefix-repetition-output-len", "32"]
    return parser.parse_args(argv)


def server_counters(base_url: str) -> dict[str, float]:
    """Summed over the engine cores: prefix hits and queries (tokens); requests finished per core."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.partition("{")[0]
        if name in ("folio:prefix_cache_hits_total", "folio:prefix_cache_queries_total"):
            out[name] = out.get(name, 0.0) + float(value)
        if name == "folio:request_success_total":
            engine = series.split('engine="')[1].split('"')[0]
            out[f"engine {engine}"] = out.get(f"engine {engine}", 0.0) + float(value)
    return out


def run_one(serve_args: list[str], ns: argparse.Namespace, requests: list[Any], log: Path) -> dict[str, Any]:
    server = ServeProcess(["--dtype", "float32", "--max-model-len", "2048", *serve_args], log)
    server.start()
    try:
        result, _ = benchmark_server(server.base_url, "SmolLM2-135M-Instruct", requests, ns, {})
        counters = server_counters(server.base_url)
    finally:
        server.stop()
    hits = counters.get("folio:prefix_cache_hits_total", 0.0)
    queries = counters.get("folio:prefix_cache_queries_total", 0.0)
    per_engine = [int(v) for k, v in sorted(counters.items()) if k.startswith("engine ")]
    return {
        "completed": result["completed"],
        "output_tok_s": result["output_throughput"],
        "p99_ttft_ms": result["p99_ttft_ms"],
        "mean_tpot_ms": result["mean_tpot_ms"],
        "hit_rate": hits / queries if queries else 0.0,
        "requests_per_engine": per_engine,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["w1", "prefix"])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    build_parser()  # the serve flags exist (fails early on a stale checkout)
    os.environ["OMP_NUM_THREADS"] = str(TOTAL_THREADS)  # the servers' total; dp cores split it
    ns = load_args(args.workload)
    vocab_size, special_ids, tokenize = dataset_vocabulary(ns.dataset_name, None)
    requests = requests_from_args(ns, vocab_size, special_ids, tokenize, None)
    print(f"{args.workload}: {len(requests)} requests, {sum(r.prompt_len for r in requests)} prompt tokens")
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for index, (label, serve_args) in enumerate(settings(args.workload)):
                row = run_one(serve_args, ns, requests, Path(tmp) / f"serve-{round_index}-{index}.log")
                print(
                    f"round {round_index} | {label} | {row['completed']} done | {row['output_tok_s']:.1f} out tok/s | "
                    f"p99 TTFT {row['p99_ttft_ms']:.0f} ms | mean TPOT {row['mean_tpot_ms']:.1f} ms | "
                    f"prefix hit rate {100 * row['hit_rate']:.1f}% | requests per core {row['requests_per_engine']}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

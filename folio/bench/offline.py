"""`folio bench throughput` and `folio bench latency`: the engine in-process (``folio.LLM``), greedy, EOS ignored.

Both take the engine flags of `folio serve`; the engine's ``--seed`` also seeds the request set.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from folio.bench.datasets import SampleRequest, requests_from_args, sample_random


def _make_llm(ns: argparse.Namespace) -> Any:
    from folio.cli import engine_args_from
    from folio.llm import LLM

    return LLM(**vars(engine_args_from(ns)))


def _special_ids(llm: Any) -> list[int]:
    spec = llm.llm_engine.model_spec
    return [i for i in (spec.bos_token_id, *spec.eos_token_ids) if i is not None]


def _generate(llm: Any, requests: list[SampleRequest], use_tqdm: bool) -> list[Any]:
    from folio.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    return list(llm.generate(prompts, params, use_tqdm=use_tqdm))


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-json", default=None, metavar="PATH", help="write the result as JSON to PATH")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def cmd_bench_throughput(ns: argparse.Namespace) -> int:
    """Generates the whole request set in one `LLM.generate` call; the clock covers only that call."""
    llm = _make_llm(ns)
    tokenizer = llm.get_tokenizer()
    requests = requests_from_args(
        ns, llm.llm_engine.model_spec.vocab_size, _special_ids(llm), lambda text: list(tokenizer.encode(text))
    )
    start = time.perf_counter()
    outputs = _generate(llm, requests, use_tqdm=not ns.disable_tqdm)
    elapsed = time.perf_counter() - start
    num_input = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "total_num_tokens": num_input + num_output,
        "requests_per_second": len(outputs) / elapsed,
        "output_tokens_per_second": num_output / elapsed,
        "tokens_per_second": (num_input + num_output) / elapsed,
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens: {num_input}  Total num output tokens: {num_output}  Elapsed: {elapsed:.2f} s")
    _write_json(ns.output_json, result)
    return 0


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("latency benchmark")
    g.add_argument("--batch-size", type=int, default=8, help="requests in the batch (default 8)")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    g.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default 128)")
    g.add_argument("--num-iters-warmup", type=int, default=10, help="untimed runs of the batch first (default 10)")
    g.add_argument("--num-iters", type=int, default=30, help="timed runs of the batch (default 30)")
    g.add_argument("--output-json", default=None, metavar="PATH", help="write the result as JSON to PATH")


def cmd_bench_latency(ns: argparse.Namespace) -> int:
    """Times one batch of random prompts end to end, ``--num-iters`` times after ``--num-iters-warmup`` runs."""
    if min(ns.batch_size, ns.input_len, ns.output_len, ns.num_iters) < 1 or ns.num_iters_warmup < 0:
        raise ValueError("batch size, lengths and num_iters must be >= 1, num_iters_warmup >= 0")
    llm = _make_llm(ns)
    vocab_size = llm.llm_engine.model_spec.vocab_size
    batch = sample_random(ns.batch_size, ns.input_len, ns.output_len, vocab_size, ns.seed, 0.0, 0, _special_ids(llm))
    for _ in range(ns.num_iters_warmup):
        _generate(llm, batch, use_tqdm=False)
    latencies: list[float] = []
    for _ in range(ns.num_iters):
        start = time.perf_counter()
        _generate(llm, batch, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    arr = np.asarray(latencies)
    percentiles = {f"p{p}": float(np.percentile(arr, p)) for p in (50, 90, 99)}
    result = {
        "batch_size": ns.batch_size,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "avg_latency": float(arr.mean()),
        "latencies": latencies,
        "percentiles": percentiles,
    }
    print(
        f"Avg latency: {result['avg_latency']:.4f} s  (batch {ns.batch_size} x {ns.input_len} in / {ns.output_len} out)"
    )
    for name, value in percentiles.items():
        print(f"{name.upper()} latency: {value:.4f} s")
    _write_json(ns.output_json, result)
    return 0

"""`folio bench throughput` and `folio bench latency`: the engine in-process (``folio.LLM``), greedy, EOS ignored.

Both take the engine flags of `folio serve`; the engine's ``--seed`` also seeds the request set.
``latency --profile`` also times every engine step phase by phase (folio.bench.profile), by default with the
no-op model (``model_impl="noop"``) so that the table is the engine's own overhead.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from folio.bench.datasets import SampleRequest, requests_from_args, sample_random
from folio.bench.kv_usage import KVUsageSampler, summarize_kv_usage
from folio.bench.profile import format_fused_phases, format_profile, summarize_fused_phases, summarize_steps
from folio.step_timer import StepTimer

PROFILE_MODELS = ("noop", "real", "both")


def _make_llm(ns: argparse.Namespace, **overrides: Any) -> Any:
    from folio.engine_flags import engine_args_from
    from folio.llm import LLM

    return LLM(**{**vars(engine_args_from(ns)), **overrides})


def _special_ids(llm: Any) -> list[int]:
    spec = llm.llm_engine.model_spec
    return [i for i in (spec.bos_token_id, *spec.eos_token_ids) if i is not None]


def _generate(llm: Any, requests: list[SampleRequest], use_tqdm: bool) -> list[Any]:
    from folio.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=r.ignore_eos) for r in requests]
    return list(llm.generate(prompts, params, use_tqdm=use_tqdm))


def dataset_requests(llm: Any, ns: argparse.Namespace) -> list[SampleRequest]:
    """The request set of the dataset flags, with this engine's vocabulary, tokenizer and chat template."""
    from folio.bench.copy_edit import chat_renderer

    tokenizer = llm.get_tokenizer()
    return requests_from_args(
        ns,
        llm.llm_engine.model_spec.vocab_size,
        _special_ids(llm),
        lambda text: list(tokenizer.encode(text)),
        chat_renderer(tokenizer),
    )


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-json", default=None, metavar="PATH", help="write the result as JSON to PATH")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument(
        "--compare-offloading",
        action="store_true",
        help="multi_turn: run the workload twice, without and with the host KV tier of --kv-offloading-size (the "
        "other engine flags the same); print both, their ratio, the tokens recomputed after preemption in each, and "
        "whether the greedy outputs were identical (exit 1 if not)",
    )
    parser.add_argument(
        "--compare-speculative",
        action="store_true",
        help="run the request set twice, without and then with --speculative-config (the other engine flags the "
        "same); print throughput, mean TTFT and TPOT of both, their ratio, tokens per request step, and whether the "
        "greedy outputs were identical (exit 1 if not)",
    )
    parser.add_argument(
        "--compare-rounds",
        type=int,
        default=None,
        help="--compare-speculative / --compare-offloading: alternating rounds per side, the median round of each "
        "reported (default 3 for --compare-speculative, 1 for --compare-offloading, whose rounds take minutes)",
    )


def cmd_bench_throughput(ns: argparse.Namespace) -> int:
    """Generates the whole request set in one `LLM.generate` call; the clock covers only that call. multi_turn runs
    in waves instead (folio/bench/multi_turn.py)."""
    if ns.dataset_name == "multi_turn":
        from folio.bench.multi_turn import cmd_multi_turn

        return cmd_multi_turn(ns)
    if ns.compare_offloading:
        raise ValueError("--compare-offloading runs only with --dataset-name multi_turn")
    if ns.compare_speculative:
        from folio.bench.spec_compare import cmd_compare_speculative

        return cmd_compare_speculative(ns)
    llm = _make_llm(ns)
    requests = dataset_requests(llm, ns)
    sampler = KVUsageSampler()
    llm.llm_engine.stats_observer = sampler
    collectives_before = _collective_time(llm)
    start = time.perf_counter()
    outputs = _generate(llm, requests, use_tqdm=not ns.disable_tqdm)
    elapsed = time.perf_counter() - start
    llm.llm_engine.stats_observer = None
    collectives_after = _collective_time(llm)
    num_input = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result: dict[str, Any] = {
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
    max_model_len = llm.llm_engine.config.scheduler_config.max_model_len
    mean_request_max = sum(len(r.prompt_token_ids) + r.output_len for r in requests) / len(requests)
    kv_usage = summarize_kv_usage(sampler.samples, max_model_len, mean_request_max)
    if kv_usage is not None:
        print("\n".join(kv_usage.lines(max_model_len, mean_request_max)))
        result["kv_cache_usage"] = asdict(kv_usage)
    if collectives_before is not None and collectives_after is not None:
        result["tensor_parallel_collectives"] = _print_collectives(collectives_before, collectives_after, elapsed)
    ceiling = _flop_ceiling(llm, requests, result["output_tokens_per_second"])
    if ceiling is not None:
        result["flop_ceiling"] = ceiling
    _write_json(ns.output_json, result)
    return 0


def _collective_time(llm: Any) -> tuple[float, int] | None:
    """Tensor parallelism: (seconds the answering rank has spent in its collectives, steps collected) so far."""
    if llm.llm_engine.config.parallel_config.tensor_parallel_size == 1:
        return None
    executor = llm.llm_engine.executor
    return executor.collective_seconds, executor.steps_collected


def _print_collectives(before: tuple[float, int], after: tuple[float, int], elapsed: float) -> dict[str, float]:
    """The run's per-step communication: the answering rank's wall time in all-reduces and all-gathers (waiting
    for its peers included) over the run's steps."""
    seconds, steps = after[0] - before[0], after[1] - before[1]
    per_step_ms = 1e3 * seconds / max(steps, 1)
    print(
        f"Tensor-parallel collectives (the rank that answers the core): {seconds:.2f} s over {steps} steps = "
        f"{per_step_ms:.2f} ms a step, {100 * seconds / elapsed:.0f}% of the run"
    )
    return {"seconds": seconds, "steps": steps, "ms_per_step": per_step_ms, "fraction_of_run": seconds / elapsed}


def _flop_ceiling(llm: Any, requests: list[SampleRequest], output_tps: float) -> dict[str, float] | None:
    """Prints this run against the FLOP ceiling: the request set's matmul FLOPs at the best GEMM rate measured
    now, in the engine's dtype (folio.bench.roofline): a 2048^3 GEMM timed on the engine's cores or its GPU."""
    from folio.bench.roofline import measure_matmul_flops, workload_ceiling

    worker = getattr(llm.llm_engine.executor, "worker", None)  # None: the workers run in their own processes
    if worker is None:
        return None
    tier = llm.llm_engine.config.cpu_config.tier() if worker.device.type == "cpu" else None
    matmul = measure_matmul_flops(dtype=worker.dtype, tier=tier, device=worker.device)
    lengths = [(len(r.prompt_token_ids), r.output_len) for r in requests]
    ceiling = workload_ceiling(llm.llm_engine.model_spec, lengths, matmul)
    fraction = output_tps / ceiling.output_tokens_per_second
    dtype_name = str(worker.dtype).removeprefix("torch.")
    print(
        f"FLOP ceiling: {ceiling.workload_flops / 1e12:.2f} TFLOP of matmuls at a measured {matmul / 1e9:.0f} GFLOP/s "
        f"(best {dtype_name} GEMM, 2048^3) -> {ceiling.output_tokens_per_second:.0f} output tok/s; "
        f"this run: {output_tps:.1f} = {100 * fraction:.0f}% of it"
    )
    return {
        "matmul_flops": matmul,
        "ceiling_output_tokens_per_second": ceiling.output_tokens_per_second,
        "fraction": fraction,
    }


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("latency benchmark")
    g.add_argument("--batch-size", type=int, default=8, help="requests in the batch (default 8)")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default 32)")
    g.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default 128)")
    g.add_argument("--num-iters-warmup", type=int, default=10, help="untimed runs of the batch first (default 10)")
    g.add_argument("--num-iters", type=int, default=30, help="timed runs of the batch (default 30)")
    g.add_argument("--output-json", default=None, metavar="PATH", help="write the result as JSON to PATH")
    g.add_argument(
        "--profile",
        nargs="?",
        const="noop",
        default=None,
        choices=PROFILE_MODELS,
        help="also time each engine step by phase (scheduler, input preparation, forward, sampling, update, "
        "output processing) over the steps where the whole batch decodes; noop (the default of a bare --profile): "
        "with the no-op model, i.e. the engine's own overhead; real: with the model; both: one after the other",
    )


def _run_batch(llm: Any, batch: list[SampleRequest]) -> tuple[float, int]:
    """(seconds, output tokens) of one generate call over the batch."""
    start = time.perf_counter()
    outputs = _generate(llm, batch, use_tqdm=False)
    return time.perf_counter() - start, sum(len(c.token_ids) for o in outputs for c in o.outputs)


def _latency_result(ns: argparse.Namespace, latencies: list[float]) -> dict[str, Any]:
    arr = np.asarray(latencies)
    percentiles = {f"p{p}": float(np.percentile(arr, p)) for p in (50, 90, 99)}
    print(f"Avg latency: {arr.mean():.4f} s  (batch {ns.batch_size} x {ns.input_len} in / {ns.output_len} out)")
    for name, value in percentiles.items():
        print(f"{name.upper()} latency: {value:.4f} s")
    return {
        "batch_size": ns.batch_size,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "avg_latency": float(arr.mean()),
        "latencies": latencies,
        "percentiles": percentiles,
    }


def _fused_decoder(llm: Any) -> Any:
    """The model's fused CPU decoder (folio.model.cpu_fused), or None (no-op model, --enforce-eager, CUDA)."""
    model = getattr(getattr(getattr(llm.llm_engine.executor, "worker", None), "model", None), "model", None)
    return getattr(model, "fused_cpu", None)


def _time_runs(llm: Any, ns: argparse.Namespace, timer: StepTimer | None) -> tuple[list[float], list[int]]:
    """Warm-up runs, then ``--num-iters`` timed runs (with ``timer`` attached to the engine only for those)."""
    vocab_size = llm.llm_engine.model_spec.vocab_size
    batch = sample_random(ns.batch_size, ns.input_len, ns.output_len, vocab_size, ns.seed, 0.0, 0, _special_ids(llm))
    for _ in range(ns.num_iters_warmup):
        _run_batch(llm, batch)
    llm.llm_engine.set_step_timer(timer)
    try:
        runs = [_run_batch(llm, batch) for _ in range(ns.num_iters)]
    finally:
        llm.llm_engine.set_step_timer(None)
    return [r[0] for r in runs], [r[1] for r in runs]


def cmd_bench_latency(ns: argparse.Namespace) -> int:
    """Times one batch of random prompts end to end, ``--num-iters`` times after ``--num-iters-warmup`` runs.

    With ``--profile`` the step timer is attached during the timed runs (its laps cost ~1 us each) and the
    phase table follows the latency lines; exit 1 if a run generated other than batch x output-len tokens.
    """
    if min(ns.batch_size, ns.input_len, ns.output_len, ns.num_iters) < 1 or ns.num_iters_warmup < 0:
        raise ValueError("batch size, lengths and num_iters must be >= 1, num_iters_warmup >= 0")
    if ns.profile is None:
        latencies, _ = _time_runs(_make_llm(ns), ns, None)
        _write_json(ns.output_json, _latency_result(ns, latencies))
        return 0
    result: dict[str, Any] = {"profile": {}}
    ok = True
    for kind in ("noop", "real") if ns.profile == "both" else (ns.profile,):
        llm = _make_llm(ns, model_impl="noop") if kind == "noop" else _make_llm(ns)
        timer = StepTimer()
        fused = _fused_decoder(llm)
        if fused is not None:
            fused.set_phase_timing(True)
        latencies, num_tokens = _time_runs(llm, ns, timer)
        phase_records = [] if fused is None else list(fused.phase_records or [])
        del llm, fused
        noop = kind == "noop"
        print(f"--- {'no-op model (the engine alone)' if noop else 'real model'}")
        entry = _latency_result(ns, latencies)
        requested = ns.batch_size * ns.output_len
        print(f"Output tokens per run: {', '.join(map(str, num_tokens))} ({requested} requested)")
        ok = ok and all(n == requested for n in num_tokens)
        entry.update(summarize_steps(timer.steps, ns.batch_size), output_tokens_per_run=num_tokens)
        title = "Step profile: no-op model" if noop else "Step profile: real model"
        print(format_profile(entry, title, noop), flush=True)
        if phase_records:
            entry["fused_decoder_phases_ms"] = summarize_fused_phases(phase_records, ns.batch_size)
            print(format_fused_phases(entry["fused_decoder_phases_ms"], ns.batch_size), flush=True)
        result["profile"][kind] = entry
    _write_json(ns.output_json, result)
    return 0 if ok else 1

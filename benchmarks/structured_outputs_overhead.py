"""The Masks target: what structured outputs cost a decode step at 64 running requests, all constrained by one
20-property JSON schema, against the same 64 requests unconstrained; and the compile latency of that schema.

Same engine, same prompts, same sampling (seeded), both runs interleaved over several rounds. Each round adds the
64 requests, steps until every one of them has its first token (prefills and compiles done), then times
``--steps`` engine steps in which all 64 decode, and aborts them. Printed:
  - the median step time unconstrained and constrained, and their difference as a share of the unconstrained step
    (the target: < 10%);
  - the mask work inside a constrained step, timed directly: the batched bitmask fill (one backend call), the
    sampler's bitmask stage, and the matchers' advance over the sampled tokens;
  - the compile latency of the schema (cold: a fresh backend, nothing cached, plus its first mask).
At temperature 0 both runs take the model's fused LM-head arg-max (no logits); a constrained row then computes
logits only when the grammar bans its arg-max (folio.structured.bitmask.constrained_greedy), timed as "greedy
check". Step times are wall-clock and the engine process's CPU time (less sensitive to other processes).

Usage: python benchmarks/structured_outputs_overhead.py [--num-reqs 64] [--steps 24] [--rounds 3]
       [--temperatures 1.0 0.0] [--dtype auto] [--backend auto]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import folio.sample.sampler as sampler_module
import folio.worker.model_runner as runner_module
from folio import LLM, SamplingParams
from folio.bench.schemas import TWENTY_PROPERTY_SCHEMA
from folio.structured.backend import allocate_bitmask, create_backend, resolve_backend_name
from folio.structured.params import StructuredOutputsParams


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


class Timed:
    """Wraps a callable and sums its wall time while ``active``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.total_s = 0.0
        self.active = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.active:
            return self.fn(*args, **kwargs)
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total_s += time.perf_counter() - start


def compile_latency_ms(llm: LLM, backend: str, runs: int) -> list[float]:
    engine = llm.llm_engine
    spec = StructuredOutputsParams(json=TWENTY_PROPERTY_SCHEMA).grammar_spec()
    vocab_size, eos = engine.model_spec.vocab_size, list(engine.model_spec.eos_token_ids)
    times = []
    for _ in range(runs):
        fresh = create_backend(backend, engine.tokenizer, vocab_size, eos)
        start = time.perf_counter()
        matcher = fresh.new_matcher(fresh.compile(spec))
        fresh.fill_bitmask([(matcher, 0)], allocate_bitmask(1, vocab_size))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run_round(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, steps: int, probes: list[Timed]
) -> tuple[list[float], list[float]]:
    """Per-step (wall, CPU) times (s) of ``steps`` steps with every request decoding."""
    engine = llm.llm_engine
    ids = [engine.next_request_id() for _ in prompts]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    scheduler = engine.scheduler
    while not (len(scheduler.running) == len(prompts) and all(r.num_output_tokens >= 1 for r in scheduler.running)):
        engine.step()
    for probe in probes:
        probe.active = True
    step_s, cpu_s = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.step()
        step_s.append(time.perf_counter() - start)
        cpu_s.append(time.process_time() - start_cpu)
        if len(scheduler.running) != len(prompts):
            raise RuntimeError("a request finished during the measured steps: lower --steps")
    for probe in probes:
        probe.active = False
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return step_s, cpu_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-reqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--backend", default="auto", help="auto, guidance or xgrammar")
    parser.add_argument("--compile-runs", type=int, default=5)
    args = parser.parse_args()
    backend = resolve_backend_name(args.backend)
    llm = LLM(dtype=args.dtype, max_num_seqs=args.num_reqs, structured_outputs_config={"backend": backend})
    engine = llm.llm_engine
    tokenizer = engine.tokenizer
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe user number {i} of our shop as a JSON record."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for i in range(args.num_reqs)
    ]
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    manager = engine.engine_core.structured_output_manager
    fill, accept = Timed(manager.fill_bitmask), Timed(manager.accept)
    manager.fill_bitmask, manager.accept = fill, accept  # type: ignore[method-assign]
    apply = Timed(sampler_module.apply_token_bitmask_rows)
    sampler_module.apply_token_bitmask_rows = apply  # type: ignore[assignment]
    greedy = Timed(runner_module.constrained_greedy)
    runner_module.constrained_greedy = greedy  # type: ignore[assignment]
    probes = [fill, accept, apply, greedy]
    compile_ms = compile_latency_ms(llm, backend, args.compile_runs)
    dtype = engine.executor.worker.dtype if hasattr(engine.executor.worker, "dtype") else "?"
    print(f"CPU: {_cpu_name()}; torch threads {torch.get_num_threads()}; dtype {dtype}; backend {backend}")
    print(
        f"compile latency, 20-property schema ({backend}, cold, incl. first mask): median "
        f"{statistics.median(compile_ms):.1f} ms (runs: {', '.join(f'{t:.1f}' for t in compile_ms)})"
    )
    schema = StructuredOutputsParams(json=TWENTY_PROPERTY_SCHEMA)
    for temperature in args.temperatures:
        free = SamplingParams(temperature=temperature, seed=1, max_tokens=400, ignore_eos=True)
        constrained = SamplingParams(temperature=temperature, seed=1, max_tokens=400, structured_outputs=schema)
        walls: dict[str, list[float]] = {"free": [], "constrained": []}
        cpus: dict[str, list[float]] = {"free": [], "constrained": []}
        for probe in probes:
            probe.total_s = 0.0
        for _ in range(args.rounds):  # interleaved, so that a slow spell of the machine hits both
            for name, params, round_probes in (("free", free, []), ("constrained", constrained, probes)):
                wall, cpu = run_round(llm, prompts, params, args.steps, round_probes)
                walls[name] += wall
                cpus[name] += cpu
        n = len(walls["constrained"])
        print(f"T={temperature:g}, {args.num_reqs} running requests, {args.rounds} rounds x {args.steps} steps:")
        for label, times in (("wall", walls), ("CPU", cpus)):
            free_ms = statistics.median(times["free"]) * 1e3
            constrained_ms = statistics.median(times["constrained"]) * 1e3
            print(
                f"    step median ({label}): unconstrained {free_ms:.2f} ms, constrained {constrained_ms:.2f} ms -> "
                f"overhead {constrained_ms - free_ms:+.2f} ms = {100 * (constrained_ms - free_ms) / free_ms:+.1f}% "
                "(target < 10%)"
            )
        fill_ms, accept_ms, apply_ms, greedy_ms = (p.total_s / n * 1e3 for p in probes)
        mask_ms = fill_ms + apply_ms + accept_ms + greedy_ms
        free_wall_ms = statistics.median(walls["free"]) * 1e3
        print(
            f"    mask work per constrained step (timed directly, wall): fill {fill_ms:.2f} ms + sampler stage "
            f"{apply_ms:.2f} ms + greedy check {greedy_ms:.2f} ms + accept {accept_ms:.2f} ms = {mask_ms:.2f} ms "
            f"= {100 * mask_ms / free_wall_ms:.1f}% of the unconstrained step"
        )


if __name__ == "__main__":
    main()

"""A/B of two or more builds of the CPU kernels on whole W1 runs, alternating in one process.

    git archive HEAD~1 folio/kernels | tar -x -C /tmp/old        # the tree to compare against
    gcc -O3 -march=native -ffast-math -fopenmp -fPIC -shared -std=c11 /tmp/old/folio/kernels/cpu_kernels.c \\
        -o /tmp/old.so -lm                                        # (the flags of folio/kernels/cpu_build.py)
    .venv/bin/python benchmarks/ab_kernel_builds_w1.py /tmp/old.so /tmp/new.so --rounds 8

Each build gets an LLM of its own (prefix caching off, 2 GiB of KV) built while Folio's kernel loader is pointed
at that library; then each round runs W1 (64 prompts, 128 new tokens, greedy, EOS ignored) once per build, in
turn. Even rounds time the whole run (output tok/s); odd rounds turn on the fused decoder's phase timers and
keep, per phase, the least time over the rounds, summed over decode-only steps and over the steps that also
carry prefill chunks. Where benchmarks/ab_attention_builds.py shows a kernel's own speed, this shows what of it
reaches a W1 run through the memory traffic of the layers around it. Prints tables; nothing is asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import time

from folio import LLM, SamplingParams
from folio.bench.datasets import DEFAULT_W1_PATH, load_w1
from folio.kernels import cpu_kernels
from folio.model.cpu_fused import PHASES


def build_with(path: str, dtype: str) -> LLM:
    """An LLM whose kernels all come from the library at ``path`` (the engine's one loader, cpu_kernels, patched
    and its cache cleared first; the plan follows the tier the library reports)."""
    lib = ctypes.CDLL(path)
    cpu_kernels.load_kernel_library = lambda name, tier=None, lib=lib: lib  # type: ignore[assignment]
    cpu_kernels.load_cpu_kernels.cache_clear()
    return LLM(dtype=dtype, enable_prefix_caching=False, kv_cache_memory_bytes=2 << 30)


def min_phases(current: list[float] | None, records: list[tuple[int, int, list[float]]], mixed: bool) -> list[float]:
    steps = [phases for _, num_segs, phases in records if (num_segs > 0) == mixed]
    sums = [sum(phases[i] for phases in steps) for i in range(len(PHASES))]
    return sums if current is None else [min(a, b) for a, b in zip(current, sums, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="+", help="kernel builds (.so) to compare")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=8, help="W1 runs per build (half timed, half phase-timed)")
    ns = parser.parse_args()
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in load_w1(str(DEFAULT_W1_PATH), 64, 128)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llms = {}
    for path in ns.libraries:
        llms[path] = build_with(path, ns.dtype)
        llms[path].generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {path: [] for path in llms}
    decode: dict[str, list[float] | None] = dict.fromkeys(llms)
    mixed: dict[str, list[float] | None] = dict.fromkeys(llms)
    for round_index in range(ns.rounds):
        for path, llm in llms.items():
            fused = llm.llm_engine.executor.worker.model.model.fused_cpu
            timed_phases = round_index % 2 == 1
            fused.set_phase_timing(timed_phases)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            if timed_phases:
                decode[path] = min_phases(decode[path], fused.phase_records, mixed=False)
                mixed[path] = min_phases(mixed[path], fused.phase_records, mixed=True)
            else:
                rates[path].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
            fused.set_phase_timing(False)
    print(f"W1 offline, {ns.dtype}, output tok/s per timed run (alternating)")
    for path, values in rates.items():
        print(f"  {path}: best {max(values):.1f}  runs {' '.join(f'{v:.1f}' for v in values)}")
    for title, table in (("decode-only steps", decode), ("steps with prefill chunks", mixed)):
        print(f"phase seconds, least over the phase-timed runs, {title}")
        print(f"  {'phase':<20}" + "".join(f"{path[-18:]:>20}" for path in llms))
        for i, phase in enumerate(PHASES):
            print(f"  {phase:<20}" + "".join(f"{table[path][i]:>20.3f}" for path in llms))  # type: ignore[index]


if __name__ == "__main__":
    main()

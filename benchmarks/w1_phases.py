"""Where a whole W1 run's time goes, phase by phase, through the fused CPU decoder's own timers.

    .venv/bin/python benchmarks/w1_phases.py                      # bfloat16
    .venv/bin/python benchmarks/w1_phases.py --dtype float32 --repeats 1
    .venv/bin/python benchmarks/w1_phases.py --dtype float32 --cpu-isa avx2   # an AVX-512 CPU's AVX2 tier
    .venv/bin/python benchmarks/w1_phases.py --dtype float32 --engine-args '{"cpu_kv_prefetch_bytes": 0}'

W1 (64 prompts, 128 new tokens, greedy, EOS ignored, prefix caching off) through LLM.generate, with the fused
decoder timing each phase of every step (folio/model/cpu_fused.py PHASES: norms, each projection, rotary + K/V
write, decode and prefill attention, SiLU): the run's wall time, the phases' sums split between steps that
carry prefill tokens and steps that only decode, and what is left outside the decoder (embedding, the LM head
and its arg-max, the engine's Python). `folio bench latency --profile real` gives the same per step of one
fixed batch; this is the whole workload. Timing costs a clock read per phase per thread 0: about 1% here.
Each projection's rate in the decode-only steps (every row through every layer) is printed beside its time, to
hold against `benchmarks/cpu_gemm.py`'s figure for the same shape.
"""

from __future__ import annotations

import argparse
import json
import time

from folio import LLM, SamplingParams
from folio.bench.datasets import DEFAULT_W1_PATH, load_w1
from folio.model.cpu_fused import PHASES
from folio.model.spec import ModelSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=2, help="timed W1 runs (the last one is shown in full)")
    parser.add_argument("--cpu-isa", default="auto", help="the engine's cpu_isa (auto, generic, avx2, avx512, ...)")
    parser.add_argument(
        "--engine-args",
        default="{}",
        help="more LLM(...) keywords as JSON, e.g. '{\"cpu_kv_prefetch_bytes\": 0}' (the side prefetch off)",
    )
    ns = parser.parse_args()
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in load_w1(str(DEFAULT_W1_PATH), 64, 128)]
    engine_args = {
        "dtype": ns.dtype,
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": 2 << 30,
        "cpu_isa": ns.cpu_isa,
        **json.loads(ns.engine_args),
    }
    llm = LLM(**engine_args)
    worker = llm.llm_engine.executor.worker
    fused = worker.model.model.fused_cpu
    if fused is None:
        raise SystemExit("the fused CPU decoder is off here (no C compiler, or not a CPU float32/bfloat16 model)")
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up: kernels built
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    for run in range(ns.repeats):
        fused.set_phase_timing(True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        records = fused.phase_records or []
        fused.set_phase_timing(False)
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        total = sum(sum(r[2]) for r in records)
        print(
            f"run {run + 1}: {elapsed:.2f} s, {num_out / elapsed:.1f} output tok/s, {len(records)} steps, "
            f"fused decoder {total:.2f} s, outside it {elapsed - total:.2f} s"
        )
    groups = {
        "steps with prefill": [r for r in records if r[1] > 0],
        "decode-only steps": [r for r in records if r[1] == 0],
    }
    print(f"\n{'phase (s, last run)':<22}" + "".join(f"{name:>20}" for name in groups) + f"{'all':>10}")
    for i, phase in enumerate(PHASES):
        cells = [sum(r[2][i] for r in group) for group in groups.values()]
        print(f"{phase:<22}" + "".join(f"{c:>20.3f}" for c in cells) + f"{sum(cells):>10.3f}")
    sums = [sum(sum(r[2]) for r in group) for group in groups.values()]
    counts = "".join(f"{f'({len(g)} steps)':>20}" for g in groups.values())
    print(f"{'all phases':<22}" + "".join(f"{c:>20.3f}" for c in sums) + f"{sum(sums):>10.3f}")
    print(f"{'':<22}" + counts)
    decode_rates(groups["decode-only steps"], worker.spec)


def decode_rates(records: list[tuple[int, int, list[float]]], spec: ModelSpec) -> None:
    """GFLOP/s of each projection over the decode-only steps, where every row runs every layer's projections."""
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    shapes = {  # phase -> (k, n) of its GEMM
        "qkv_proj": (h, spec.num_attention_heads * spec.head_dim + 2 * kv),
        "o_proj": (spec.num_attention_heads * spec.head_dim, h),
        "gate_up_proj": (h, 2 * spec.intermediate_size),
        "down_proj": (spec.intermediate_size, h),
    }
    rows = sum(r[0] for r in records)
    print(f"\ndecode-only projections ({rows} rows in all, {spec.num_hidden_layers} layers)")
    for phase, (k, n) in shapes.items():
        seconds = sum(r[2][PHASES.index(phase)] for r in records)
        flops = 2.0 * rows * spec.num_hidden_layers * k * n
        rate = f"{flops / seconds / 1e9:8.1f} GFLOP/s" if seconds > 0 else "   (no time)"
        print(f"  {phase:<14} k {k:>5} n {n:>5}  {seconds:7.3f} s {rate}")


if __name__ == "__main__":
    main()

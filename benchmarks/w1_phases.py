"""Where a whole W1 run's time goes, phase by phase, through the fused CPU decoder's own timers.

    .venv/bin/python benchmarks/w1_phases.py                      # bfloat16
    .venv/bin/python benchmarks/w1_phases.py --dtype float32 --repeats 1

W1 (64 prompts, 128 new tokens, greedy, EOS ignored, prefix caching off) through LLM.generate, with the fused
decoder timing each phase of every step (folio/model/cpu_fused.py PHASES: norms, each projection, rotary + K/V
write, decode and prefill attention, SiLU): the run's wall time, the phases' sums split between steps that
carry prefill tokens and steps that only decode, and what is left outside the decoder (embedding, the LM head
and its arg-max, the engine's Python). `folio bench latency --profile real` gives the same per step of one
fixed batch; this is the whole workload. Timing costs a clock read per phase per thread 0: about 1% here.
"""

from __future__ import annotations

import argparse
import time

from folio import LLM, SamplingParams
from folio.bench.datasets import DEFAULT_W1_PATH, load_w1
from folio.model.cpu_fused import PHASES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=2, help="timed W1 runs (the last one is shown in full)")
    ns = parser.parse_args()
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in load_w1(str(DEFAULT_W1_PATH), 64, 128)]
    llm = LLM(dtype=ns.dtype, enable_prefix_caching=False, kv_cache_memory_bytes=2 << 30)
    fused = llm.llm_engine.executor.worker.model.model.fused_cpu
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


if __name__ == "__main__":
    main()

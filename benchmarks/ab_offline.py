"""A/B of Folio engine settings on W1 offline, alternating runs in one process so that machine noise hits all.

    .venv/bin/python benchmarks/ab_offline.py --dtype bfloat16 --config eager='{"enforce_eager": true}'
    .venv/bin/python benchmarks/ab_offline.py --config no_fused_argmax='{"fused_argmax": false}' --repeats 4
    .venv/bin/python benchmarks/ab_offline.py --config no_kv_prefetch='{"kv_prefetch_bytes": 0}' --repeats 6

Every config is an `LLM(...)` built from the same base (--dtype, prefix caching off: repeated runs must not hit a
warm cache; 2 GiB of KV each) updated with the config's JSON keywords; "base" (no changes) always runs first.
Two keys are not LLM arguments: "fused_argmax": false makes the model decline the LM head's fused arg-max so
every greedy step computes logits and samples from them; "kv_prefetch_bytes": N sets how much of the next
layer's decode K/V the fused decoder's GEMMs prefetch (0: none; FusedCpuDecoder.set_kv_prefetch_bytes).
Each round runs W1 (64 prompts, 128 new tokens, greedy, EOS ignored) once per config; the table gives every
run, the best, and best / base's best.
Run it on a quiet machine: this VM's memory bandwidth ranged 28-45 GB/s over one session (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from folio import LLM, SamplingParams
from folio.bench.datasets import DEFAULT_W1_PATH, load_w1


def build(dtype: str, changes: dict[str, Any]) -> LLM:
    changes = dict(changes)
    fused_argmax = changes.pop("fused_argmax", True)
    kv_prefetch_bytes = changes.pop("kv_prefetch_bytes", None)
    base = {"dtype": dtype, "enable_prefix_caching": False, "kv_cache_memory_bytes": 2 << 30}
    llm = LLM(**{**base, **changes})  # a config may change the base's keywords too (e.g. the KV size)
    model = llm.llm_engine.executor.worker.model
    if not fused_argmax:
        model.compute_greedy_token_ids = lambda hidden: None
    if kv_prefetch_bytes is not None:
        model.model.fused_cpu.set_kv_prefetch_bytes(kv_prefetch_bytes)
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--config", action="append", default=[], metavar="NAME=JSON", help="a config to compare")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (one W1 run per config each)")
    ns = parser.parse_args()
    configs: dict[str, dict[str, Any]] = {"base": {}}
    for item in ns.config:
        name, _, spec = item.partition("=")
        configs[name] = json.loads(spec)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in load_w1(str(DEFAULT_W1_PATH), 64, 128)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llms = {name: build(ns.dtype, changes) for name, changes in configs.items()}
    for llm in llms.values():  # warm-up: kernels built, first-call allocations done
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    runs: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(ns.repeats):
        for name, llm in llms.items():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            runs[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
    base_best = max(runs["base"])
    print(f"W1 offline, {ns.dtype}, output tok/s per run ({ns.repeats} rounds, alternating)")
    for name, values in runs.items():
        cells = " ".join(f"{v:6.1f}" for v in values)
        print(f"  {name:<20} {cells}   best {max(values):6.1f}   best / base {max(values) / base_best:.3f}")


if __name__ == "__main__":
    main()

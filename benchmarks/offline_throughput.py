"""Offline throughput on workload W1 (or random prompts): prompts x new tokens, greedy, EOS ignored.

    .venv/bin/python benchmarks/offline_throughput.py                  # W1 from ../shared/workloads
    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 16 --output-len 32

Prints output tokens/s and total tokens/s. (The full `folio bench` with peers measured in the same run is its
own issue; this is the engine's number alone.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from folio import LLM, SamplingParams

W1 = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w1_prompts.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default=str(W1))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    data = json.loads(Path(args.workload).read_text())
    prompts = [{"prompt_token_ids": p["ids"]} for p in data["prompts"]][: args.num_prompts]
    llm = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"requests: {len(outputs)}  prompt tokens: {num_in}  output tokens: {num_out}  time: {elapsed:.2f} s")
    total = (num_in + num_out) / elapsed
    print(f"output throughput: {num_out / elapsed:.1f} tok/s   total throughput: {total:.1f} tok/s")


if __name__ == "__main__":
    main()

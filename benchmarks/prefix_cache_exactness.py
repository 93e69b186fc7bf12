"""Is a prefix hit exact? Greedy outputs of a second turn whose cached prefix holds the first turn's generated tokens,
against the same prompt computed whole (prefix caching off).

    .venv/bin/python benchmarks/prefix_cache_exactness.py --dtype bfloat16     # or float32

Prints, per random conversation, the cached tokens of the second turn, whether its output equals the whole
computation's, and the first differing position. The generated tokens' K/V were written by decode steps (the
decode attention kernel); computed whole, the same positions go through the prefill kernel, which sums in another
order (an online softmax over blocks against three passes). In float32 those last-bit differences stay last-bit
and every trial so far agreed; in bfloat16 each layer's output is rounded to bf16, so now and then one of them
flips a rounding, and the K/V of later layers differ by a bf16 step. (Not the bf16 rounding of the softmax
weights before P.V: with both kernels keeping them in float32, the same 3 of 10 trials differed; with every decode
row handed to the prefill tile instead, 10 of 10 were identical; docs/performance.md, session 17.)
"""

from __future__ import annotations

import argparse
import random

from folio import LLM, SamplingParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--trials", type=int, default=6)
    ns = parser.parse_args()
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    cached = LLM(dtype=ns.dtype, max_model_len=2048)
    whole = LLM(dtype=ns.dtype, max_model_len=2048, enable_prefix_caching=False)
    num_identical = 0
    for trial in range(ns.trials):
        first_prompt = [rng.randrange(300, 40000) for _ in range(600)]
        user = [rng.randrange(300, 40000) for _ in range(256)]
        reply = cached.generate([{"prompt_token_ids": first_prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        second = {"prompt_token_ids": first_prompt + list(reply) + user}
        hit = cached.generate([second], params, use_tqdm=False)[0]
        ref = whole.generate([second], params, use_tqdm=False)[0]
        a, b = list(hit.outputs[0].token_ids), list(ref.outputs[0].token_ids)
        num_identical += a == b
        print(
            f"trial {trial}: {hit.num_cached_tokens} cached tokens, identical {a == b}, first difference at "
            f"{first_difference(a, b)}"
        )
    print(f"{ns.dtype}: {num_identical} of {ns.trials} second turns identical with and without the prefix hit")


if __name__ == "__main__":
    main()

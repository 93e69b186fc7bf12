"""A/B of two or more builds of the CPU kernels on the prefill attention, alternating calls in one process.

    git archive HEAD~1 folio/kernels | tar -x -C /tmp/old        # the tree to compare against
    gcc -O3 -march=native -ffast-math -fopenmp -fPIC -shared -std=c11 /tmp/old/folio/kernels/cpu_kernels.c \\
        -o /tmp/old.so -lm                                        # (the flags of folio/kernels/cpu_build.py)
    .venv/bin/python benchmarks/ab_attention_builds.py /tmp/old.so /tmp/new.so
    .venv/bin/python benchmarks/ab_attention_builds.py --dtype float32 --prompt-len 500 1000 --num-prompts 4 ...

Why a script of its own: a kernel's effect on a whole W1 run is a few percent, under this VM's noise; calling
both builds on the same inputs in turn, best of many, separates them. Each library is loaded with ctypes and
driven through CpuPagedBackend exactly as the engine drives its own build. Prints the largest difference of
each output from the first build's, and each build's best time and GFLOP/s (causal attention FLOPs:
4 x head_dim per (query head, visible position)); nothing is asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import time

import torch

from folio.attention.backends import cpu_paged
from folio.attention.builder import build_attn_metadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2's attention


def backend_for(path: str) -> cpu_paged.CpuPagedBackend:
    lib = ctypes.CDLL(path)
    kernels = {}
    for dtype, suffix in cpu_paged._SUFFIXES.items():
        fns = []
        for kind in ("paged", "prefill"):
            fn = getattr(lib, f"folio_{kind}_attention_{suffix}")
            fn.argtypes = cpu_paged._ARGTYPES[kind]
            fn.restype = ctypes.c_int
            fns.append(fn)
        kernels[dtype] = cpu_paged.PagedKernels(decode=fns[0], prefill=fns[1])
    return cpu_paged.CpuPagedBackend(kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="+", help="kernel builds (.so) to compare; the first is the reference")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[20, 200], metavar=("MIN", "MAX"))
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    ns = parser.parse_args()
    dtype = getattr(torch, ns.dtype)
    rng = random.Random(0)
    seq_lens = [rng.randint(*ns.prompt_len) for _ in range(ns.num_prompts)]
    tables, next_block = [], 0
    for seq_len in seq_lens:
        n = -(-seq_len // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    # head-major storage, as the worker allocates it
    cache = torch.zeros(2, next_block + 1, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM).to(dtype).transpose(2, 3)
    attn = build_attn_metadata(seq_lens, seq_lens, tables, BLOCK_SIZE)
    num_tokens = sum(seq_lens)
    qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM).to(dtype)
    q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=1)
    q, k, v = (
        q.view(num_tokens, NUM_HEADS, -1),
        k.view(num_tokens, NUM_KV_HEADS, -1),
        v.view(num_tokens, NUM_KV_HEADS, -1),
    )
    flops = sum(s * (s + 1) / 2 for s in seq_lens) * NUM_HEADS * HEAD_DIM * 4
    backends = [backend_for(path) for path in ns.libraries]
    outputs = [b.forward(q, k, v, cache, attn, HEAD_DIM**-0.5).float() for b in backends]
    for path, out in zip(ns.libraries[1:], outputs[1:], strict=True):
        print(f"{path}: largest |difference| from {ns.libraries[0]}: {(out - outputs[0]).abs().max().item():.3g}")
    best = [float("inf")] * len(backends)
    for _ in range(ns.repeats):
        for i, backend in enumerate(backends):
            start = time.perf_counter()
            backend.forward(q, k, v, cache, attn, HEAD_DIM**-0.5)
            best[i] = min(best[i], time.perf_counter() - start)
    print(
        f"prefill attention, {ns.num_prompts} prompts ({num_tokens} tokens), {ns.dtype}, one layer, "
        f"best of {ns.repeats}:"
    )
    for path, seconds in zip(ns.libraries, best, strict=True):
        print(
            f"  {path}: {seconds * 1e3:.3f} ms, {flops / seconds / 1e9:.0f} GFLOP/s, {best[0] / seconds:.2f}x the first"
        )


if __name__ == "__main__":
    main()

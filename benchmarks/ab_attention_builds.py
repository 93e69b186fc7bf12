"""A/B of two or more builds of the CPU kernels on the attention, alternating calls in one process.

    git archive HEAD~1 folio/kernels | tar -x -C /tmp/old        # the tree to compare against
    gcc -O3 -march=native -ffast-math -fopenmp -fPIC -shared -std=c11 /tmp/old/folio/kernels/cpu_kernels.c \\
        -o /tmp/old.so -lm                                        # (the flags of folio/kernels/cpu_build.py)
    .venv/bin/python benchmarks/ab_attention_builds.py /tmp/old.so /tmp/new.so
    .venv/bin/python benchmarks/ab_attention_builds.py --dtype float32 --prompt-len 500 1000 --num-prompts 4 ...
    .venv/bin/python benchmarks/ab_attention_builds.py --decode /tmp/old.so /tmp/new.so

Prefill (default): fresh prompts through one layer. --decode: a decode step of 64 rows at contexts 110-290 (or
--decode-rows at --decode-ctx, the first --decode-shared-blocks blocks the same for every row) through 30
layers, the K/V (about 260 MB in bf16 for the default step) in three places: DRAM (30 layer caches, as a real
step streams them), L3 (one layer's cache read 30 times) and L2 (every row reading the same blocks): the kernel's
compute shows in the last, its memory behaviour in the first.

Why a script of its own: a kernel's effect on a whole W1 run is a few percent, under this VM's noise; calling
both builds on the same inputs in turn, best of many, separates them. Each library is loaded with ctypes and
driven through CpuPagedBackend exactly as the engine drives its own build. Prints the largest difference of
each output from the first build's, and each build's best time and GFLOP/s (causal attention FLOPs:
4 x head_dim per (query head, visible position)); nothing is asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import random
import time

import torch
from attention_kernels import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, contiguous_tables, fused_qkv

from folio.attention.backends import cpu_paged
from folio.attention.builder import build_attn_metadata
from folio.kernels.hugepages import empty_hugepage_backed


def backend_for(path: str) -> cpu_paged.CpuPagedBackend:
    return cpu_paged.CpuPagedBackend(cpu_paged.paged_kernels_of(ctypes.CDLL(path)))


def head_major_cache(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """Random K/V in head-major storage on huge pages, as the worker allocates it (on 4 KiB pages a DRAM-bound
    decode ran at about half the speed: a TLB miss per 4 KiB block-head)."""
    shape = (2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    cache = empty_hugepage_backed(math.prod(shape), dtype).view(shape)
    cache.copy_(torch.randn(shape))
    return cache.transpose(2, 3)


def run_decode(
    backends: list[cpu_paged.CpuPagedBackend],
    paths: list[str],
    dtype: torch.dtype,
    repeats: int,
    num_rows: int = 64,
    ctx: tuple[int, int] = (110, 290),
    shared_blocks: int = 0,
    scattered: bool = False,
) -> None:
    """``shared_blocks``: the first blocks of every row's table are the same ones (a shared system prompt);
    ``scattered``: the rows' own blocks in a random order over the cache, as a pool that has evicted and reused
    blocks for a while hands them out (no hardware prefetcher follows a table from block to block)."""
    rng = random.Random(0)
    seq_lens = [rng.randint(*ctx) for _ in range(num_rows)]
    if min(seq_lens) <= shared_blocks * BLOCK_SIZE:
        raise SystemExit("--decode-shared-blocks must leave every row a block of its own")
    own = contiguous_tables([s - shared_blocks * BLOCK_SIZE for s in seq_lens])
    num_blocks = shared_blocks + sum(len(t) for t in own)
    placement = list(range(shared_blocks, num_blocks))
    if scattered:
        rng.shuffle(placement)
    tables = [list(range(shared_blocks)) + [placement[b] for b in table] for table in own]
    longest = [list(range(-(-max(seq_lens) // BLOCK_SIZE)))]
    attn = build_attn_metadata([1] * num_rows, seq_lens, tables, BLOCK_SIZE)
    attn_shared = build_attn_metadata([1] * num_rows, seq_lens, longest * num_rows, BLOCK_SIZE)
    q, k, v = fused_qkv(num_rows, dtype)
    caches = [head_major_cache(num_blocks + 1, dtype) for _ in range(NUM_LAYERS)]
    places = {
        "DRAM": (caches, attn),
        "L3": (caches[:1] * NUM_LAYERS, attn),
        "L2": (caches[:1] * NUM_LAYERS, attn_shared),
    }
    outputs = [b.forward(q, k, v, caches[0], attn, HEAD_DIM**-0.5).float() for b in backends]
    for path, out in zip(paths[1:], outputs[1:], strict=True):
        print(f"{path}: largest |difference| from {paths[0]}: {(out - outputs[0]).abs().max().item():.3g}")
    best = {(i, place): float("inf") for i in range(len(backends)) for place in places}
    for _ in range(repeats):
        for i, backend in enumerate(backends):
            for place, (layer_caches, step_attn) in places.items():
                start = time.perf_counter()
                for cache in layer_caches:
                    backend.forward(q, k, v, cache, step_attn, HEAD_DIM**-0.5)
                best[(i, place)] = min(best[(i, place)], time.perf_counter() - start)
    print(
        f"decode attention, {num_rows} rows (contexts {ctx[0]}-{ctx[1]}, {shared_blocks} blocks shared, "
        f"{'scattered' if scattered else 'contiguous'} blocks) x "
        f"{NUM_LAYERS} layers, {dtype}, ms per step, best of {repeats}:"
    )
    for i, path in enumerate(paths):
        cells = "  ".join(f"K/V in {place}: {best[(i, place)] * 1e3:.2f}" for place in places)
        print(f"  {path}: {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="+", help="kernel builds (.so) to compare; the first is the reference")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[20, 200], metavar=("MIN", "MAX"))
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--decode", action="store_true", help="a decode step instead of prefills")
    parser.add_argument("--decode-rows", type=int, default=64, help="--decode: the step's rows (default 64)")
    parser.add_argument("--decode-ctx", type=int, nargs=2, default=[110, 290], metavar=("MIN", "MAX"))
    parser.add_argument(
        "--decode-shared-blocks", type=int, default=0, help="--decode: leading blocks every row shares (default 0)"
    )
    parser.add_argument(
        "--decode-scattered", action="store_true", help="--decode: the rows' blocks in a random order over the cache"
    )
    ns = parser.parse_args()
    dtype = getattr(torch, ns.dtype)
    backends = [backend_for(path) for path in ns.libraries]
    if ns.decode:
        ctx = (ns.decode_ctx[0], ns.decode_ctx[1])
        run_decode(
            backends, ns.libraries, dtype, ns.repeats, ns.decode_rows, ctx, ns.decode_shared_blocks, ns.decode_scattered
        )
        return
    rng = random.Random(0)
    seq_lens = [rng.randint(*ns.prompt_len) for _ in range(ns.num_prompts)]
    tables = contiguous_tables(seq_lens)
    num_blocks = sum(len(t) for t in tables)
    cache = head_major_cache(num_blocks + 1, dtype).zero_()
    attn = build_attn_metadata(seq_lens, seq_lens, tables, BLOCK_SIZE)
    num_tokens = sum(seq_lens)
    q, k, v = fused_qkv(num_tokens, dtype)
    flops = sum(s * (s + 1) / 2 for s in seq_lens) * NUM_HEADS * HEAD_DIM * 4
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

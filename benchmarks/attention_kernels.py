"""Micro-benchmark of the CPU attention kernels at W1's shapes (SmolLM2: 9 query / 3 KV heads of 64).

    .venv/bin/python benchmarks/attention_kernels.py                    # bfloat16
    .venv/bin/python benchmarks/attention_kernels.py --dtype float32

Decode: 64 rows at contexts 110-290 over 30 layers' caches (about 260 MB in bf16, so K/V come from DRAM as in a
real step), the kernel on a position-major cache ([NB, BS, KV, D]) and on the head-major one the engine allocates,
with each request's blocks consecutive, and scattered over the cache (as a long-running server's free list
hands them out).
Prefill: 16 fresh prompts of 20-200 tokens through one layer, the C prefill kernel against torch's SDPA (what
CpuPagedBackend used before). Prints each figure and the ratio; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from folio.attention.backends.cpu_paged import CpuPagedBackend, load_paged_attention_kernel
from folio.attention.backends.torch_batched import prefill_attention
from folio.attention.builder import build_attn_metadata
from folio.attention.metadata import AttnMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30


def best_of(fn: Callable[[], None], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def contiguous_tables(seq_lens: list[int]) -> list[list[int]]:
    tables, next_block = [], 0
    for seq_len in seq_lens:
        n = -(-seq_len // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return tables


def fused_qkv(num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one q|k|v buffer, as the model hands them to the backend."""
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=1)
    return (
        q.view(num_tokens, NUM_HEADS, HEAD_DIM),
        k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        v.view(num_tokens, NUM_KV_HEADS, HEAD_DIM),
    )


def bench_decode(backend: CpuPagedBackend, dtype: torch.dtype, repeats: int) -> None:
    rng = random.Random(0)
    seq_lens = [rng.randint(110, 290) for _ in range(64)]
    tables = contiguous_tables(seq_lens)
    num_blocks = sum(len(t) for t in tables) + 1
    shuffled = list(range(num_blocks))
    rng.shuffle(shuffled)  # a long-running server's free list hands out blocks in no order
    scattered = build_attn_metadata([1] * 64, seq_lens, [[shuffled[b] for b in t] for t in tables], BLOCK_SIZE)
    attn = build_attn_metadata([1] * 64, seq_lens, tables, BLOCK_SIZE)
    q, k, v = fused_qkv(64, dtype)
    times = {}
    for layout in ("position-major", "head-major", "head-major (blocks scattered)"):
        step_attn = scattered if "scattered" in layout else attn
        if layout == "position-major":
            shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
            caches = [torch.randn(shape).to(dtype) for _ in range(NUM_LAYERS)]
        else:
            shape = (2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
            caches = [torch.randn(shape).to(dtype).transpose(2, 3) for _ in range(NUM_LAYERS)]

        def step(caches: list[torch.Tensor] = caches, step_attn: AttnMetadata = step_attn) -> None:
            for cache in caches:
                backend.forward(q, k, v, cache, step_attn, HEAD_DIM**-0.5)

        times[layout] = best_of(step, repeats)
        kv_bytes = sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * 2 * caches[0].element_size() * NUM_LAYERS
        print(
            f"decode, 64 rows x {NUM_LAYERS} layers, {layout} cache: {times[layout] * 1e3:.1f} ms per step "
            f"({kv_bytes / times[layout] / 1e9:.1f} GB/s of K/V)"
        )
    print(f"  head-major / position-major: {times['head-major'] / times['position-major']:.2f}x the time")


def bench_prefill(backend: CpuPagedBackend, dtype: torch.dtype, repeats: int) -> None:
    rng = random.Random(0)
    seq_lens = [rng.randint(20, 200) for _ in range(16)]
    tables = contiguous_tables(seq_lens)
    cache = torch.zeros(2, sum(len(t) for t in tables) + 1, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    attn = build_attn_metadata(seq_lens, seq_lens, tables, BLOCK_SIZE)
    num_tokens = sum(seq_lens)
    q, k, v = fused_qkv(num_tokens, dtype)
    scale = HEAD_DIM**-0.5

    def kernel() -> None:
        backend.forward(q, k, v, cache, attn, scale)

    def sdpa() -> None:
        out = torch.empty(num_tokens, NUM_HEADS, HEAD_DIM, dtype=dtype)
        start = 0
        for seq_len in seq_lens:
            end = start + seq_len
            out[start:end] = prefill_attention(q[start:end], k[start:end], v[start:end], scale)
            start = end

    kernel_s, sdpa_s = best_of(kernel, repeats), best_of(sdpa, repeats)
    print(
        f"prefill, 16 prompts ({num_tokens} tokens), one layer: "
        f"C kernel {kernel_s * 1e3:.2f} ms, SDPA {sdpa_s * 1e3:.2f} ms"
    )
    print(f"  kernel / SDPA: {kernel_s / sdpa_s:.2f}x the time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    kernels = load_paged_attention_kernel()
    if kernels is None:
        raise SystemExit("no C compiler: the CPU kernels are not built")
    backend = CpuPagedBackend(kernels)
    dtype = getattr(torch, ns.dtype)
    bench_decode(backend, dtype, ns.repeats)
    bench_prefill(backend, dtype, ns.repeats)


if __name__ == "__main__":
    main()

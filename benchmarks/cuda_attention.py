"""Attention alone on a CUDA GPU: the Triton paged kernel against TorchBatchedBackend, SmolLM2's heads (9/3 x 64).

    python benchmarks/cuda_attention.py

Two W1-shaped batches: 64 decodes at contexts of 150-330 positions, and 64 fresh prefills of 20-200 tokens;
random block tables (block_size 16). Times one layer's forward (K/V write included) with CUDA events through
triton.testing.do_bench (median), and checks both against TorchReferenceBackend first.
"""

from __future__ import annotations

import random

import torch
import triton.testing

from folio.attention.backends.torch_batched import TorchBatchedBackend
from folio.attention.backends.torch_ref import TorchReferenceBackend
from folio.attention.backends.triton_paged import TritonPagedBackend
from folio.attention.builder import build_attn_metadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def batch(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype) -> tuple:
    rng = random.Random(0)
    num_blocks = sum(-(-s // BLOCK_SIZE) for s in seq_lens) + 8
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for s in seq_lens:
        n = -(-s // BLOCK_SIZE)
        tables.append(pool[:n])
        pool = pool[n:]
    num_tokens = sum(query_lens)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    return q, k, v, cache, build_attn_metadata(query_lens, seq_lens, tables, BLOCK_SIZE, "cuda")


def main() -> None:
    rng = random.Random(1)
    dtype = torch.bfloat16
    prompt_lens = [rng.randint(20, 200) for _ in range(64)]
    cases = {
        "64 decodes, ctx 150-330": ([1] * 64, [rng.randint(150, 330) for _ in range(64)]),
        "64 prefills, 20-200 tokens": (prompt_lens, prompt_lens),
    }
    scale = HEAD_DIM**-0.5
    print("| batch | triton_paged us | torch_batched us | ratio |\n| --- | --- | --- | --- |")
    for name, (query_lens, seq_lens) in cases.items():
        q, k, v, cache, attn = batch(query_lens, seq_lens, dtype)
        expected = TorchReferenceBackend().forward(q.float(), k.float(), v.float(), cache.float(), attn, scale)
        times = {}
        for backend in (TritonPagedBackend(), TorchBatchedBackend()):
            out = backend.forward(q, k, v, cache.clone(), attn, scale)
            err = (out.float() - expected).abs().max().item()
            assert err < 2e-2, f"{type(backend).__name__}: max error {err}"
            args = (q, k, v, cache, attn, scale)
            times[type(backend).__name__] = 1e3 * triton.testing.do_bench(
                lambda b=backend, a=args: b.forward(*a), return_mode="median"
            )
        fast, slow = times["TritonPagedBackend"], times["TorchBatchedBackend"]
        print(f"| {name} | {fast:.1f} | {slow:.1f} | {slow / fast:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

"""TorchBatchedBackend against the reference backend (the oracle) on random paged batches."""

from __future__ import annotations

import random

import pytest
import torch

from folio.attention.backends.torch_batched import TorchBatchedBackend
from folio.attention.backends.torch_ref import TorchReferenceBackend
from folio.attention.builder import build_attn_metadata


def _compare(query_lens: list[int], seq_lens: list[int], block_size: int, seed: int, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    head_dim = 16
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)  # non-contiguous block tables
    tables = []
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(pool[:n])
        pool = pool[n:]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)  # cached context
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    attn = build_attn_metadata(query_lens, seq_lens, tables, block_size)
    scale = head_dim**-0.5
    ref_cache, fast_cache = kv_cache.clone(), kv_cache.clone()
    expected = TorchReferenceBackend().forward(query, key, value, ref_cache, attn, scale)
    backend = TorchBatchedBackend()
    for _ in range(2):  # the second call reuses the step plan, as the model's next layer does
        out = backend.forward(query, key, value, fast_cache, attn, scale)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_cache, ref_cache, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4), (9, 3)])
def test_mixed_prefill_and_decode(block_size: int, heads: tuple[int, int]) -> None:
    # fresh prefill, a chunk over a cached prefix, decodes of different lengths, a 3-token query, an empty one
    _compare([7, 5, 1, 1, 3, 0, 1], [7, 23, 1, 40, 18, 9, 17], block_size, seed=block_size, heads=heads)


@pytest.mark.parametrize("seed", range(12))
def test_random_batches(seed: int) -> None:
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, 70) for _ in range(rng.randint(1, 10))]
    query_lens = [rng.choice([1, 1, s, rng.randint(0, s)]) for s in seq_lens]
    _compare(query_lens, seq_lens, rng.choice([1, 2, 8, 16]), seed, heads=rng.choice([(6, 2), (9, 3), (8, 1)]))


def test_decode_only_batch() -> None:
    _compare([1] * 16, [random.Random(i).randint(1, 100) for i in range(16)], 16, seed=5, heads=(9, 3))

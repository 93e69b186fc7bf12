"""TorchReferenceBackend against dense causal attention on contiguous K/V, one request at a time."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from folio.attention.backends.torch_ref import TorchReferenceBackend
from folio.attention.builder import build_attn_metadata, compute_positions

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16


def _dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D] at the last Q positions of k/v [S, KV, D] -> [Q, H, D] via SDPA with an explicit causal mask."""
    query_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    allowed = torch.arange(seq_len)[None, :] <= query_pos  # [Q, S]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


def _run_batch(query_lens: list[int], seq_lens: list[int], block_size: int, seed: int) -> None:
    """Random K/V for every position of every request; positions before the queries are pre-written to
    the cache (a cached prefix), the queries' own K/V are written by the backend. Block tables are random
    non-contiguous subsets of the pool."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 5
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    block_tables = []
    for seq_len in seq_lens:
        n = -(-seq_len // block_size)
        block_tables.append(pool[:n])
        pool = pool[n:]
    kv_cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=gen)  # garbage elsewhere
    flat_k = kv_cache[0].view(-1, NUM_KV_HEADS, HEAD_DIM)
    flat_v = kv_cache[1].view(-1, NUM_KV_HEADS, HEAD_DIM)
    all_k = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=gen) for s in seq_lens]
    all_v = [torch.randn(s, NUM_KV_HEADS, HEAD_DIM, generator=gen) for s in seq_lens]
    queries = [torch.randn(q, NUM_HEADS, HEAD_DIM, generator=gen) for q in query_lens]
    for table, seq_len, query_len, k, v in zip(block_tables, seq_lens, query_lens, all_k, all_v, strict=True):
        for pos in range(seq_len - query_len):  # the cached prefix
            slot = table[pos // block_size] * block_size + pos % block_size
            flat_k[slot], flat_v[slot] = k[pos], v[pos]

    attn = build_attn_metadata(query_lens, seq_lens, block_tables, block_size)
    new_k = torch.cat([k[s - q :] for k, s, q in zip(all_k, seq_lens, query_lens, strict=True)])
    new_v = torch.cat([v[s - q :] for v, s, q in zip(all_v, seq_lens, query_lens, strict=True)])
    scale = HEAD_DIM**-0.5
    out = TorchReferenceBackend().forward(torch.cat(queries), new_k, new_v, kv_cache, attn, scale)

    assert out.shape == (sum(query_lens), NUM_HEADS, HEAD_DIM)
    expected = torch.cat([_dense_reference(q, k, v, scale) for q, k, v in zip(queries, all_k, all_v, strict=True)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # The step's K/V landed at their slots.
    torch.testing.assert_close(flat_k[attn.slot_mapping], new_k, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[attn.slot_mapping], new_v, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_prefill_chunks_and_decodes(block_size: int) -> None:
    # prefill from scratch, prefill chunk over a cached prefix, two decodes, a 3-token speculative decode
    _run_batch(query_lens=[7, 5, 1, 1, 3], seq_lens=[7, 23, 1, 40, 18], block_size=block_size, seed=block_size)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed: int) -> None:
    rng = random.Random(100 + seed)
    seq_lens = [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]
    query_lens = [rng.choice([1, s, rng.randint(1, s)]) for s in seq_lens]
    _run_batch(query_lens, seq_lens, block_size=rng.choice([2, 8, 16]), seed=seed)


def test_single_decode_attends_to_whole_context() -> None:
    _run_batch(query_lens=[1], seq_lens=[33], block_size=8, seed=7)


def test_request_with_no_query_tokens_is_skipped() -> None:
    _run_batch(query_lens=[4, 0, 2], seq_lens=[4, 9, 6], block_size=4, seed=3)


def test_builder_worked_example() -> None:
    """The example in folio/attention/builder.py's docstring, exactly."""
    attn = build_attn_metadata([3, 1], [3, 9], [[0], [1, 2, 3]], block_size=4)
    assert attn.query_start_loc.tolist() == [0, 3, 4]
    assert attn.slot_mapping.tolist() == [0, 1, 2, 12]
    assert attn.block_table.tolist() == [[0, 0, 0], [1, 2, 3]]
    assert (attn.max_query_len, attn.max_seq_len, attn.num_reqs, attn.num_tokens) == (3, 9, 2, 4)
    assert compute_positions([3, 1], [3, 9]) == [0, 1, 2, 8]


def test_builder_rejects_short_block_table() -> None:
    with pytest.raises(ValueError, match="cannot hold seq_len 9"):
        build_attn_metadata([1], [9], [[0, 1]], block_size=4)

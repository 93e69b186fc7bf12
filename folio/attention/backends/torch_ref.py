"""TorchReferenceBackend: paged attention written as plainly as possible. The oracle for the fast backends.

Per request it gathers the whole context K/V through the block table into contiguous tensors and runs
dense causal attention with a float32 softmax. A Python loop over requests: slow for large batches, but
obviously right, and it handles every batch shape the scheduler makes (prefill from scratch, prefill
chunks on top of cached context, decodes, speculative multi-token decodes) with one rule:
query j of a request with query_len q and seq_len s sits at position s - q + j and sees positions 0..s-q+j.
"""

from __future__ import annotations

import torch

from folio.attention.backends.paged_cache import context_slots, write_kv
from folio.attention.metadata import AttnMetadata


class TorchReferenceBackend:
    kv_cache_head_major = False

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttnMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Writes key/value at attn.slot_mapping, then causal attention of each query over its context."""
        block_size = kv_cache.shape[2]
        key_cache, value_cache = write_kv(key, value, kv_cache, attn.slot_mapping)
        out = torch.empty_like(query)
        for i in range(attn.num_reqs):
            start, end = attn.query_start_loc_cpu[i], attn.query_start_loc_cpu[i + 1]
            seq_len = attn.seq_lens_cpu[i]
            if end == start:
                continue
            slots = context_slots(attn.block_table[i], seq_len, block_size)
            out[start:end] = _dense_causal_attention(query[start:end], key_cache[slots], value_cache[slots], scale)
        return out


def _dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D] (the last Q positions of the context), k/v [S, KV, D] (positions 0..S-1) -> [Q, H, D].

    GQA: query head h reads kv head h // (H // KV) (the repeat_interleave convention of Hugging Face).
    """
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # [S, H, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.float(), k) * scale  # [H, Q, S]
    query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)  # [Q]
    key_pos = torch.arange(seq_len, device=q.device)  # [S]
    scores.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqs,shd->qhd", probs, v).to(q.dtype)

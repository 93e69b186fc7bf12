"""TorchBatchedBackend: paged attention in plain torch, batched where the reference backend loops.

All single-token queries of a step (the decodes, usually most requests) attend in one padded batch: their
block tables gather K/V into [R, L] and one masked matmul pair serves them all. Multi-token queries (prefill
chunks) go one request at a time through scaled_dot_product_attention; a fresh prefill uses the new K/V
directly, with no gather. Device-agnostic; tested against TorchReferenceBackend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from folio.attention.backends.paged_cache import context_slots, write_kv
from folio.attention.metadata import AttnMetadata


@dataclass
class _StepPlan:
    """Index tensors shared by every layer of one step (built once per AttnMetadata)."""

    decode_rows: torch.Tensor  # [Rd] token rows of the single-token queries
    decode_block_table: torch.Tensor  # [Rd, num_blocks] int64
    decode_pad_mask: torch.Tensor  # [Rd, num_blocks * block_size] True where the position is past seq_len
    prefill_reqs: list[int]  # requests with more than one query token


class TorchBatchedBackend:
    kv_cache_head_major = False

    def __init__(self) -> None:
        self._plan_for: AttnMetadata | None = None
        self._plan: _StepPlan | None = None

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

        plan = self._step_plan(attn, block_size, kv_cache.device)
        out = torch.empty_like(query)
        if plan.decode_rows.numel():
            out[plan.decode_rows] = self._decode(query[plan.decode_rows], kv_cache, plan, scale)
        for i in plan.prefill_reqs:
            start, end = attn.query_start_loc_cpu[i], attn.query_start_loc_cpu[i + 1]
            seq_len = attn.seq_lens_cpu[i]
            if seq_len == end - start:  # nothing cached before this chunk: its own K/V are the whole context
                k, v = key[start:end], value[start:end]
            else:
                slots = context_slots(attn.block_table[i], seq_len, block_size)
                k, v = key_cache[slots], value_cache[slots]
            out[start:end] = prefill_attention(query[start:end], k, v, scale)
        return out

    def _step_plan(self, attn: AttnMetadata, block_size: int, device: torch.device) -> _StepPlan:
        if self._plan_for is attn and self._plan is not None:
            return self._plan
        qsl, seq_lens = attn.query_start_loc_cpu, attn.seq_lens_cpu
        decode_reqs = [i for i in range(attn.num_reqs) if qsl[i + 1] - qsl[i] == 1]
        prefill_reqs = [i for i in range(attn.num_reqs) if qsl[i + 1] - qsl[i] > 1]
        max_len = max((seq_lens[i] for i in decode_reqs), default=0)
        max_blocks = -(-max_len // block_size)
        reqs = torch.tensor(decode_reqs, dtype=torch.long, device=device)
        decode_seq_lens = torch.tensor([seq_lens[i] for i in decode_reqs], dtype=torch.long, device=device)
        self._plan = _StepPlan(
            decode_rows=torch.tensor([qsl[i] for i in decode_reqs], dtype=torch.long, device=device),
            decode_block_table=attn.block_table[reqs, :max_blocks].long(),
            # seq_lens [3, 5], block_size 4 -> L 8; mask row 0: positions 3..7 are padding
            decode_pad_mask=torch.arange(max_blocks * block_size, device=device)[None, :] >= decode_seq_lens[:, None],
            prefill_reqs=prefill_reqs,
        )
        self._plan_for = attn
        return self._plan

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan, scale: float) -> torch.Tensor:
        """q [Rd, H, D] -> [Rd, H, D]; query head h reads kv head h // group (Hugging Face's GQA order)."""
        num_reqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        # [Rd, nb] block ids -> (index_select, much faster than advanced indexing on CPU) [Rd * nb, bs, KV, D]
        # -> [Rd, L, KV, D]
        flat_ids = plan.decode_block_table.flatten()
        # -> [Rd, KV, L, D] made contiguous once: the two batched matmuls then run on plain BLAS layouts
        # (cheaper than letting einsum permute internally, measured in docs/performance.md)
        k = torch.index_select(kv_cache[0], 0, flat_ids).view(num_reqs, -1, num_kv_heads, head_dim)
        v = torch.index_select(kv_cache[1], 0, flat_ids).view(num_reqs, -1, num_kv_heads, head_dim)
        k = k.permute(0, 2, 1, 3).float().contiguous()
        v = v.permute(0, 2, 1, 3).float().contiguous()
        q4 = q.float().view(num_reqs, num_kv_heads, group, head_dim)  # [Rd, KV, G, D]
        scores = torch.matmul(q4, k.transpose(-1, -2)) * scale  # [Rd, KV, G, L]
        scores.masked_fill_(plan.decode_pad_mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v)  # [Rd, KV, G, D]
        return out.reshape(num_reqs, num_heads, head_dim).to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D] at the last Q positions of k/v [S, KV, D] -> [Q, H, D], causal.

    4-D inputs with enable_gqa (no repeat_interleave of K/V): that is what lets torch pick its fused flash kernel
    on the CPU; 3-D inputs fell back to the math path at half the speed (docs/performance.md).
    """
    query_len, seq_len = q.shape[0], k.shape[0]
    qh = q.transpose(0, 1)[None]  # [1, H, Q, D]
    kh = k.to(q.dtype).transpose(0, 1)[None]  # [1, KV, S, D]
    vh = v.to(q.dtype).transpose(0, 1)[None]
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= query_pos  # [Q, S]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)

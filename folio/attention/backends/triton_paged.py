"""TritonPagedBackend: paged attention on CUDA in one Triton kernel for the whole mixed batch.

One program serves BLOCK_Q query tokens of one request and every query head of one KV head (GQA: the group's
heads are rows of the same tile, so each K/V tile is read once for all of them). It walks the request's
context in TILE_N-position tiles through the block table, with an online softmax in float32, and stops at the
last position its queries may see (causal). Fresh prefills, prefill chunks over cached context, decodes and
multi-token decodes all take this one path: the rule is the reference's, query j of a request with query_len
q and seq_len s sits at position s - q + j.

Programs find their request by a binary search over query_start_loc (vLLM's unified-attention scheme), so the
launch needs nothing from the host but sizes the host already has: no device sync, and CUDA-graph safe.
Tested against TorchReferenceBackend; on the CPU through Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from folio.attention.backends.paged_cache import store_kv
from folio.attention.metadata import AttnMetadata


def triton_available() -> bool:
    """Whether the triton package is importable (it ships with CUDA builds of torch, not with CPU ones)."""
    return importlib.util.find_spec("triton") is not None


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class TritonPagedBackend:
    kv_cache_head_major = False
    supports_cuda_graphs = True  # reads only device tensors and sizes fixed by the batch shape (DecodeGraphs)

    # Rows of a program's tile (query tokens x the GQA group, padded to a power of two) and positions per K/V
    # tile: 16 x 64 keeps a tile in registers with head_dim up to 128; tl.dot needs every side >= 16.
    MIN_BLOCK_M = 16
    TILE_N = 64

    def __init__(self) -> None:
        from folio.kernels.triton_attention import paged_attention_kernel

        self._kernel: Any = paged_attention_kernel

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
        store_kv(key, value, kv_cache, attn.slot_mapping)
        num_tokens, num_heads, head_dim = query.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
        if num_tokens == 0:
            return out
        if query.stride(2) != 1 or kv_cache.stride(4) != 1:
            raise ValueError("query and kv_cache need a contiguous head_dim")
        group = num_heads // num_kv_heads
        # SmolLM2 (group 3): BLOCK_M 16 -> BLOCK_Q 5 query tokens per program (rows 15 of 16 used)
        block_m = max(self.MIN_BLOCK_M, _next_power_of_2(group))
        block_q = block_m // group
        # Request i's q-blocks are numbered from query_start_loc[i] // BLOCK_Q + i: an upper bound on the count.
        num_q_blocks = num_tokens // block_q + attn.num_reqs
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self._kernel[(num_q_blocks, num_kv_heads)](
            out,
            query,
            key_cache,
            value_cache,
            attn.block_table,
            attn.query_start_loc,
            attn.seq_lens,
            scale,
            attn.num_reqs,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            attn.block_table.stride(0),
            BLOCK_SIZE=block_size,
            GROUP=group,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=max(16, _next_power_of_2(head_dim)),
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            TILE_N=self.TILE_N,
            # float32 models get float32 dots (Triton's default for them is tf32, ~1e-3 off the reference)
            DOT_PRECISION="ieee" if query.dtype == torch.float32 or query.device.type == "cpu" else "tf32",
            DOT_IN_FLOAT32=query.device.type == "cpu",  # only Triton's interpreter runs on CPU tensors
        )
        return out

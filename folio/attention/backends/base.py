"""The attention backend interface: write this step's K/V into the paged cache, then attend through it."""

from __future__ import annotations

from typing import Protocol

import torch

from folio.attention.metadata import AttnMetadata


class AttentionBackend(Protocol):
    # The cache is always indexed as [2, num_blocks, block_size, num_kv_heads, head_dim]; a backend that reads
    # whole KV-head runs faster asks for storage laid out [2, num_blocks, num_kv_heads, block_size, head_dim]
    # and gets that logical shape as a transposed view (folio.worker.kv_cache_shape.KVCacheShape.allocate).
    kv_cache_head_major: bool

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
        ...

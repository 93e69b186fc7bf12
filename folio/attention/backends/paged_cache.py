"""Paged KV-cache access shared by the backends: writing a step's K/V, and a request's context slots."""

from __future__ import annotations

import torch


def write_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stores the step's K/V at their slots; returns the caches viewed as [num_slots, num_kv_heads, head_dim].

    A head-major cache (a transposed view, see AttentionBackend.kv_cache_head_major) is written through
    (block, offset) indices, and what is returned is then a copy: fine to read, not to write.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    slots_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    if not kv_cache.is_contiguous():
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        kv_cache[0][blocks, offsets] = key.to(kv_cache.dtype)
        kv_cache[1][blocks, offsets] = value.to(kv_cache.dtype)
        return kv_cache[0].reshape(slots_shape), kv_cache[1].reshape(slots_shape)
    key_cache = kv_cache[0].view(slots_shape)
    value_cache = kv_cache[1].view(slots_shape)
    key_cache[slot_mapping] = key.to(key_cache.dtype)
    value_cache[slot_mapping] = value.to(value_cache.dtype)
    return key_cache, value_cache


def context_slots(block_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Slots of positions 0..seq_len-1: block_row [3, 7, ...], block_size 4, seq_len 6 -> [12, 13, 14, 15, 28, 29]."""
    num_seq_blocks = -(-seq_len // block_size)
    blocks = block_row[:num_seq_blocks].long()
    offsets = torch.arange(block_size, device=block_row.device)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:seq_len]

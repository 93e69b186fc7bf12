"""Paged KV-cache access shared by the backends: writing a step's K/V, and a request's context slots."""

from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Stores the step's K/V at their slots, through (block, offset) indices: a head-major cache (a transposed
    view, see AttentionBackend.kv_cache_head_major) is written in place, and nothing cache-sized is made."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    if kv_cache.is_contiguous():  # one index op per cache (CUDA graphs replay fewer kernels)
        slots_shape = (num_blocks * block_size, num_kv_heads, head_dim)
        kv_cache[0].view(slots_shape)[slot_mapping] = key.to(kv_cache.dtype)
        kv_cache[1].view(slots_shape)[slot_mapping] = value.to(kv_cache.dtype)
        return
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[0][blocks, offsets] = key.to(kv_cache.dtype)
    kv_cache[1][blocks, offsets] = value.to(kv_cache.dtype)


def write_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """``store_kv``, then the caches viewed as [num_slots, num_kv_heads, head_dim] for a backend that reads them.

    Of a head-major cache that view is a copy of the whole cache: fine to read, not to write; a backend that
    only writes calls store_kv.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    slots_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    store_kv(key, value, kv_cache, slot_mapping)
    return kv_cache[0].reshape(slots_shape), kv_cache[1].reshape(slots_shape)


def context_slots(block_row: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Slots of positions 0..seq_len-1: block_row [3, 7, ...], block_size 4, seq_len 6 -> [12, 13, 14, 15, 28, 29]."""
    num_seq_blocks = -(-seq_len // block_size)
    blocks = block_row[:num_seq_blocks].long()
    offsets = torch.arange(block_size, device=block_row.device)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:seq_len]

"""Rotary position embedding, Hugging Face "half-split" layout, with positions given per token.

Dimension i of the first half rotates with dimension i + head_dim/2 (not adjacent pairs as in llama.cpp;
the GGUF loader un-permutes q/k weights to this layout). Positions come explicitly per token, because a
flattened batch mixes requests at unrelated positions:
    positions [0, 1, 2, 8] -> angle[t, i] = positions[t] * inv_freq[i].
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from folio.kernels.cpu_kernels import CpuKernels
from folio.kernels.cpu_ops import heads_packed


def compute_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """inv_freq [head_dim / 2] float32 on the CPU: base^(-2i/head_dim), then Llama-3 scaling if configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_scaling is None:
        return inv_freq
    return _scale_llama3(inv_freq, rope_scaling)


def _scale_llama3(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths / factor, short ones kept, a smooth blend in between (as HF)."""
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for the step's positions once; every layer applies them to its q and k."""

    def __init__(self, head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> None:
        super().__init__()
        # A plain attribute, not a buffer: it is derived from the spec, never loaded, and survives the
        # loader's meta-device construction (it is built on the CPU explicitly).
        self.inv_freq = compute_inv_freq(head_dim, base, rope_scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, head_dim] in dtype (angles computed in float32)."""
        if self.inv_freq.device != positions.device:  # moved once: a copy per step would break CUDA-graph capture
            self.inv_freq = self.inv_freq.to(positions.device)
        inv_freq = self.inv_freq
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, num_heads, head_dim] -> x * cos + rotate_half(x) * sin, cos/sin [T, head_dim] broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rotary_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cpu_kernels: CpuKernels | None = None
) -> torch.Tensor:
    """apply_rotary written back into x (which may be a view of a fused q|k|v output); returns x.

    On the CPU, with x's heads packed in each row and the plan's fused ops given, this is one C call
    (folio/kernels/cpu_ops.c) with the same roundings as the torch ops.
    """
    fusable = cpu_kernels is not None and heads_packed(x) and cos.is_contiguous() and sin.is_contiguous()
    if fusable and cpu_kernels is not None and (ops := cpu_kernels.ops_for(x, cos, sin)) is not None:
        return ops.rotary_(x, cos, sin)
    return x.copy_(apply_rotary(x, cos, sin))

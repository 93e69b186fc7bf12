"""RMSNorm, computed in float32 whatever the activation dtype (as Hugging Face does, so logits match)."""

from __future__ import annotations

import torch
from torch import nn

from folio.kernels.cpu_kernels import CpuKernels


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), the mean over the last dim.

    ``add_and_norm`` fuses the residual add in (vLLM's fused_add_rms_norm), which is how a decoder layer carries
    its residual stream. On the CPU both run as one C call
    (folio/kernels/cpu_ops.c) where the engine's CPU plan chose it (``cpu_kernels``, set by
    folio/model/cpu_binding.py); elsewhere as torch ops with the same roundings.
    """

    cpu_kernels: CpuKernels | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if (
            x.dim() == 2
            and self.cpu_kernels is not None
            and (ops := self.cpu_kernels.ops_for(x, self.weight)) is not None
        ):
            return ops.rms_norm(x, self.weight, self.eps, None)[0]
        return self._norm(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), both [T, hidden]."""
        if (
            x.dim() == 2
            and self.cpu_kernels is not None
            and (ops := self.cpu_kernels.ops_for(x, residual, self.weight)) is not None
        ):
            out, summed = ops.rms_norm(x, self.weight, self.eps, residual)
            assert summed is not None
            return out, summed
        summed = x + residual
        return self._norm(summed), summed

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)

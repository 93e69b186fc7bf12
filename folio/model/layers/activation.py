"""SiLU-and-multiply: the gated activation of Llama-style MLPs, applied to a fused gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from folio.kernels.cpu_kernels import CpuKernels


def silu_and_mul(gate_up: torch.Tensor, cpu_kernels: CpuKernels | None = None) -> torch.Tensor:
    """gate_up [T, 2 * I] (gate in the first half, up in the second) -> silu(gate) * up [T, I].

    One C call on the CPU where the plan chose Folio's ops (folio/kernels/cpu_ops.c), two torch ops elsewhere.
    """
    if gate_up.dim() == 2 and cpu_kernels is not None and (ops := cpu_kernels.ops_for(gate_up)) is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

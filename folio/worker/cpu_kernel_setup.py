"""The CPU kernels one engine runs: the process's library and plan for its --cpu-isa tier and dtype, with this
engine's own CPU settings applied, and the start-up line that names them (issue 16: the tier and each operation's
implementation)."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from folio.kernels.cpu_config import CpuConfig
from folio.kernels.cpu_kernels import CPU_KERNEL_DTYPES, CpuKernels, load_cpu_kernels
from folio.kernels.cpu_plan import check_cpu_dtype

logger = logging.getLogger("folio")


def engine_cpu_kernels(
    cpu_config: CpuConfig, device: torch.device, dtype: torch.dtype, enforce_eager: bool, pipelined: bool
) -> CpuKernels | None:
    """On the CPU, the kernels of the --cpu-isa tier for the model's dtype (None elsewhere); logs the tier and the
    plan. ``pipelined``: a pipeline stage, which runs its layers one by one (no fused decoder)."""
    if device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES:
        return None
    # the library and plan are the process's (cached); where this engine's memory goes is its own
    kernels = load_cpu_kernels(cpu_config.tier(), dtype, cpu_config.extensions())
    kernels = replace(
        kernels,
        plan=kernels.plan.with_kv_prefetch_bytes(cpu_config.kv_prefetch_bytes),
        huge_pages=cpu_config.huge_pages,
        compact_weights=cpu_config.compact_weights,
        amx_float32=cpu_config.amx_float32,
        vnni_float32=cpu_config.vnni_float32,
    )
    check_cpu_dtype(kernels.plan.dtype_name, kernels.tier)
    eager = " (fused decoder off: enforce_eager)" if enforce_eager else ""
    eager = " (fused decoder off: layer by layer across pipeline stages)" if pipelined else eager
    logger.info("%s%s", kernels.describe(), eager)
    return kernels

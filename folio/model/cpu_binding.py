"""The CPU pass over a loaded model: each layer gets the kernels the engine's CPU plan chose for it.

A pass over the layers, not code in the model: the model declares where it can use a fused kernel (a
``cpu_kernels`` attribute, None by default, meaning its torch ops); this pass fills those in, packs the linear
layers for the plan's GEMM, and turns on the fused decoder where the plan has it.
"""

from __future__ import annotations

from torch import nn

from folio.kernels.cpu_kernels import CpuKernels
from folio.logger import init_logger
from folio.model.layers.cpu_gemm import can_pack, codes_summary
from folio.model.llama import LlamaForCausalLM

logger = init_logger()


def bind_cpu_kernels(model: nn.Module, kernels: CpuKernels) -> int:
    """Sets ``cpu_kernels`` on every module whose class declares it; returns how many modules took it."""
    bound = 0
    for module in model.modules():
        if hasattr(type(module), "cpu_kernels"):
            module.cpu_kernels = kernels
            bound += 1
    return bound


def prepare_for_cpu(
    model: LlamaForCausalLM, kernels: CpuKernels, enforce_eager: bool, kv_prefetch_bytes: int | None = None
) -> None:
    """Binds the fused ops, packs the weights for the plan's GEMM (Folio's or oneDNN's) and, unless
    enforce_eager, runs the decoder layers fused where the plan allows it. Call once, after loading weights."""
    bind_cpu_kernels(model, kernels)
    if can_pack(kernels):
        model.pack_for_cpu(kernels)
        if (summary := codes_summary(model)) is not None:
            logger.info("%s", summary)
        if not enforce_eager:
            model.model.enable_fused_cpu(kernels, kv_prefetch_bytes)

"""Chooses the attention backend for a device and dtype."""

from __future__ import annotations

import torch

from folio.attention.backends.base import AttentionBackend
from folio.attention.backends.cpu_paged import SUPPORTED_KV_DTYPES, CpuPagedBackend, paged_kernels_of
from folio.attention.backends.torch_batched import TorchBatchedBackend
from folio.attention.backends.triton_paged import TritonPagedBackend, triton_available
from folio.kernels.cpu_kernels import CpuKernels, load_cpu_kernels


def get_attention_backend(
    device: torch.device, dtype: torch.dtype, cpu_kernels: CpuKernels | None = None
) -> AttentionBackend:
    """The backend that runs attention on ``device`` in ``dtype``.

    float32 or bfloat16 on the CPU: CpuPagedBackend (a C kernel reading blocks in place) where the CPU plan of
    ``cpu_kernels`` (default: this CPU's best tier) chose Folio's attention.
    CUDA with triton installed: TritonPagedBackend, one kernel for the mixed batch.
    Everything else (other devices and dtypes, no compiler, no triton): TorchBatchedBackend, plain device-agnostic
    torch. All are tested against the TorchReferenceBackend oracle.
    """
    device_type = torch.device(device).type
    if device_type == "cpu" and dtype in SUPPORTED_KV_DTYPES:
        kernels = cpu_kernels or load_cpu_kernels(None, dtype)
        plan = kernels.plan
        if kernels.lib is not None and plan.decode_attention == plan.prefill_attention == "folio":
            return CpuPagedBackend(paged_kernels_of(kernels.lib), kernels)
    if device_type == "cuda" and triton_available():
        return TritonPagedBackend()
    return TorchBatchedBackend()

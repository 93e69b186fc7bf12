"""Chooses the attention backend for a device and dtype."""

from __future__ import annotations

import torch

from folio.attention.backends.base import AttentionBackend
from folio.attention.backends.cpu_paged import SUPPORTED_KV_DTYPES, CpuPagedBackend, load_paged_attention_kernel
from folio.attention.backends.torch_batched import TorchBatchedBackend
from folio.attention.backends.triton_paged import TritonPagedBackend, triton_available


def get_attention_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend that runs attention on ``device`` in ``dtype``.

    float32 or bfloat16 on the CPU: CpuPagedBackend (a C kernel reading blocks in place) when a C compiler can
    build it.
    CUDA with triton installed: TritonPagedBackend, one kernel for the mixed batch.
    Everything else (other devices and dtypes, no compiler, no triton): TorchBatchedBackend, plain device-agnostic
    torch. All are tested against the TorchReferenceBackend oracle.
    """
    device_type = torch.device(device).type
    if device_type == "cpu" and dtype in SUPPORTED_KV_DTYPES:
        kernel = load_paged_attention_kernel()
        if kernel is not None:
            return CpuPagedBackend(kernel)
    if device_type == "cuda" and triton_available():
        return TritonPagedBackend()
    return TorchBatchedBackend()

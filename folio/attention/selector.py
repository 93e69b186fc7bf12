"""Chooses the attention backend for a device and dtype."""

from __future__ import annotations

import torch

from folio.attention.backends.base import AttentionBackend
from folio.attention.backends.cpu_paged import SUPPORTED_KV_DTYPES, CpuPagedBackend, load_paged_attention_kernel
from folio.attention.backends.torch_batched import TorchBatchedBackend


def get_attention_backend(device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend that runs attention on ``device`` in ``dtype``.

    float32 or bfloat16 on the CPU: CpuPagedBackend (a C kernel reading blocks in place) when a C compiler can
    build it.
    Everything else (CUDA, other dtypes, no compiler): TorchBatchedBackend, plain device-agnostic torch. Both are
    tested against the TorchReferenceBackend oracle.
    """
    if torch.device(device).type == "cpu" and dtype in SUPPORTED_KV_DTYPES:
        kernel = load_paged_attention_kernel()
        if kernel is not None:
            return CpuPagedBackend(kernel)
    return TorchBatchedBackend()

"""Chooses the attention backend for a device."""

from __future__ import annotations

import torch

from folio.attention.backends.base import AttentionBackend
from folio.attention.backends.torch_batched import TorchBatchedBackend


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """The backend that runs attention on ``device``.

    Every device gets TorchBatchedBackend (decodes batched, prefills through SDPA), tested against the
    TorchReferenceBackend oracle. Device-specific paged kernels (a CPU kernel, a Triton/FlexAttention CUDA
    kernel) plug in here, chosen by device.type, under the same test.
    """
    del device  # one backend serves every device for now
    return TorchBatchedBackend()

"""Chooses the attention backend for a device."""

from __future__ import annotations

import torch

from folio.attention.backends.base import AttentionBackend
from folio.attention.backends.torch_ref import TorchReferenceBackend


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """The backend that runs attention on ``device``.

    For now every device gets the torch reference backend. Fast backends plug in here, chosen by
    device.type: a paged CPU kernel for "cpu" and a paged CUDA kernel (e.g. flash-attention style) for
    "cuda"; each is tested against TorchReferenceBackend.
    """
    del device  # every device uses the reference backend until a fast one exists
    return TorchReferenceBackend()

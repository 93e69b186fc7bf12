"""Linear layers on the CPU through oneDNN with weights packed once at load time.

torch's F.linear on the CPU goes to MKL's sgemm, which re-lays out the weight on every call and takes a slower
code path on AMD CPUs. oneDNN's linear with a weight reordered once into its blocked layout ran 1.3-1.9x faster on
this machine's EPYC at the engine's shapes (M = 64 decodes: 147-172 -> 207-225 GFLOP/s per projection, 108 -> 205
for the 49k-row LM head; measured in docs/performance.md), and up to 8x at M < 8. This is the weight-prepacking
that vLLM's CPU backend and IPEX do. CUDA and other dtypes keep F.linear.
"""

from __future__ import annotations

import torch

# Packing takes a batch-size hint for the blocked layout; one layout served M = 1..2048 equally well here.
_PACKING_BATCH_HINT = 64


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing applies to CPU float32 / bfloat16 weights in a torch build with oneDNN."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> an opaque oneDNN tensor that only ``packed_linear`` reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACKING_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] -> x @ weight.T (+ bias) [T, out], same result as F.linear up to float rounding."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

"""Linear layers on the CPU with weights packed once at load time.

Two implementations, the first that this machine can run:
- Folio's own GEMM (folio/kernels/cpu_gemm.c, built with the machine's C compiler): bfloat16 through AVX512-BF16
  dot products and float32 through FMAs, with the model's packed weights in one huge-page-backed arena. At a
  decode step's shapes it beat oneDNN's packed linear by 5-50% (docs/performance.md).
- oneDNN's linear with weights reordered once into its blocked layout (the prepacking vLLM's CPU backend and
  IPEX use): 1.3-1.9x torch's F.linear (MKL sgemm) at the engine's shapes; used where no C compiler exists.
CUDA and other dtypes keep F.linear.
"""

from __future__ import annotations

from typing import Any

import torch

from folio.kernels.cpu_gemm import CpuGemm, PackedWeight, load_cpu_gemm

# oneDNN packing takes a batch-size hint for the blocked layout; one layout served M = 1..2048 equally well here.
_ONEDNN_BATCH_HINT = 64


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Packing applies to CPU float32 / bfloat16 weights where either implementation is available."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    return load_cpu_gemm() is not None or _onednn_available()


def pack_weights(weights: list[torch.Tensor]) -> list[Any]:
    """weights [out, in] (one dtype) -> opaque packed forms that only ``packed_linear`` reads, in order."""
    gemm = load_cpu_gemm()
    if gemm is not None and all(CpuGemm.supports(w) for w in weights):
        return list(gemm.pack_all(weights))
    return [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _ONEDNN_BATCH_HINT) for w in weights]


def pack_weight(weight: torch.Tensor) -> Any:
    """One weight [out, in] -> its packed form (``pack_weights`` keeps a whole model in one arena)."""
    return pack_weights([weight])[0]


def packed_linear(
    x: torch.Tensor, packed: Any, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [T, in] -> x @ weight.T (+ bias) [T, out] in out_dtype (default x's), same result as F.linear up to
    float rounding."""
    if isinstance(packed, PackedWeight):
        gemm = load_cpu_gemm()
        assert gemm is not None, "a PackedWeight exists only where the kernel was built"
        return gemm.linear(x, packed, bias, out_dtype)
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return out if out_dtype is None else out.to(out_dtype)

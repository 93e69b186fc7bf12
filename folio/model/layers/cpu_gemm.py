"""Linear layers on the CPU with weights packed once at load time.

The implementation is the one the engine's CPU plan chose for its tier and dtype (folio/kernels/cpu_plan.py):
- Folio's own GEMM (folio/kernels/cpu_gemm.c): bfloat16 through AVX512-BF16 dot products and float32 through
  FMAs, with the model's packed weights in one huge-page-backed arena. At a decode step's shapes it beat
  oneDNN's packed linear by 5-50% (docs/performance.md).
- oneDNN's linear with weights reordered once into its blocked layout (the prepacking vLLM's CPU backend and
  IPEX use): 1.3-1.9x torch's F.linear (MKL sgemm) at the engine's shapes; where Folio has no vectorised tile.
CUDA and other dtypes keep F.linear.
"""

from __future__ import annotations

from typing import Any

import torch

from folio.kernels.cpu_gemm import CpuGemm, PackedWeight
from folio.kernels.cpu_kernels import CpuKernels

# oneDNN packing takes a batch-size hint for the blocked layout; one layout served M = 1..2048 equally well here.
_ONEDNN_BATCH_HINT = 64


def can_pack(kernels: CpuKernels | None) -> bool:
    """Packing applies where the plan chose Folio's GEMM or oneDNN for the weights' dtype."""
    return kernels is not None and kernels.plan.gemm in ("folio", "onednn")


def pack_weights(weights: list[torch.Tensor], kernels: CpuKernels, compact: list[bool] | None = None) -> list[Any]:
    """weights [out, in] (one dtype) -> opaque packed forms that only ``packed_linear`` reads, in order. Where the
    engine allows it (``kernels.compact_weights``), a weight whose ``compact`` entry is True (default: every
    weight) is kept as its 4-bit codes if it is exactly such codes (folio/kernels/gemm_codes4.h), multiplied on AMX
    above a vector tile of rows where the tier has it and the engine allows it (``kernels.amx_float32``), else through
    vpdpbusd where the library has VNNI and the engine allows it (``kernels.vnni_float32``)."""
    gemm = kernels.gemm
    if gemm is not None and all(CpuGemm.supports(w) for w in weights):
        allowed = [kernels.compact_weights and may for may in (compact or [True] * len(weights))]
        return list(gemm.pack_all(weights, kernels.huge_pages, allowed, kernels.amx_float32, kernels.vnni_float32))
    return [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _ONEDNN_BATCH_HINT) for w in weights]


def codes_summary(model: torch.nn.Module) -> str | None:
    """The start-up line on weights kept as 4-bit codes (``pack_weights``): how many, and their bytes against
    float32's; None where none is."""
    packed = [p for m in model.modules() if isinstance(p := getattr(m, "packed_weight", None), PackedWeight)]
    codes = [p for p in packed if p.codes4]
    if not codes:
        return None
    mib = sum(p.data.numel() for p in codes) / 2**20
    float32_mib = sum(p.n * p.k * 4 for p in codes) / 2**20
    on_amx, on_vnni = sum(p.codes4_amx for p in codes), sum(p.codes4_vnni for p in codes)
    how = ", the same outputs"
    if on_amx:
        how = (
            f"; {on_amx} of them on AMX above one vector tile of rows (8): exact products, float32 sums in another "
            "order (cpu_amx_float32)"
        )
    elif on_vnni:
        how = (
            f"; {on_vnni} of them through vpdpbusd above one vector tile of rows: x rounded to 22 bits per group of "
            "32, float32 accuracy (cpu_vnni_float32)"
        )
    return (
        f"{len(codes)} of {len(packed)} linear layers kept as their exact 4-bit codes: {mib:.1f} MiB instead of "
        f"{float32_mib:.1f} MiB in float32 (cpu_compact_weights){how}"
    )


def pack_weight(weight: torch.Tensor, kernels: CpuKernels) -> Any:
    """One weight [out, in] -> its packed form (``pack_weights`` keeps a whole model in one arena)."""
    return pack_weights([weight], kernels)[0]


def packed_linear(
    x: torch.Tensor, packed: Any, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [T, in] -> x @ weight.T (+ bias) [T, out] in out_dtype (default x's), same result as F.linear up to
    float rounding."""
    if isinstance(packed, PackedWeight):
        return packed.gemm.linear(x, packed, bias, out_dtype)
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return out if out_dtype is None else out.to(out_dtype)

"""Folio's CPU kernels for one ISA tier and dtype, with the plan that says which of them run.

The engine builds one ``CpuKernels`` at start-up from ``--cpu-isa`` and hands it to the model loader, which
gives each layer what the plan chose (folio/model/cpu_binding.py); tests build one per tier to run the same
assertions on every body. Nothing here is global: two tiers can run side by side in one process.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import torch

from folio.kernels.cpu_build import load_kernel_library, native_tier
from folio.kernels.cpu_gemm import CpuGemm
from folio.kernels.cpu_ops import CpuOps
from folio.kernels.cpu_plan import CpuPlan, choose_cpu_plan
from folio.kernels.isa import IsaTier, cpu_info
from folio.kernels.kv_block_copy import BlockCopy, CpuBlockCopy, aten_copy_blocks
from folio.logger import init_logger

logger = init_logger()

CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available() -> bool:
    """torch's oneDNN packed linear (reorder once, multiply many times) is present in this build."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@dataclass(frozen=True)
class CpuKernels:
    """The kernel library of one tier (None where no compiler could build it) and the plan for one dtype.

    ``gemm`` / ``ops`` are set only where the plan chose Folio's kernel, so a caller that finds them None runs
    its fallback; ``lib`` is there regardless, for tests and the paged attention bindings.
    """

    plan: CpuPlan
    lib: ctypes.CDLL | None
    dtype: torch.dtype
    gemm: CpuGemm | None = field(default=None)
    ops: CpuOps | None = field(default=None)
    block_copy: BlockCopy = field(default=aten_copy_blocks)  # the KV block copies the plan chose
    huge_pages: bool = True  # packed weights on huge pages (an engine's choice: cpu_huge_pages)
    compact_weights: bool = True  # float32 weights that are exact 4-bit codes kept as codes (cpu_compact_weights)
    amx_float32: bool = True  # the codes' GEMMs above a vector tile of rows on AMX where built (cpu_amx_float32)
    vnni_float32: bool = True  # ... through vpdpbusd where built with VNNI and no AMX (cpu_vnni_float32)
    extensions: tuple[str, ...] = ()  # instructions added to a lower tier's library (``--cpu-isa avx2+avx_vnni``)

    @property
    def tier(self) -> IsaTier:
        return self.plan.tier

    def ops_for(self, *tensors: torch.Tensor) -> CpuOps | None:
        """The fused element-wise ops if the plan chose them and every tensor is a CPU tensor of this dtype with
        a contiguous last dim; else None (the caller runs its torch ops)."""
        if self.ops is None:
            return None
        for t in tensors:
            if t.device.type != "cpu" or t.dtype != self.dtype or t.stride(-1) != 1:
                return None
        return self.ops

    def describe(self) -> str:
        """The start-up log line: CPU model, tier and the implementation of each operation."""
        return (
            f"CPU {cpu_info()[0]}: ISA tier {'+'.join([self.tier.flag_name, *self.extensions])} (this CPU's best: "
            f"{native_tier().flag_name}); "
            f"{self.plan.dtype_name} kernels: {self.plan.describe()}"
        )


def library_tier(lib: ctypes.CDLL) -> IsaTier:
    """The tier a loaded library reports it was compiled for (folio_isa_tier in cpu_kernels.c)."""
    fn = lib.folio_isa_tier
    fn.argtypes, fn.restype = [], ctypes.c_int
    return IsaTier(fn())


@functools.cache
def load_cpu_kernels(tier: IsaTier | None, dtype: torch.dtype, extensions: tuple[str, ...] = ()) -> CpuKernels:
    """The kernels of ``tier`` (None: this CPU's best; with ``extensions``, isa.EXTENSION_FLAGS) for ``dtype``
    (float32 or bfloat16), built on first use.

    The plan follows the tier the library reports, which is the one asked for unless the compiler could not
    target it (then a warning says so).
    """
    if dtype not in CPU_KERNEL_DTYPES:
        raise ValueError(f"CPU kernels run float32 or bfloat16, not {dtype}")
    tier = native_tier() if tier is None else tier
    lib = load_kernel_library("cpu_kernels", tier, extensions)
    built = tier if lib is None else library_tier(lib)
    if built != tier:
        logger.warning("the %s kernel library reports tier %s", tier.flag_name, built.flag_name)
    gemm = None if lib is None else CpuGemm(lib)
    int8_screen = gemm is not None and gemm.codes8_has_i8_screen  # a property of the build, as its tier
    plan = choose_cpu_plan(built, str(dtype).removeprefix("torch."), lib is not None, onednn_available(), int8_screen)
    return CpuKernels(
        plan=plan,
        lib=lib,
        dtype=dtype,
        gemm=gemm if plan.gemm == "folio" else None,
        ops=CpuOps(lib, dtype) if lib is not None and plan.elementwise == "folio" else None,
        block_copy=CpuBlockCopy(lib) if lib is not None and plan.kv_block_copy == "folio" else aten_copy_blocks,
        extensions=extensions,
    )

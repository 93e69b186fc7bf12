"""The kernel library the kernel tests bind, once per process for each tier and set of extensions: Folio's GEMM on
it, and the check that the library reports the tier it was asked for."""

from __future__ import annotations

import functools

from folio.kernels.cpu_build import load_kernel_library
from folio.kernels.cpu_gemm import CpuGemm
from folio.kernels.cpu_kernels import library_tier
from folio.kernels.isa import IsaTier


@functools.cache
def gemm_library(tier: IsaTier, extensions: tuple[str, ...] = ()) -> CpuGemm:
    """The GEMM of ``tier``'s library, with ``extensions`` (isa.EXTENSION_FLAGS) where asked."""
    lib = load_kernel_library("cpu_kernels", tier, extensions)
    assert lib is not None, "the GEMM must build here (gcc is part of this machine and of CI)"
    assert library_tier(lib) == tier
    return CpuGemm(lib)

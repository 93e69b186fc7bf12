"""How the CPU kernels run: the engine's CPU settings, resolved once (a clear error in the caller's process) and
handed to the worker, which builds its kernels from them. Pure Python, like folio.config, which holds it."""

from __future__ import annotations

from dataclasses import dataclass

from folio.kernels.isa import IsaTier, cpu_info, cpu_isa_extensions, is_x86_64, resolve_cpu_isa


@dataclass
class CpuConfig:
    """How the CPU kernels run (folio/kernels/): ignored on other devices."""

    # the ISA tier the kernels are built for: "auto" (this CPU's best) or a lower one (folio/kernels/isa.py), with
    # the extensions it names ("avx2+avx_vnni": an Intel client core's kernels on a CPU whose own tier is higher)
    isa: str = "auto"
    # bytes of the next layer's decode K/V that a layer's GEMMs prefetch in the fused decoder; None: the CPU plan's
    # choice (kv_side_prefetch: half the L3, or none)
    kv_prefetch_bytes: int | None = None
    # fewer kernel threads while other processes take cores (folio/worker/cpu_threads.py)
    adaptive_threads: bool = True
    # the packed weights and the KV cache on 2 MiB pages (folio/kernels/hugepages.py): fewer TLB misses; off: a
    # faster start where a huge page's first touch is slow (VMs whose host takes freed memory back)
    huge_pages: bool = True
    # float32 weights that are exactly 4-bit codes (a GGUF's Q4_1 dequantized) kept as those codes: the same outputs
    # bit for bit from a sixth of the weight bytes (folio/kernels/gemm_codes4.h)
    compact_weights: bool = True
    # on the amx tier, the GEMMs over those codes of more rows than a vector tile run on AMX's bfloat16 tiles with
    # x split in three exact parts: every product exact, float32 sums in another order (gemm_codes4_amx.h)
    amx_float32: bool = True
    # where the library has AVX512-VNNI and no AMX (Zen 4 / 5, Cascade Lake, Ice Lake), or AVX-VNNI at the avx2
    # tier (Intel's client cores), those GEMMs run through vpdpbusd with x as a 22-bit fixed
    # point per group in three int8 limbs (gemm_codes4_vnni.h)
    vnni_float32: bool = True

    def __post_init__(self) -> None:
        resolve_cpu_isa(self.isa, cpu_info()[1], is_x86_64())  # a clear error now, not in the engine process
        if self.kv_prefetch_bytes is not None and self.kv_prefetch_bytes < 0:
            raise ValueError(f"cpu_kv_prefetch_bytes must be >= 0, got {self.kv_prefetch_bytes}")

    def tier(self) -> IsaTier:
        return resolve_cpu_isa(self.isa, cpu_info()[1], is_x86_64())

    def extensions(self) -> tuple[str, ...]:
        return cpu_isa_extensions(self.isa)

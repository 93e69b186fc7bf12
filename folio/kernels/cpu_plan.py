"""Which implementation runs each CPU operation, decided from the ISA tier the kernel library was built for.

The rule in one place: Folio's C kernel where it has a vectorised body for the tier (FOLIO_MIN_TIER), oneDNN's
packed linear for a GEMM it has not, torch otherwise. A plain-C body is correct on every tier (the kernel tests
run it) but slower than oneDNN / torch, so it is never chosen for speed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from folio.kernels.isa import IsaTier

# The lowest tier at which Folio's kernel for an operation has a vectorised body.
FOLIO_MIN_TIER: dict[str, IsaTier] = {
    # GEMM: at the engine's shapes the AVX2 tiles beat oneDNN limited to AVX2 in float32 up to M = 64 (1.1-1.7x;
    # M = 64: 123-127 GFLOP/s per core against 109-115) and matched it at 256 and 2048; oneDNN refuses bfloat16
    # below AVX-512, and on AVX-512 without BF16 the widening bfloat16 tiles ran at 1.4-4x oneDNN's (AVX512_CORE).
    # benchmarks/cpu_gemm.py --threads 1 --cpu-time, AMD EPYC Zen 5. On an AVX2-only Zen 3 (2 threads, per-call
    # medians, benchmarks/cpu_gemm.py --median) 0.80-1.38x oneDNN's at M = 64-2048 (0.65-0.96x before the tiles
    # stopped testing for side prefetches in every step; docs/performance.md, session 40).
    # On the amx tier the bfloat16 GEMM runs on AMX tiles: 550-1230 GFLOP/s from M = 64 on 2 cores of a Sapphire
    # Rapids class Xeon, oneDNN's (AMX too) 440-890, the avx512_bf16 build's vdpbf16ps tiles 110-120.
    "gemm_f32": IsaTier.AVX2,
    "gemm_bf16": IsaTier.AVX2,
    # vectorised from AVX2: at W1's shapes (float32, avx2 build, AMD EPYC Zen 5, benchmarks/attention_kernels.py)
    # decode 2.5x and prefill 1.8x faster than TorchBatchedBackend; the generic build's prefill is 0.5x
    "decode_attention": IsaTier.AVX2,
    "prefill_attention": IsaTier.AVX2,
    "elementwise": IsaTier.AVX2,
    # a float32 greedy LM head screened in bfloat16 and rescored in float32 (the float32 arg-max exactly): needs
    # vdpbf16ps, twice the float32 FMA's work per instruction; widened bfloat16 does the float32 FMA's work
    "lm_head_bf16_screen": IsaTier.AVX512_BF16,
    # a float32 greedy LM head kept as 8-bit codes (a GGUF's Q8_0), screened in int16 (vpmaddwd) and rescored in
    # float32 (gemm_codes8_screen.h): an AVX2 body only, so from AVX2 up to LM_HEAD_INT16_SCREEN_MAX_TIER (AVX2)
    "lm_head_int16_screen": IsaTier.AVX2,
    # whole KV blocks between the tiers and for copy-on-write: libc's memcpy per block run, vectorised by libc on
    # every tier; 1.9-2.4x the speed of ATen's gather-then-scatter (benchmarks/kv_block_copy.py)
    "kv_block_copy": IsaTier.GENERIC,
}


# The fused decoder's GEMMs prefetch the next layer's decode K/V (SidePrefetch in cpu_gemm.c, up to half the L3)
# from AVX-512 on. A side line every other k step is a larger share of an AVX2 tile's step (12 FMAs on ymm, against
# 24 on zmm), and on an AVX2-only Zen 3 it never paid: W1 float32 without it even to 4% faster over 15 rounds in
# which each setting ran at several places in the round order (benchmarks/ab_offline.py; docs/performance.md,
# session 41). With it: bfloat16 on Zen 5 +2.7%, float32 on Zen 5 and the Xeons about even.
# cpu_kv_prefetch_bytes overrides the plan either way.
KV_SIDE_PREFETCH_MIN_TIER = IsaTier.AVX512

# The int16 screen has an AVX2 body only: an AVX-512 library (the Xeons without avx512_bf16) keeps the 8-bit codes'
# float32 arg-max until a 512-bit body is written and measured there.
LM_HEAD_INT16_SCREEN_MAX_TIER = IsaTier.AVX2

# bfloat16 needs AVX-512: below it the widening bfloat16 GEMM ran slower than float32 from M = 16 up (about 89
# against 120 GFLOP/s per core, AVX2 build on Zen 5: the shifts share the FMA pipes) and oneDNN refuses bfloat16,
# so a bfloat16 engine there would be slower than the float32 default. Refused with a message instead.
BFLOAT16_MIN_TIER = IsaTier.AVX512


def check_cpu_dtype(dtype_name: str, tier: IsaTier) -> None:
    """Raises ValueError, naming the dtype, the tier and the way out, where the CPU kernels would run ``dtype_name``
    slower than float32 (bfloat16 below AVX-512)."""
    if dtype_name == "bfloat16" and tier < BFLOAT16_MIN_TIER:
        raise ValueError(
            f"dtype bfloat16 on the CPU needs the {BFLOAT16_MIN_TIER.flag_name} ISA tier or above; this engine's tier "
            f"is {tier.flag_name}, where bfloat16 would run slower than float32: use dtype float32 (the CPU default)"
        )


@dataclass(frozen=True)
class CpuPlan:
    """The implementation of each operation for one dtype: "folio", "onednn", "torch"; "off" for the optional
    fused paths."""

    tier: IsaTier
    dtype_name: str  # "float32" or "bfloat16"
    gemm: str
    lm_head_argmax: str  # the greedy step's LM head without writing the logits: Folio's GEMM ("folio"), or in
    # float32 its bfloat16 screen with a float32 rescore ("folio_bf16_screen"), or for a head of 8-bit codes their
    # int16 screen ("folio_int16_screen": AVX2) or int8 screen ("folio_int8_screen": AVX512-VNNI without AMX) with
    # a float32 rescore, or "off"
    decode_attention: str
    prefill_attention: str
    elementwise: str  # RMSNorm + residual, rotary, SiLU-and-mul, the K/V write
    fused_decoder: str  # every layer in one C call: needs Folio's kernel for every operation above
    kv_side_prefetch: str  # the fused decoder's GEMMs prefetch the next layer's decode K/V: "folio" or "off"
    kv_block_copy: str  # whole KV blocks (host tier stores and loads, copy-on-write): "folio" or "torch"

    def with_kv_prefetch_bytes(self, budget: int | None) -> CpuPlan:
        """The plan under the engine's cpu_kv_prefetch_bytes (None: the plan's own choice), so that the start-up
        line names the side prefetch that runs; it needs the fused decoder, whose GEMMs carry it."""
        if budget is None:
            return self
        return replace(self, kv_side_prefetch="folio" if budget > 0 and self.fused_decoder == "folio" else "off")

    def describe(self) -> str:
        """One line for the start-up log: every operation and its implementation."""
        skip = ("tier", "dtype_name")
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name not in skip)


def choose_cpu_plan(
    tier: IsaTier, dtype_name: str, have_compiler: bool = True, have_onednn: bool = True, int8_screen: bool = False
) -> CpuPlan:
    """The plan for a library of ``tier`` running ``dtype_name`` ("float32" / "bfloat16") weights and K/V;
    ``have_compiler`` False: no library at all, so no Folio kernel; ``int8_screen``: the library has the LM head's
    int8 screen (built with AVX512-VNNI and without AMX: a property of the build, as the tier is)."""
    if dtype_name not in ("float32", "bfloat16"):
        raise ValueError(f"CPU kernels run float32 or bfloat16, not {dtype_name}")

    def folio_or(op: str, fallback: str) -> str:
        return "folio" if have_compiler and tier >= FOLIO_MIN_TIER[op] else fallback

    # oneDNN's bfloat16 linear needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; below that torch's reference GEMM
    onednn_runs = have_onednn and (dtype_name == "float32" or tier >= IsaTier.AVX512)
    gemm = folio_or("gemm_f32" if dtype_name == "float32" else "gemm_bf16", "onednn" if onednn_runs else "torch")
    decode, prefill = folio_or("decode_attention", "torch"), folio_or("prefill_attention", "torch")
    elementwise = folio_or("elementwise", "torch")
    all_folio = all(impl == "folio" for impl in (gemm, decode, prefill, elementwise))
    return CpuPlan(
        tier=tier,
        dtype_name=dtype_name,
        gemm=gemm,
        lm_head_argmax=_lm_head_argmax(
            gemm,
            dtype_name,
            bf16_screen=folio_or("lm_head_bf16_screen", "") == "folio",
            int16_screen=folio_or("lm_head_int16_screen", "") == "folio" and tier <= LM_HEAD_INT16_SCREEN_MAX_TIER,
            int8_screen=have_compiler and int8_screen,
        ),
        decode_attention=decode,
        prefill_attention=prefill,
        elementwise=elementwise,
        fused_decoder="folio" if all_folio else "off",
        kv_side_prefetch="folio" if all_folio and tier >= KV_SIDE_PREFETCH_MIN_TIER else "off",
        kv_block_copy=folio_or("kv_block_copy", "torch"),
    )


def _lm_head_argmax(gemm: str, dtype_name: str, bf16_screen: bool, int16_screen: bool, int8_screen: bool) -> str:
    """Folio's fused arg-max needs Folio's GEMM; a float32 one (for a head of 8-bit codes) is screened in int8
    where vpdpbusd runs it (1.3-1.6x the bfloat16 screen at 256 rows of SmolLM2's head: docs/performance.md,
    session 53), else in bfloat16 where vdpbf16ps exists, else in int16 where that screen runs (the AVX2 tier)."""
    if gemm != "folio":
        return "off"
    if dtype_name == "float32" and int8_screen:
        return "folio_int8_screen"
    if dtype_name == "float32" and bf16_screen:
        return "folio_bf16_screen"
    if dtype_name == "float32" and int16_screen:
        return "folio_int16_screen"
    return "folio"

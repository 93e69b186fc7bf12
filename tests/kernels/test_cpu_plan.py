"""The tier -> implementation rule (folio/kernels/cpu_plan.py) and the tier arithmetic (folio/kernels/isa.py)."""

from __future__ import annotations

import pytest

from folio.kernels.cpu_build import build_every_tier, load_kernel_library, native_tier
from folio.kernels.cpu_kernels import library_tier
from folio.kernels.cpu_plan import FOLIO_MIN_TIER, KV_SIDE_PREFETCH_MIN_TIER, check_cpu_dtype, choose_cpu_plan
from folio.kernels.isa import (
    IsaTier,
    check_extensions,
    compile_flags,
    cpu_isa_extensions,
    detect_tier,
    resolve_cpu_isa,
)

ZEN3_FLAGS = frozenset(["sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"])
XEON_FLAGS = ZEN3_FLAGS | frozenset(["avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"])
ZEN5_FLAGS = XEON_FLAGS | {"avx512_bf16"}
SAPPHIRE_RAPIDS_FLAGS = ZEN5_FLAGS | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.mark.parametrize(
    ("flags", "tier"),
    [
        (frozenset({"sse4_2"}), IsaTier.GENERIC),
        (ZEN3_FLAGS, IsaTier.AVX2),
        (ZEN3_FLAGS - {"fma"}, IsaTier.GENERIC),
        (XEON_FLAGS, IsaTier.AVX512),
        (XEON_FLAGS - {"avx512vl"}, IsaTier.AVX2),
        (ZEN5_FLAGS, IsaTier.AVX512_BF16),
        (ZEN5_FLAGS - {"avx2"}, IsaTier.GENERIC),  # a tier needs every lower tier's flags too
        (SAPPHIRE_RAPIDS_FLAGS, IsaTier.AMX),
        (SAPPHIRE_RAPIDS_FLAGS - {"amx_bf16"}, IsaTier.AVX512_BF16),
        (XEON_FLAGS | {"amx_tile", "amx_bf16"}, IsaTier.AVX512),
    ],
)
def test_detect_tier(flags: frozenset[str], tier: IsaTier) -> None:
    assert detect_tier(flags) == tier


def test_off_x86_everything_is_generic() -> None:
    assert detect_tier(ZEN5_FLAGS, x86_64=False) == IsaTier.GENERIC
    assert compile_flags(IsaTier.GENERIC, IsaTier.GENERIC, x86_64=False) == []


def test_resolve_cpu_isa() -> None:
    assert resolve_cpu_isa("auto", ZEN3_FLAGS) == IsaTier.AVX2
    assert resolve_cpu_isa("generic", ZEN3_FLAGS) == IsaTier.GENERIC
    assert resolve_cpu_isa("avx512", ZEN5_FLAGS) == IsaTier.AVX512
    with pytest.raises(ValueError, match=r"--cpu-isa avx512: this CPU's best tier is avx2; it lacks avx512bw"):
        resolve_cpu_isa("avx512", ZEN3_FLAGS)
    lacks_amx = r"--cpu-isa amx: this CPU's best tier is avx512_bf16; it lacks amx_bf16, amx_tile"
    with pytest.raises(ValueError, match=lacks_amx):
        resolve_cpu_isa("amx", ZEN5_FLAGS)
    choices = "cpu_isa must be one of auto, generic, avx2, avx512, avx512_bf16, amx, avx2\\+avx_vnni"
    with pytest.raises(ValueError, match=choices):
        resolve_cpu_isa("sse", ZEN3_FLAGS)
    # a tier with an extension: the tier, where this CPU has the extension
    assert resolve_cpu_isa("avx2+avx_vnni", ZEN5_FLAGS | {"avx_vnni"}) == IsaTier.AVX2
    assert cpu_isa_extensions("avx2+avx_vnni") == ("avx_vnni",) and cpu_isa_extensions("avx2") == ()
    with pytest.raises(ValueError, match="--cpu-isa avx2\\+avx_vnni: kernel extension avx_vnni: this CPU lacks it"):
        resolve_cpu_isa("avx2+avx_vnni", ZEN5_FLAGS)
    with pytest.raises(ValueError, match="cpu_isa must be one of"):
        resolve_cpu_isa("avx512+avx_vnni", ZEN5_FLAGS | {"avx_vnni"})


def test_compile_flags_native_only_for_the_cpus_own_tier() -> None:
    assert compile_flags(IsaTier.AVX2, IsaTier.AVX2) == ["-march=native"]
    assert compile_flags(IsaTier.AVX2, IsaTier.AVX512_BF16) == ["-march=x86-64-v3", "-mtune=native"]
    assert compile_flags(IsaTier.AVX512, IsaTier.AVX512_BF16) == ["-march=x86-64-v4", "-mtune=native"]
    assert compile_flags(IsaTier.GENERIC, IsaTier.AVX2) == ["-march=x86-64", "-mtune=native"]
    # below an AMX CPU's own tier, avx512_bf16 is built without the tile instructions
    assert compile_flags(IsaTier.AVX512_BF16, IsaTier.AMX) == ["-march=x86-64-v4", "-mavx512bf16", "-mtune=native"]


def test_an_extension_adds_its_instructions_to_a_lower_tier_only_where_the_cpu_has_them() -> None:
    """Tests and benchmarks build the avx2 tier with AVX-VNNI (the body Intel's client cores build with
    -march=native) on a CPU whose own tier is higher; -march=native already has it."""
    with_vnni = ZEN5_FLAGS | {"avx_vnni"}
    check_extensions(IsaTier.AVX2, ("avx_vnni",), with_vnni)
    assert compile_flags(IsaTier.AVX2, IsaTier.AVX512_BF16, extensions=("avx_vnni",)) == [
        "-march=x86-64-v3",
        "-mavxvnni",
        "-mtune=native",
    ]
    assert compile_flags(IsaTier.AVX2, IsaTier.AVX2, extensions=("avx_vnni",)) == ["-march=native"]
    with pytest.raises(ValueError, match="kernel extension avx_vnni: this CPU lacks it"):
        check_extensions(IsaTier.AVX2, ("avx_vnni",), ZEN5_FLAGS)
    with pytest.raises(ValueError, match="kernel extension avx_vnni needs the avx2 tier or above, not generic"):
        check_extensions(IsaTier.GENERIC, ("avx_vnni",), with_vnni)
    with pytest.raises(ValueError, match="unknown kernel extension 'amx_int8'; known: avx_vnni"):
        check_extensions(IsaTier.AVX2, ("amx_int8",), with_vnni)


@pytest.mark.parametrize("tier", list(IsaTier), ids=lambda t: t.flag_name)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_folio_kernel_exactly_where_it_has_a_vectorised_body(tier: IsaTier, dtype_name: str) -> None:
    plan = choose_cpu_plan(tier, dtype_name)
    gemm_op = "gemm_f32" if dtype_name == "float32" else "gemm_bf16"
    for op, impl in [
        (gemm_op, plan.gemm),
        ("decode_attention", plan.decode_attention),
        ("prefill_attention", plan.prefill_attention),
        ("elementwise", plan.elementwise),
        ("kv_block_copy", plan.kv_block_copy),
    ]:
        assert (impl == "folio") == (tier >= FOLIO_MIN_TIER[op]), (op, impl)
    screened = dtype_name == "float32" and tier >= FOLIO_MIN_TIER["lm_head_bf16_screen"]
    int16_screened = dtype_name == "float32" and tier == IsaTier.AVX2  # the int16 screen's only body: AVX2
    expected_head = "folio_bf16_screen" if screened else "folio_int16_screen" if int16_screened else "folio"
    assert plan.lm_head_argmax == ("off" if plan.gemm != "folio" else expected_head)
    every_op_folio = {plan.gemm, plan.decode_attention, plan.prefill_attention, plan.elementwise} == {"folio"}
    assert (plan.fused_decoder == "folio") == every_op_folio
    # the fused decoder's K/V side prefetch: from AVX-512 on (it never paid on an AVX2-only Zen 3)
    side_prefetch = every_op_folio and tier >= KV_SIDE_PREFETCH_MIN_TIER
    assert plan.kv_side_prefetch == ("folio" if side_prefetch else "off")
    assert f"kv_side_prefetch={plan.kv_side_prefetch}" in plan.describe()


def test_bfloat16_is_refused_below_avx512_with_the_way_out() -> None:
    for tier in (IsaTier.GENERIC, IsaTier.AVX2):
        with pytest.raises(ValueError, match=f"bfloat16 .* tier is {tier.flag_name}.*use dtype float32"):
            check_cpu_dtype("bfloat16", tier)
        check_cpu_dtype("float32", tier)
    check_cpu_dtype("bfloat16", IsaTier.AVX512)
    check_cpu_dtype("bfloat16", IsaTier.AVX512_BF16)


def test_fallbacks() -> None:
    # below Folio's tiles the GEMM is oneDNN's, except bfloat16 below AVX-512 (oneDNN refuses it there)
    generic32, generic16 = choose_cpu_plan(IsaTier.GENERIC, "float32"), choose_cpu_plan(IsaTier.GENERIC, "bfloat16")
    assert (generic32.gemm, generic16.gemm) == ("onednn", "torch")
    assert generic32.decode_attention == generic32.elementwise == "torch" and generic32.fused_decoder == "off"
    # no compiler: no Folio kernel on any tier; no oneDNN in the torch build: torch's GEMM
    no_cc = choose_cpu_plan(IsaTier.AVX512_BF16, "float32", have_compiler=False)
    assert {no_cc.gemm, no_cc.decode_attention, no_cc.elementwise} == {"onednn", "torch"}
    assert no_cc.kv_block_copy == "torch"
    assert choose_cpu_plan(IsaTier.GENERIC, "float32", have_onednn=False).gemm == "torch"
    assert choose_cpu_plan(IsaTier.AVX2, "float32").kv_side_prefetch == "off"
    assert choose_cpu_plan(IsaTier.AVX512, "float32").kv_side_prefetch == "folio"
    best = choose_cpu_plan(IsaTier.AVX512_BF16, "bfloat16")
    assert best.fused_decoder == "folio" and "gemm=folio" in best.describe() and "tier" not in best.describe()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        choose_cpu_plan(IsaTier.AVX2, "float16")


def test_the_int8_screen_wherever_the_library_has_it_for_float32() -> None:
    """A library built with AVX512-VNNI and without AMX has the LM head's int8 screen: it takes a float32 head
    (of 8-bit codes) before the bfloat16 and int16 screens; bfloat16 heads and plans without Folio's GEMM never."""
    for tier in (IsaTier.AVX2, IsaTier.AVX512, IsaTier.AVX512_BF16):
        plan = choose_cpu_plan(tier, "float32", int8_screen=True)
        assert plan.lm_head_argmax == "folio_int8_screen" and "lm_head_argmax=folio_int8_screen" in plan.describe()
    assert choose_cpu_plan(IsaTier.AVX512_BF16, "bfloat16", int8_screen=True).lm_head_argmax == "folio"
    assert choose_cpu_plan(IsaTier.GENERIC, "float32", int8_screen=True).lm_head_argmax == "off"
    assert choose_cpu_plan(IsaTier.AVX512, "float32", have_compiler=False, int8_screen=True).lm_head_argmax == "off"


def test_the_engines_kv_prefetch_budget_is_in_the_plan_it_logs() -> None:
    """cpu_kv_prefetch_bytes overrides the plan's side prefetch either way; the start-up line says what runs."""
    avx2, avx512 = choose_cpu_plan(IsaTier.AVX2, "float32"), choose_cpu_plan(IsaTier.AVX512, "float32")
    assert avx2.with_kv_prefetch_bytes(None) == avx2 and avx512.with_kv_prefetch_bytes(None) == avx512
    assert avx2.with_kv_prefetch_bytes(1 << 20).kv_side_prefetch == "folio"
    assert "kv_side_prefetch=folio" in avx2.with_kv_prefetch_bytes(1 << 20).describe()
    assert avx512.with_kv_prefetch_bytes(0).kv_side_prefetch == "off"
    assert avx512.with_kv_prefetch_bytes(1 << 20) == avx512
    # without the fused decoder there is no GEMM to carry the prefetch, whatever the budget
    generic = choose_cpu_plan(IsaTier.GENERIC, "float32")
    assert generic.with_kv_prefetch_bytes(1 << 20).kv_side_prefetch == "off"


def test_setup_builds_every_tier_this_cpu_runs() -> None:
    """scripts/setup.sh's build: every tier up to this CPU's, each library reporting the tier it was built for."""
    tiers = build_every_tier()
    assert tiers == [tier for tier in IsaTier if tier <= native_tier()]
    for tier in tiers:
        lib = load_kernel_library("cpu_kernels", tier)
        assert lib is not None and library_tier(lib) == tier

"""The float32 GEMM over 4-bit codes on a dot-product unit, above one vector tile of rows, in this CPU's own library:
on AMX (folio/kernels/gemm_codes4_amx.h, cpu_amx_float32, the amx tier: x split into three bfloat16 parts, every
product exact) or through vpdpbusd (folio/kernels/gemm_codes4_vnni.h, cpu_vnni_float32: AVX512-VNNI in a library
with it and without AMX, AVX-VNNI in a 256-bit library with it; x rounded to a 22-bit fixed point per row and group
of 32 k, exact integer products and sums). The lower tiers' libraries with extensions this CPU has
(tests/conftest.py EXTENDED_LIBRARIES: avx2+avx_vnni, the body Intel's client cores build) run the same tests.
Float32 sums in another order, so each result is held to the float32 layout's own error against a float64 product
(plus x's rounding for VNNI), not to its bits; one vector tile of rows or fewer keeps the float32 layout's bits; a
row's result does not depend on the rows beside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from folio.kernels.cpu_build import native_tier
from folio.kernels.cpu_gemm import CpuGemm, PackedWeight
from folio.kernels.cpu_kernels import load_cpu_kernels
from folio.kernels.isa import IsaTier
from folio.model.layers.cpu_gemm import codes_summary, pack_weights
from tests.conftest import EXTENDED_LIBRARIES
from tests.kernels.test_gemm_codes4 import _assert_same_bits, _edge_weight, _gemm, _grouped, _q4_1_weight


@dataclass(frozen=True)
class DotUnit:
    name: str  # "amx" or "vnni": PackedWeight.codes4_<name>, CpuKernels.<name>_float32, pack_all's keyword
    x_bits: int  # x's bits kept per group below its largest power of two (0: x kept exactly)
    start_up: str  # what the start-up line says of the codes on the unit
    # the unit's library: this CPU's own (tier None), or a lower tier's with the instructions `extensions` adds
    # (isa.EXTENSION_FLAGS): the body a CPU whose own tier that is builds natively (tests/conftest.py)
    tier: IsaTier | None = None
    extensions: tuple[str, ...] = ()

    def library(self) -> CpuGemm:
        return _gemm(native_tier()) if self.tier is None else _gemm(self.tier, self.extensions)

    def lower(self) -> CpuGemm:
        """A library without the unit (the tier below, or the same tier without the extensions): its FMA tiles
        multiply the codes, whatever the engine asks."""
        return _gemm(IsaTier(native_tier() - 1)) if self.tier is None else _gemm(self.tier)

    def tile_rows(self) -> int:
        """Rows of the library's vector tile: more go on the unit (8 in 512-bit libraries, 4 in 256-bit ones)."""
        return 8 if (native_tier() if self.tier is None else self.tier) >= IsaTier.AVX512 else 4

    def available(self) -> bool:
        if native_tier() <= IsaTier.GENERIC:
            return False
        gemm = self.library()
        return gemm.codes4_has_amx if self.name == "amx" else gemm.codes4_has_vnni

    def pack(self, gemm: CpuGemm, weights: list[torch.Tensor], compact: list[bool]) -> list[PackedWeight]:
        return gemm.pack_all(weights, compact=compact, **{f"{self.name}_float32": True})

    def on_unit(self, packed: PackedWeight) -> bool:
        return bool(getattr(packed, f"codes4_{self.name}"))


AMX = DotUnit("amx", 0, "on AMX")
VNNI = DotUnit("vnni", 22, "through vpdpbusd")
EXTENDED_VNNI = [DotUnit("vnni", 22, "through vpdpbusd", tier, extensions) for tier, extensions in EXTENDED_LIBRARIES]

UNITS = [
    pytest.param(AMX, id="amx", marks=pytest.mark.skipif(not AMX.available(), reason="AMX tiles: the amx tier only")),
    pytest.param(
        VNNI,
        id="vnni-native",
        marks=pytest.mark.skipif(
            not VNNI.available(), reason="a native library with AVX512-VNNI and without AMX, or with AVX-VNNI"
        ),
    ),
    *(pytest.param(unit, id="vnni-" + "+".join([unit.tier.flag_name, *unit.extensions])) for unit in EXTENDED_VNNI),
]


def _packed(unit: DotUnit, w: torch.Tensor) -> tuple[CpuGemm, PackedWeight, PackedWeight]:
    """The unit's library, w in the float32 layout, and w as codes multiplied on the unit."""
    gemm = unit.library()
    [plain] = gemm.pack_all([w])
    [dot] = unit.pack(gemm, [w], [True])
    assert dot.codes4 and unit.on_unit(dot)
    return gemm, plain, dot


def _assert_float32_accurate(
    unit: DotUnit, got: torch.Tensor, plain: torch.Tensor, x: torch.Tensor, w: torch.Tensor
) -> None:
    """Each of got's errors against the float64 product at most twice the float32 layout's worst plus eight float32
    roundings of |x| . (|w| + 2 |m|), m the group's offset (its minimum): the group sums of x times m and of x
    times the codes each round once in float32, on the scale of their own terms. Where the unit rounds x (VNNI):
    plus half a step of 2^-x_bits of the power of two above x's group's largest |x| (at least 2^-100), times |w|."""
    reference = x.double() @ w.double().T
    offsets = w.double().reshape(w.shape[0], -1, 32).amin(-1, keepdim=True).abs().expand(-1, -1, 32)
    magnitude = x.double().abs() @ (w.double().abs() + 2 * offsets.reshape(w.shape)).T
    allowed = 2 * (plain.double() - reference).abs().max() + 8 * 2.0**-24 * magnitude
    if unit.x_bits:
        group_max = x.double().abs().reshape(x.shape[0], -1, 32).amax(-1, keepdim=True).clamp(min=2.0**-100)
        allowed += (2.0**-unit.x_bits * group_max.expand(-1, -1, 32).reshape(x.shape)) @ w.double().abs().T
    excess = (got.double() - reference).abs() - allowed
    assert excess.max().item() <= 0, (excess.argmax().item(), excess.max().item())


@pytest.mark.parametrize("unit", UNITS)
def test_exact_wherever_the_float32_result_is_exact(unit: DotUnit) -> None:
    """x of 18 significant bits (all three bfloat16 parts needed; within VNNI's fixed point), one per group of 32 in
    each row, and steps and offsets that are powers of two: every product and sum is exact in float32, so both
    paths give the float64 product exactly. A part of x left out, or a group's step or offset misapplied, shows."""
    gen = torch.Generator().manual_seed(12)
    n, groups, m = 50, 2, 24
    q = torch.randint(0, 16, (n, groups, 32), generator=gen)
    q[:, :, 0], q[:, :, 1] = 0, 15  # each group spans 0..15: its step is exactly d
    d = torch.full((n, groups), 2.0**-3).half()
    offset = torch.full((n, groups), -1.0).half()
    w = _grouped(d, offset, q)
    gemm, plain, dot = _packed(unit, w)
    mantissa = (2**17 + torch.randint(0, 2**17, (m, groups), generator=gen)).double() * 2.0**-17
    signs = torch.randint(0, 2, (m, groups), generator=gen).double() * 2 - 1
    x = torch.zeros(m, groups * 32, dtype=torch.float64)
    where = torch.randint(0, 32, (m, groups), generator=gen) + 32 * torch.arange(groups)
    x.scatter_(1, where, mantissa * signs)
    exact = (x @ w.double().T).float()
    _assert_same_bits(gemm.linear(x.float(), dot, None), exact)
    _assert_same_bits(gemm.linear(x.float(), plain, None), exact)


SHAPES = [
    (9, 100, 64),  # the fewest rows on the unit: a short tile, a column past a block
    (16, 48, 32),  # one block, one group
    (17, 49, 96),  # a full AMX tile and a one-row tile
    (64, 3072, 576),  # gate|up at W1's decode batch
    (64, 576, 1536),  # down
    (40, 7, 64),  # fewer columns than a vector
    (300, 200, 64),  # two chunks of rows
]


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_codes_on_the_unit_are_float32_accurate(unit: DotUnit, m: int, n: int, k: int) -> None:
    w = _q4_1_weight(n, k, seed=m * 31 + n)
    gemm, plain, dot = _packed(unit, w)
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)  # inputs over six decades
    bias = torch.randn(n, generator=gen)
    _assert_float32_accurate(unit, gemm.linear(x, dot, None), gemm.linear(x, plain, None), x, w)
    _assert_same_bits(gemm.linear(x, dot, bias), gemm.linear(x, dot, None) + bias)
    bf16 = gemm.linear(x, dot, None, torch.bfloat16).float()
    torch.testing.assert_close(bf16, gemm.linear(x, dot, None).to(torch.bfloat16).float(), rtol=0, atol=0)
    strided = torch.randn(m, k + 32, generator=gen)[:, 16 : 16 + k]  # rows k + 32 apart
    _assert_same_bits(gemm.linear(strided, dot, None), gemm.linear(strided.contiguous(), dot, None))


@pytest.mark.parametrize("unit", UNITS)
def test_outliers_stay_float32_accurate(unit: DotUnit) -> None:
    """One input in 97 forty times the others (VNNI: the groups holding one round the rest more coarsely)."""
    w = _q4_1_weight(96, 576, seed=21)
    gemm, plain, dot = _packed(unit, w)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(21))
    x.view(-1)[::97] *= 40
    _assert_float32_accurate(unit, gemm.linear(x, dot, None), gemm.linear(x, plain, None), x, w)


@pytest.mark.parametrize("unit", UNITS)
def test_one_vector_tile_of_rows_keeps_the_float32_bits(unit: DotUnit) -> None:
    gemm, plain, dot = _packed(unit, _q4_1_weight(150, 128, seed=3))
    for m in (1, unit.tile_rows() // 2 + 1, unit.tile_rows()):
        x = torch.randn(m, 128)
        _assert_same_bits(gemm.linear(x, dot, None), gemm.linear(x, plain, None))


@pytest.mark.parametrize("unit", UNITS)
def test_a_rows_result_does_not_depend_on_its_neighbours(unit: DotUnit) -> None:
    """Each output row comes from its own x row alone, at any row count on the unit and in any place of a tile."""
    gemm, _, dot = _packed(unit, _q4_1_weight(96, 576, seed=4))
    x = torch.randn(300, 576)
    whole = gemm.linear(x, dot, None)
    for rows in (slice(0, 9), slice(5, 21), slice(100, 164), slice(290, 300)):
        _assert_same_bits(gemm.linear(x[rows], dot, None), whole[rows])


@pytest.mark.parametrize("unit", UNITS)
def test_edge_groups_stay_float32_accurate(unit: DotUnit) -> None:
    """Zero steps, float16-subnormal and largest steps, tiny and large offsets; x from 1e-30 to 1e30 (VNNI: also
    rows under the 2^-100 a group's step stops at, and zero rows)."""
    gen = torch.Generator().manual_seed(3)
    d, m, q = _edge_weight(41, 4, gen)
    d[0:4] = 0.0
    d[4:8] = torch.tensor(5.96e-08).half()
    d[8:12] = torch.tensor(1e-6).half()
    d[12:16] = torch.tensor(65504.0).half()
    m[16:20] = torch.tensor(3e-7).half()
    m[20:24] = torch.tensor(-2.0).half()
    w = _grouped(d, m, q)
    gemm, plain, dot = _packed(unit, w)
    x = torch.randn(20, 4 * 32, generator=gen)
    x[0, :3] = torch.tensor([1e30, -1e-30, 0.0])
    x[1] *= 1e-30
    x[2] *= 1e20
    if unit.x_bits:
        x[3] *= 1e-38
        x[4] = 0.0
    got, want = gemm.linear(x, dot, None), gemm.linear(x, plain, None)
    for row in range(20):  # each row against its own scale
        _assert_float32_accurate(unit, got[row : row + 1], want[row : row + 1], x[row : row + 1], w)


@pytest.mark.parametrize("unit", UNITS)
def test_non_finite_inputs_give_non_finite_rows(unit: DotUnit) -> None:
    """A NaN or inf in x: that row is not finite (NaN where the float32 layout may say +-inf); the others are
    untouched."""
    gemm, plain, dot = _packed(unit, _q4_1_weight(30, 64, seed=5))
    x = torch.randn(17, 64)
    clean = gemm.linear(x, dot, None)
    x[0, 5], x[1, 9], x[2, 40] = float("nan"), float("inf"), -float("inf")
    got, want = gemm.linear(x, dot, None), gemm.linear(x, plain, None)
    assert not got[:3].isfinite().any() and not want[:3].isfinite().any()
    _assert_same_bits(got[3:], clean[3:])


@pytest.mark.skipif(not AMX.available(), reason="AMX tiles: the amx tier only")
def test_amx_tiles_are_configured_again_after_other_users() -> None:
    """The bfloat16 AMX GEMM and oneDNN set other tile shapes in the same threads between the codes' calls."""
    gemm, plain, amx = _packed(AMX, _q4_1_weight(96, 64, seed=6))
    [bf16] = gemm.pack_all([torch.randn(70, 64).bfloat16()])
    x = torch.randn(40, 64)
    first = gemm.linear(x, amx, None)
    for m in (16, 9, 33):
        gemm.linear(torch.randn(m, 64).bfloat16(), bf16, None)
        torch.nn.functional.linear(torch.randn(33, 256).bfloat16(), torch.randn(70, 256).bfloat16())
        _assert_same_bits(gemm.linear(x[:m], amx, None), first[:m])


@pytest.mark.parametrize("unit", UNITS)
def test_the_engines_choice_and_the_tier_decide(unit: DotUnit) -> None:
    """pack_weights puts the codes on the unit only where the engine allows it (cpu_<unit>_float32) and the library
    has the unit; a library without it multiplies them with its FMA tiles, whatever the engine asks."""
    w = _q4_1_weight(24, 64, seed=9)
    if unit.tier is not None:  # not the library the engine loads by default: the same choice through pack_all
        [on], [off] = unit.pack(unit.library(), [w], [True]), unit.library().pack_all([w], compact=[True])
    else:
        kernels = load_cpu_kernels(native_tier(), torch.float32)
        assert kernels.gemm is not None and getattr(kernels, f"{unit.name}_float32")
        [on] = pack_weights([w], kernels)
        [off] = pack_weights([w], dataclasses.replace(kernels, **{f"{unit.name}_float32": False}))
    assert unit.on_unit(on) and off.codes4 and not unit.on_unit(off)
    [lower] = unit.pack(unit.lower(), [w], [True])
    assert lower.codes4 and not unit.on_unit(lower)


@pytest.mark.parametrize("unit", UNITS)
def test_the_start_up_line_says_which_codes_run_on_the_unit(unit: DotUnit) -> None:
    w = _q4_1_weight(24, 64, seed=10)
    gemm = unit.library()
    model = torch.nn.Sequential(torch.nn.Module(), torch.nn.Module())
    model[0].packed_weight, model[1].packed_weight = unit.pack(gemm, [w, w], [True, True])
    line = codes_summary(model)
    assert line is not None and "2 of 2 linear layers" in line and f"2 of them {unit.start_up}" in line, line
    model[0].packed_weight, model[1].packed_weight = gemm.pack_all([w, w], compact=[True, False])
    line = codes_summary(model)
    assert line is not None and "1 of 2 linear layers" in line and "the same outputs" in line, line

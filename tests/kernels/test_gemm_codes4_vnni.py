"""The float32 GEMM over 4-bit codes through vpdpbusd (folio/kernels/gemm_codes4_vnni.h, cpu_vnni_float32), in a
library built with AVX512-VNNI and without AMX (this CPU's own tier, where it has them): x rounded to a 22-bit fixed
point per row and group of 32 k, exact integer products and sums, float32 after; so each result is held to the
float32 layout's own error against a float64 product plus that rounding, not to its bits. One vector tile of rows
or fewer keeps the float32 layout's bits; a row's result does not depend on the rows beside it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from folio.kernels.cpu_build import native_tier
from folio.kernels.cpu_gemm import CpuGemm, PackedWeight
from folio.kernels.cpu_kernels import load_cpu_kernels
from folio.kernels.isa import IsaTier
from folio.model.layers.cpu_gemm import codes_summary, pack_weights
from tests.kernels.test_gemm_codes4 import _assert_same_bits, _edge_weight, _gemm, _grouped, _q4_1_weight


def _native_has_vnni() -> bool:
    return native_tier() >= IsaTier.AVX512 and _gemm(native_tier()).codes4_has_vnni


pytestmark = pytest.mark.skipif(not _native_has_vnni(), reason="a native library with AVX512-VNNI and without AMX")


def _packed(w: torch.Tensor) -> tuple[CpuGemm, PackedWeight, PackedWeight]:
    """The native library, w in the float32 layout, and w as codes multiplied through vpdpbusd."""
    gemm = _gemm(native_tier())
    [plain] = gemm.pack_all([w])
    [vnni] = gemm.pack_all([w], compact=[True], vnni_float32=True)
    assert vnni.codes4 and vnni.codes4_vnni
    return gemm, plain, vnni


def _assert_float32_accurate(got: torch.Tensor, plain: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Each of got's errors against the float64 product at most twice the float32 layout's worst, plus eight
    float32 roundings of |x| . (|w| + 2 |m|) (m the group's offset, its minimum: the group sums of x times m and
    of x times the codes each round once in float32), plus x's rounding: half a step of 2^-22 of the power of two
    above its group's largest |x| (at least 2^-100), times |w|."""
    reference = x.double() @ w.double().T
    offsets = w.double().reshape(w.shape[0], -1, 32).amin(-1, keepdim=True).abs().expand(-1, -1, 32)
    magnitude = x.double().abs() @ (w.double().abs() + 2 * offsets.reshape(w.shape)).T
    group_max = x.double().abs().reshape(x.shape[0], -1, 32).amax(-1, keepdim=True).clamp(min=2.0**-100)
    rounding = (2.0**-22 * group_max.expand(-1, -1, 32).reshape(x.shape)) @ w.double().abs().T
    allowed = 2 * (plain.double() - reference).abs().max() + 8 * 2.0**-24 * magnitude + rounding
    excess = (got.double() - reference).abs() - allowed
    assert excess.max().item() <= 0, (excess.argmax().item(), excess.max().item())


def test_exact_wherever_the_float32_result_is_exact() -> None:
    """x of 18 significant bits, one per group of 32 in each row (so its group's fixed point holds it exactly),
    and steps and offsets that are powers of two: every product and sum is exact in float32, so both paths give
    the float64 product exactly. A limb of x left out, or a group's step or offset misapplied, shows at once."""
    gen = torch.Generator().manual_seed(12)
    n, groups, m = 50, 2, 24
    q = torch.randint(0, 16, (n, groups, 32), generator=gen)
    q[:, :, 0], q[:, :, 1] = 0, 15
    d = torch.full((n, groups), 2.0**-3).half()
    offset = torch.full((n, groups), -1.0).half()
    w = _grouped(d, offset, q)
    gemm, plain, vnni = _packed(w)
    mantissa = (2**17 + torch.randint(0, 2**17, (m, groups), generator=gen)).double() * 2.0**-17
    signs = torch.randint(0, 2, (m, groups), generator=gen).double() * 2 - 1
    x = torch.zeros(m, groups * 32, dtype=torch.float64)
    where = torch.randint(0, 32, (m, groups), generator=gen) + 32 * torch.arange(groups)
    x.scatter_(1, where, mantissa * signs)
    exact = (x @ w.double().T).float()
    _assert_same_bits(gemm.linear(x.float(), vnni, None), exact)
    _assert_same_bits(gemm.linear(x.float(), plain, None), exact)


SHAPES = [
    (9, 100, 64),  # the fewest rows through vpdpbusd: a one-row tile, a column past a block
    (16, 48, 32),  # one block, one group
    (17, 49, 96),
    (64, 3072, 576),  # gate|up at W1's decode batch
    (64, 576, 1536),  # down
    (40, 7, 64),  # fewer columns than a vector
    (300, 200, 64),  # two chunks of rows
]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_codes_through_vnni_are_float32_accurate(m: int, n: int, k: int) -> None:
    w = _q4_1_weight(n, k, seed=m * 31 + n)
    gemm, plain, vnni = _packed(w)
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)  # inputs over six decades
    bias = torch.randn(n, generator=gen)
    _assert_float32_accurate(gemm.linear(x, vnni, None), gemm.linear(x, plain, None), x, w)
    _assert_same_bits(gemm.linear(x, vnni, bias), gemm.linear(x, vnni, None) + bias)
    bf16 = gemm.linear(x, vnni, None, torch.bfloat16).float()
    torch.testing.assert_close(bf16, gemm.linear(x, vnni, None).to(torch.bfloat16).float(), rtol=0, atol=0)
    strided = torch.randn(m, k + 32, generator=gen)[:, 16 : 16 + k]  # rows k + 32 apart
    _assert_same_bits(gemm.linear(strided, vnni, None), gemm.linear(strided.contiguous(), vnni, None))


def test_outliers_in_a_group_cost_only_their_groups_digits() -> None:
    """One input in 97 forty times the others: the groups holding one round the rest more coarsely, within the
    bound; a group without one keeps its own fine step."""
    w = _q4_1_weight(96, 576, seed=21)
    gemm, plain, vnni = _packed(w)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(21))
    x.view(-1)[::97] *= 40
    _assert_float32_accurate(gemm.linear(x, vnni, None), gemm.linear(x, plain, None), x, w)


def test_one_vector_tile_of_rows_keeps_the_float32_bits() -> None:
    gemm, plain, vnni = _packed(_q4_1_weight(150, 128, seed=3))
    for m in (1, 5, 8):
        x = torch.randn(m, 128)
        _assert_same_bits(gemm.linear(x, vnni, None), gemm.linear(x, plain, None))


def test_a_rows_result_does_not_depend_on_its_neighbours() -> None:
    """Each output row comes from its own x row alone, at any row count and in either place of a row tile."""
    gemm, _, vnni = _packed(_q4_1_weight(96, 576, seed=4))
    x = torch.randn(300, 576)
    whole = gemm.linear(x, vnni, None)
    for rows in (slice(0, 9), slice(5, 21), slice(100, 164), slice(290, 300)):
        _assert_same_bits(gemm.linear(x[rows], vnni, None), whole[rows])


def test_edge_groups_stay_float32_accurate() -> None:
    """Zero steps, float16-subnormal and largest steps, tiny and large offsets; x from 1e-38 to 1e30, zero rows."""
    gen = torch.Generator().manual_seed(3)
    d, m, q = _edge_weight(41, 4, gen)
    d[0:4] = 0.0
    d[4:8] = torch.tensor(5.96e-08).half()
    d[8:12] = torch.tensor(1e-6).half()
    d[12:16] = torch.tensor(65504.0).half()
    m[16:20] = torch.tensor(3e-7).half()
    m[20:24] = torch.tensor(-2.0).half()
    w = _grouped(d, m, q)
    gemm, plain, vnni = _packed(w)
    x = torch.randn(20, 4 * 32, generator=gen)
    x[0, :3] = torch.tensor([1e30, -1e-30, 0.0])
    x[1] *= 1e-30
    x[2] *= 1e20
    x[3] *= 1e-38  # below the 2^-100 a group's step stops at
    x[4] = 0.0
    got, want = gemm.linear(x, vnni, None), gemm.linear(x, plain, None)
    for row in range(20):  # each row against its own scale
        _assert_float32_accurate(got[row : row + 1], want[row : row + 1], x[row : row + 1], w)
    assert (got[4] == 0).all()


def test_non_finite_inputs_give_non_finite_rows() -> None:
    """A NaN or inf in x: that row is not finite (NaN where the float32 layout may say +-inf); the others are
    untouched."""
    gemm, plain, vnni = _packed(_q4_1_weight(30, 64, seed=5))
    x = torch.randn(17, 64)
    clean = gemm.linear(x, vnni, None)
    x[0, 5], x[1, 9], x[2, 40] = float("nan"), float("inf"), -float("inf")
    got, want = gemm.linear(x, vnni, None), gemm.linear(x, plain, None)
    assert not got[:3].isfinite().any() and not want[:3].isfinite().any()
    _assert_same_bits(got[3:], clean[3:])


def test_the_engines_choice_and_the_tier_decide() -> None:
    """pack_weights sends the codes through vpdpbusd only where the engine allows it (cpu_vnni_float32) and the
    library has VNNI; a library built for the generic AVX-512 level multiplies them with its FMA tiles."""
    kernels = load_cpu_kernels(native_tier(), torch.float32)
    assert kernels.gemm is not None and kernels.vnni_float32
    w = _q4_1_weight(24, 64, seed=9)
    [on] = pack_weights([w], kernels)
    [off] = pack_weights([w], dataclasses.replace(kernels, vnni_float32=False))
    assert on.codes4_vnni and off.codes4 and not off.codes4_vnni
    [lower] = _gemm(IsaTier.AVX512).pack_all([w], compact=[True], vnni_float32=True)
    assert lower.codes4 and not lower.codes4_vnni


def test_the_start_up_line_says_which_codes_run_through_vnni() -> None:
    w = _q4_1_weight(24, 64, seed=10)
    gemm = _gemm(native_tier())
    model = torch.nn.Sequential(torch.nn.Module(), torch.nn.Module())
    model[0].packed_weight, model[1].packed_weight = gemm.pack_all([w, w], compact=[True, True], vnni_float32=True)
    line = codes_summary(model)
    assert line is not None and "2 of 2 linear layers" in line and "2 of them through vpdpbusd" in line, line
    model[0].packed_weight, model[1].packed_weight = gemm.pack_all([w, w], compact=[True, False])
    line = codes_summary(model)
    assert line is not None and "1 of 2 linear layers" in line and "the same outputs" in line, line

"""The float32 greedy LM head screened in bfloat16 (folio/kernels/gemm_argmax_screen.h): the same token as the
float32 arg-max, ties and near-ties included, on every tier this CPU can run.

The screen needs vdpbf16ps: on the avx512_bf16 tier the kernel must screen (status 0) and give exactly the ids of
the float32 arg-max (folio_gemm_argmax_f32) and of torch.argmax over the float32 GEMM's logits; below it the
library says it has no screen (-2) and ``argmax`` with a screen gives the float32 path's ids. Inputs the bound
cannot cover (NaN, huge norms) and candidate lists that overflow must take the exact path (status 1).
"""

from __future__ import annotations

import pytest
import torch

from folio.kernels.cpu_gemm import ArgmaxScreen, CpuGemm, PackedWeight
from folio.kernels.isa import IsaTier
from tests.kernels.libraries import gemm_library as _gemm


def _head(gemm: CpuGemm, w: torch.Tensor) -> tuple[PackedWeight, ArgmaxScreen]:
    [packed] = gemm.pack_all([w])
    screen = gemm.build_screen(w)
    assert screen is not None
    return packed, screen


def _expect(
    gemm: CpuGemm, tier: IsaTier, x: torch.Tensor, w: torch.Tensor, status: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Screened ids == the float32 arg-max's == torch.argmax of the float32 GEMM's logits (first of equals);
    the screen's status is `status` on avx512_bf16 and -2 below it. Returns (ids, logits)."""
    packed, screen = _head(gemm, w)
    exact = gemm.argmax(x, packed)
    assert exact is not None
    logits = gemm.linear(x, packed, None, out_dtype=torch.float32)
    got, got_status = gemm.screened_argmax(x, packed, screen)
    if tier < IsaTier.AVX512_BF16:
        assert got_status == -2 and got is None
        got = gemm.argmax(x, packed, screen)  # falls back to the float32 path
    else:
        assert got_status == status
    assert got is not None
    assert torch.equal(got, exact)
    finite = logits.nan_to_num(nan=-float("inf"))
    if finite.isfinite().any(dim=1).all():
        assert torch.equal(got, finite.argmax(dim=1))
    return got, logits


@pytest.mark.parametrize(("m", "n", "k"), [(1, 49, 16), (7, 1001, 64), (64, 4801, 576), (256, 97, 130)])
def test_screened_ids_are_the_float32_ids(cpu_tier: IsaTier, m: int, n: int, k: int) -> None:
    torch.manual_seed(m * n + k)
    w = torch.randn(n, k) * 0.05
    x = torch.randn(m, k) * 3.0
    _expect(_gemm(cpu_tier), cpu_tier, x, w)


def test_ties_pick_the_first_column_across_blocks_and_threads(cpu_tier: IsaTier) -> None:
    torch.manual_seed(1)
    w = torch.randn(3000, 96) * 0.05
    w[2950] = w[5]  # identical rows in the first and the last block: equal float32 logits
    w[1500] = w[5]
    x = torch.stack([w[5] * 40.0, w[2950] * 40.0 + torch.randn(96) * 1e-3])
    ids, logits = _expect(_gemm(cpu_tier), cpu_tier, x, w)
    assert logits[0, 5] == logits[0, 2950] == logits[0, 1500] and ids[0].item() == 5


def test_near_ties_that_bfloat16_cannot_tell_apart(cpu_tier: IsaTier) -> None:
    """Rows that differ below bfloat16's precision: the screen sees them equal, the float32 rescore must not."""
    torch.manual_seed(2)
    k = 128
    base = torch.randn(k) * 0.05
    w = torch.randn(2000, k) * 0.01
    for i, col in enumerate((100, 900, 1700, 1999)):
        w[col] = base * (1.0 + (i - 1.5) * 2e-6)  # largest at 1999, the last column
    x = torch.stack([base * 50.0, -base * 50.0, base * 50.0 + torch.randn(k) * 1e-4])
    ids, logits = _expect(_gemm(cpu_tier), cpu_tier, x, w)
    assert ids[0].item() == 1999 and logits[0, 1999] > logits[0, 1700]
    assert (w.bfloat16()[1700] == w.bfloat16()[1999]).all()  # truly invisible to bfloat16


def test_zero_x_every_column_ties(cpu_tier: IsaTier) -> None:
    gemm = _gemm(cpu_tier)
    ids, _ = _expect(gemm, cpu_tier, torch.zeros(3, 64), torch.randn(1000, 64))
    assert ids.tolist() == [0, 0, 0]
    # 5000 candidates per row overflow the candidate slots: the exact path answers
    ids, _ = _expect(gemm, cpu_tier, torch.zeros(3, 64), torch.randn(5000, 64), status=1)
    assert ids.tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "fill",
    [float("nan"), float("inf"), 1e35, 1e-40],  # NaN, inf and 1e35 leave the bound; 1e-40 is subnormal
    ids=["nan", "inf", "huge", "subnormal"],
)
def test_extreme_rows(cpu_tier: IsaTier, fill: float) -> None:
    torch.manual_seed(3)
    w = torch.randn(700, 32) * 0.1
    x = torch.randn(4, 32)
    x[1, 3] = fill
    status = 0 if fill == 1e-40 else 1
    _expect(_gemm(cpu_tier), cpu_tier, x, w, status=status)


def test_no_screen_for_what_it_cannot_cover() -> None:
    gemm = _gemm(IsaTier.GENERIC)
    assert gemm.build_screen(torch.randn(10, 7)) is None  # odd k: the bfloat16 tiles read x in pairs
    assert gemm.build_screen(torch.randn(10, 8).bfloat16()) is None  # a bfloat16 head needs no screen
    for bad in (float("inf"), float("-inf"), float("nan")):
        w = torch.randn(10, 8)
        w[2, 2] = bad
        assert gemm.build_screen(w) is None, bad


def test_the_screens_bounds_are_the_float64_ones_rounded_up() -> None:
    """Row norms summed in float64 a slice of rows at a time, over more rows than one slice, and the largest
    magnitude (a negative entry here): exactly what the whole weight widened to float64 gives."""
    w = torch.randn(9000, 64, generator=torch.Generator().manual_seed(3)) * 1e20
    w[7000, 5] = -1e25
    screen = _gemm(IsaTier.GENERIC).build_screen(w)
    assert screen is not None
    wide = w.double()
    assert torch.equal(screen.w_norm, (wide.norm(dim=1) * (1 + 1e-6)).float())
    assert float(wide.abs().max()) == -float(w[7000, 5])  # the largest magnitude is the negative entry
    assert screen.w_abs_max == float(wide.abs().max()) * (1 + 1e-6)


def test_more_rows_than_a_chunk_is_not_run(cpu_tier: IsaTier) -> None:
    gemm = _gemm(cpu_tier)
    w = torch.randn(100, 32)
    packed, screen = _head(gemm, w)
    got, status = gemm.screened_argmax(torch.randn(257, 32), packed, screen)
    assert got is None and status == (-1 if cpu_tier >= IsaTier.AVX512_BF16 else -2)

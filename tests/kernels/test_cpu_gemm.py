"""Folio's CPU GEMM (folio/kernels/cpu_gemm.c) against a float64 matmul of the same numbers, on every ISA tier.

Each test runs once per tier this CPU can run (the ``cpu_tier`` fixture: generic, avx2, avx512, avx512_bf16, amx),
on that tier's GEMM body whether or not the engine's plan chooses it there: plain C, AVX2 tiles of 4 rows x 24
columns, AVX-512 tiles of 8 rows x 48 columns; bfloat16 widened to float32 in registers below avx512_bf16, through
vdpbf16ps on it, and through AMX tiles of 16 rows x 48 columns on amx (K tails below 32 copied beside zeros).
Shapes cross every edge of those tiles: row counts around the tile rows and the 256-row chunks, output widths that
are not a multiple of the blocks or the vector width, odd K (float32), K not a multiple of 8, strided inputs,
bias, both output dtypes, extreme values.
"""

from __future__ import annotations

import pytest
import torch

from folio.kernels.cpu_gemm import CpuGemm
from folio.kernels.isa import IsaTier
from tests.kernels.libraries import gemm_library as _gemm


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


def _check(gemm: CpuGemm, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """float32 output within float32 summation error of the float64 product; the x dtype's output is the float32
    one rounded once."""
    m, k = x.shape
    [packed] = gemm.pack_all([w])
    got32 = gemm.linear(x, packed, bias, out_dtype=torch.float32)
    assert got32.shape == (m, w.shape[0]) and got32.dtype == torch.float32
    # products of bf16 or f32 numbers summed in float32: float32 accumulation error only
    torch.testing.assert_close(got32.double(), _reference(x, w, bias), rtol=1e-5, atol=1e-4 * k**0.5)
    got = gemm.linear(x, packed, bias)
    assert got.dtype == x.dtype
    if x.dtype == torch.bfloat16:  # one rounding of the float32 result, as torch rounds (nearest even)
        torch.testing.assert_close(got, got32.to(torch.bfloat16), rtol=0, atol=0)


SHAPES = [
    (1, 48, 64),
    (3, 7, 32),  # fewer columns than one vector
    (5, 25, 40),  # one column past an AVX2 block; 5 rows: one 4-row tile + 1
    (8, 100, 96),
    (9, 960, 576),  # the q|k|v projection
    (13, 47, 18),  # K not a multiple of 8, a column short of an AVX-512 block
    (64, 576, 1536),  # the down projection, W1's decode batch
    (257, 50, 40),  # one row past a chunk
    (300, 145, 18),
    (777, 150, 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(
    cpu_tier: IsaTier, dtype: torch.dtype, m: int, n: int, k: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    _check(_gemm(cpu_tier), x, w, bias)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 1), (6, 30, 33), (11, 97, 575)])
def test_odd_k_float32(cpu_tier: IsaTier, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    _check(_gemm(cpu_tier), torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_values(cpu_tier: IsaTier, dtype: torch.dtype) -> None:
    """Large magnitudes (products near 1e36, sums near 1e37: float32 only, no overflow), tiny ones, exact zeros."""
    gen = torch.Generator().manual_seed(3)
    k = 64
    w = torch.randn(50, k, generator=gen) * 1e18
    x = torch.randn(6, k, generator=gen) * 1e18
    x[1] *= 1e-36  # products near 1: the sums keep their relative precision
    x[2] = 0.0  # a row of zeros: exactly 0 in every column
    w[7] = 0.0
    w, x = w.to(dtype), x.to(dtype)
    gemm = _gemm(cpu_tier)
    [packed] = gemm.pack_all([w])
    got = gemm.linear(x, packed, None, out_dtype=torch.float32).double()
    expected = _reference(x, w, None)
    assert torch.isfinite(got).all()
    assert (got[2] == 0).all() and (got[:, 7] == 0).all()
    for row in (0, 1, 3):  # relative to the row's scale: float32 summation error
        scale = expected[row].abs().max()
        torch.testing.assert_close(got[row] / scale, expected[row] / scale, rtol=0, atol=1e-5)
    if dtype == torch.bfloat16:
        out = gemm.linear(x, packed, None)
        torch.testing.assert_close(out, got.float().to(torch.bfloat16), rtol=0, atol=0)


def test_strided_rows_and_several_weights_in_one_arena(cpu_tier: IsaTier) -> None:
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(n, 64, generator=gen) for n in (48, 49, 200, 23)]
    gemm = _gemm(cpu_tier)
    packed = gemm.pack_all(weights)
    wide = torch.randn(5, 100, generator=gen)
    x = wide[:, 10:74]  # rows 100 elements apart
    for w, p in zip(weights, packed, strict=True):
        torch.testing.assert_close(gemm.linear(x, p, None).double(), _reference(x, w, None), rtol=1e-5, atol=1e-4)


def test_odd_k_bfloat16_is_not_supported(cpu_tier: IsaTier) -> None:
    assert not CpuGemm.supports(torch.empty(4, 3, dtype=torch.bfloat16))
    assert CpuGemm.supports(torch.empty(4, 3, dtype=torch.float32))
    with pytest.raises(ValueError, match="cannot pack"):
        _gemm(cpu_tier).pack_all([torch.empty(4, 4, dtype=torch.bfloat16), torch.empty(4, 4)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n"), [(1, 48), (5, 1000), (64, 49152), (9, 7), (13, 25)])
def test_argmax_equals_torch_argmax_of_the_product(cpu_tier: IsaTier, dtype: torch.dtype, m: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, 64, generator=gen).to(dtype)
    x = torch.randn(m, 64, generator=gen).to(dtype)
    gemm = _gemm(cpu_tier)
    [packed] = gemm.pack_all([w])
    ids = gemm.argmax(x, packed)
    assert ids is not None and ids.dtype == torch.int64
    assert ids.tolist() == gemm.linear(x, packed, None, out_dtype=torch.float32).argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_takes_the_first_of_equal_maxima(cpu_tier: IsaTier, dtype: torch.dtype) -> None:
    w = torch.zeros(200, 32)
    # columns that tie for the maximum: in one lane (17, 33: 16 apart), in one vector (17, 18), in other blocks
    w[[18, 33, 90, 150, 199], 0] = 1.0
    w[17, 0] = 1.0
    x = torch.zeros(2, 32)
    x[:, 0] = 2.0
    w, x = w.to(dtype), x.to(dtype)
    gemm = _gemm(cpu_tier)
    [packed] = gemm.pack_all([w])
    assert gemm.argmax(x, packed).tolist() == [17, 17]  # type: ignore[union-attr]
    w[17, 0] = 0.0  # now 18 is the first
    [packed] = gemm.pack_all([w])
    assert gemm.argmax(x, packed).tolist() == [18, 18]  # type: ignore[union-attr]
    assert gemm.argmax(torch.zeros(300, 32, dtype=dtype), packed) is None  # more rows than a chunk: logits path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_never_chooses_nan_and_takes_inf(cpu_tier: IsaTier, dtype: torch.dtype) -> None:
    """Row 0: random, with NaN columns; row 1: -inf in every column (float32 overflow), NaN in some; row 2: NaN
    in every column; row 3: one column +inf. torch.argmax would pick a NaN; the kernel never does,
    and a row without a number gives column 0 (as torch.argmax of a row of equal values)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 130, 32
    w = torch.randn(n, k, generator=gen)
    x = torch.zeros(4, k)
    x[0, 7:] = torch.randn(k - 7, generator=gen)
    w[[5, 60, 129], 1] = float("nan")  # 0 * NaN: NaN in every row at these columns
    w[:, 0], x[1, 0] = -3e38, 10.0  # overflows to -inf
    x[2, 3] = float("nan")
    w[100, 6], x[3, 6] = 3e38, 10.0  # column 100 of row 3 overflows to +inf
    x[3, 8] = 1.0
    w, x = w.to(dtype), x.to(dtype)
    gemm = _gemm(cpu_tier)
    [packed] = gemm.pack_all([w])
    logits = gemm.linear(x, packed, None, out_dtype=torch.float32)
    assert logits[:, [5, 60, 129]].isnan().all() and logits[2].isnan().all()
    assert (logits[1].isnan() | (logits[1] == float("-inf"))).all() and logits[3, 100] == float("inf")
    ids = gemm.argmax(x, packed)
    assert ids is not None
    real = logits.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    assert ids.tolist() == [real[0].argmax().item(), 0, 0, 100]


def test_each_gemm_configures_the_tiles_again_after_other_users(cpu_tier: IsaTier) -> None:
    """On the amx tier a thread's tile configuration outlives a GEMM, and oneDNN (torch's bfloat16 linear on an
    AMX CPU) sets its own in the same threads between ours: every GEMM configures the tiles again. Row counts
    alternate between full 16-row tiles and short ones (each a configuration of its own)."""
    gen = torch.Generator().manual_seed(5)
    gemm = _gemm(cpu_tier)
    w = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    [packed] = gemm.pack_all([w])
    other_x, other_w = torch.randn(33, 256, generator=gen), torch.randn(70, 256, generator=gen)
    for m in (16, 5, 16, 300, 5):
        torch.nn.functional.linear(other_x.to(torch.bfloat16), other_w.to(torch.bfloat16))
        x = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
        got = gemm.linear(x, packed, None, out_dtype=torch.float32).double()
        torch.testing.assert_close(got, _reference(x, w, None), rtol=1e-5, atol=1e-3)

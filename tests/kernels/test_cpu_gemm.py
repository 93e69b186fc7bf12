"""Folio's CPU GEMM (folio/kernels/cpu_gemm.c) against a float64 matmul of the same numbers.

Shapes cross every edge of the kernel: row counts around its 8-row tiles and 256-row chunks, output widths that
are not a multiple of its 48-column blocks, odd K (float32), strided inputs, bias, and both output dtypes.
"""

from __future__ import annotations

import pytest
import torch

from folio.kernels.cpu_gemm import CpuGemm, load_cpu_gemm


def _gemm() -> CpuGemm:
    gemm = load_cpu_gemm()
    assert gemm is not None, "the GEMM must build here (gcc is part of this machine and of CI)"
    return gemm


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 48, 64),
        (3, 7, 32),
        (8, 100, 96),
        (9, 960, 576),
        (64, 576, 1536),
        (257, 50, 40),
        (300, 145, 18),
        (777, 150, 64),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(dtype: torch.dtype, m: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    gemm = _gemm()
    [packed] = gemm.pack_all([w])
    expected = _reference(x, w, bias)
    got32 = gemm.linear(x, packed, bias, out_dtype=torch.float32)
    assert got32.shape == (m, n) and got32.dtype == torch.float32
    # products of bf16 or f32 numbers summed in float32: float32 accumulation error only
    torch.testing.assert_close(got32.double(), expected, rtol=1e-5, atol=1e-4 * k**0.5)
    got = gemm.linear(x, packed, bias)
    assert got.dtype == dtype
    if dtype == torch.bfloat16:  # one rounding of the float32 result
        torch.testing.assert_close(got, got32.to(torch.bfloat16), rtol=0, atol=0)


def test_strided_rows_and_several_weights_in_one_arena() -> None:
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(n, 64, generator=gen) for n in (48, 49, 200)]
    gemm = _gemm()
    packed = gemm.pack_all(weights)
    wide = torch.randn(5, 100, generator=gen)
    x = wide[:, 10:74]  # rows 100 elements apart
    for w, p in zip(weights, packed, strict=True):
        torch.testing.assert_close(gemm.linear(x, p, None).double(), _reference(x, w, None), rtol=1e-5, atol=1e-4)


def test_odd_k_bfloat16_is_not_supported() -> None:
    assert not CpuGemm.supports(torch.empty(4, 3, dtype=torch.bfloat16))
    assert CpuGemm.supports(torch.empty(4, 3, dtype=torch.float32))
    with pytest.raises(ValueError, match="cannot pack"):
        _gemm().pack_all([torch.empty(4, 4, dtype=torch.bfloat16), torch.empty(4, 4)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n"), [(1, 48), (5, 1000), (64, 49152), (9, 7)])
def test_argmax_equals_torch_argmax_of_the_product(dtype: torch.dtype, m: int, n: int) -> None:
    gen = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, 64, generator=gen).to(dtype)
    x = torch.randn(m, 64, generator=gen).to(dtype)
    gemm = _gemm()
    [packed] = gemm.pack_all([w])
    ids = gemm.argmax(x, packed)
    assert ids is not None and ids.dtype == torch.int64
    assert ids.tolist() == gemm.linear(x, packed, None, out_dtype=torch.float32).argmax(dim=-1).tolist()


def test_argmax_takes_the_first_of_equal_maxima() -> None:
    w = torch.zeros(200, 32)
    w[[17, 90, 150], 0] = 1.0  # three columns tie for the maximum; torch.argmax picks the first
    x = torch.zeros(2, 32)
    x[:, 0] = 2.0
    gemm = _gemm()
    [packed] = gemm.pack_all([w])
    assert gemm.argmax(x, packed) is not None
    assert gemm.argmax(x, packed).tolist() == [17, 17]  # type: ignore[union-attr]
    assert gemm.argmax(torch.zeros(300, 32), packed) is None  # more rows than one chunk: the caller's logits path

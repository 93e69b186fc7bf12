"""The greedy LM head over 8-bit codes screened in integers: int16 on AVX2 (folio/kernels/gemm_codes8_screen.h),
int8 through vpdpbusd where the library has AVX512-VNNI and no AMX (gemm_codes8_screen_vnni.h). The same token as
the float32 arg-max, ties and near-ties included, on every tier this CPU can run.

Where the library has a screen the kernel must screen (status 0) and give exactly the ids of the 8-bit codes'
float32 arg-max (folio_gemm_argmax_codes8), of the float32 layout's (folio_gemm_argmax_f32) and of torch.argmax
over the float32 GEMM's logits; elsewhere the library says it has no screen (-2). The int8 screen leaves one row
tile (8 rows) or fewer to the codes' arg-max in registers (-1), so the tests of its behaviour run 9 rows or more.
Rows the bound cannot cover (NaN, inf, huge or all-zero rows) and candidate lists that overflow take the exact
path (1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from folio.kernels.cpu_gemm import Codes8Head, CpuGemm
from folio.kernels.isa import IsaTier
from folio.model.gguf_dequant import dequantize_to_float32
from tests.conftest import CPU_TIERS, EXTENDED_LIBRARIES
from tests.kernels.libraries import gemm_library as _gemm


@dataclass(frozen=True)
class Library:
    tier: IsaTier
    extensions: tuple[str, ...] = ()

    @property
    def gemm(self) -> CpuGemm:
        return _gemm(self.tier, self.extensions)

    @property
    def screen(self) -> str | None:
        """The library's screen: "int8" (AVX512-VNNI without AMX), "int16" (AVX2), or None."""
        return "int8" if self.gemm.codes8_has_i8_screen else "int16" if self.tier == IsaTier.AVX2 else None


# every tier, and a lower tier with the extensions this CPU has (tests/conftest.py): avx2+avx_vnni (vpdpwssd in place
# of vpmaddwd + vpaddd, the int16 screen Intel's client cores build), avx512+avx512_vnni (the int8 screen of Cascade
# Lake and Ice Lake, where the native library is AMX's and has none)
LIBRARIES = [Library(tier) for tier in CPU_TIERS] + [Library(tier, ext) for tier, ext in EXTENDED_LIBRARIES]


@pytest.fixture(params=LIBRARIES, ids=lambda lib: "+".join([lib.tier.flag_name, *lib.extensions]))
def library(request: pytest.FixtureRequest) -> Library:
    lib: Library = request.param
    return lib


def _q8_0_weight(n: int, k: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """A float32 [n, k] weight as a GGUF's Q8_0 tensor dequantizes (an int8 code times a float16 step per 32)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * scale
    raw = quantize(w, GGMLQuantizationType.Q8_0)
    return dequantize_to_float32(raw, GGMLQuantizationType.Q8_0, (n, k)).contiguous()


def _head(gemm: CpuGemm, w: torch.Tensor) -> Codes8Head:
    head = gemm.pack_codes8(w)
    assert head is not None, "an exact Q8_0 weight must be kept as codes"
    return head


def _expect(library: Library, x: torch.Tensor, w: torch.Tensor, status: int = 0) -> torch.Tensor:
    """Screened ids (rescored over the codes' blocks widened, and over the float32 layout) == the codes' float32
    arg-max == the float32 layout's == torch.argmax of the float32 GEMM's logits (first of equals, where a row has a
    finite logit); the status is `status` where the library has a screen, -2 elsewhere."""
    gemm = library.gemm
    head = _head(gemm, w)
    assert (head.quads is not None) == (library.screen == "int8")
    got, got_status = gemm.argmax_codes8_screened(x, head)
    if library.screen is None:
        assert got_status == -2 and got is None
        return torch.empty(0)
    if library.screen == "int8" and x.shape[0] <= 8:  # one row tile: the codes' arg-max in registers is faster
        assert got_status == -1 and got is None
        return torch.empty(0)
    assert got_status == status and got is not None
    [plain] = gemm.pack_all([w])
    # the rescore over the float32 layout where given (the engine's tied head), not the codes' blocks widened
    again, again_status = gemm.argmax_codes8_screened(x, head, plain)
    assert again_status == status and again is not None and torch.equal(again, got)
    assert torch.equal(got, gemm.argmax(x, plain))
    assert torch.equal(got, gemm.argmax_codes8(x, head))
    logits = gemm.linear(x, plain, None, out_dtype=torch.float32).nan_to_num(nan=-float("inf"))
    if logits.isfinite().any(dim=1).all():
        assert torch.equal(got, logits.argmax(dim=1))
    return got


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 49, 32), (2, 1001, 64), (3, 100, 96), (5, 4801, 576), (7, 3001, 160), (9, 3001, 160), (17, 100, 96)]
    + [(64, 4801, 576), (256, 97, 64)],
)
def test_screened_ids_are_the_float32_ids(library: Library, m: int, n: int, k: int) -> None:
    """Every row tile (int16: 4 rows in assembly, 1-3 in C; int8: 2 and 1), blocks with a tail of columns, one
    group of k and many."""
    w = _q8_0_weight(n, k, seed=m * n + k, scale=0.05)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3.0
    _expect(library, x, w)


def test_rounding_x_cannot_hide_the_winner(library: Library) -> None:
    """Column A (5) gets x_1 = 10.51 steps times 127/128, column B (100) x_2 = 11.4 steps times 120/128: float32
    says B (10.7 steps against 10.4), but both x round to 11 steps, so the screen's sums say A (11 x 127/128 against
    11 x 120/128). Only the bound's term for rounding x keeps B a candidate; without it the kernel returns A. The
    step: the row's largest |x| (1.0) over 32767 (int16), or its group's over 127 (int8)."""
    k, n = 32, 240
    w = torch.zeros(n, k)
    w[:, 3] = 127 / 128  # every column holds a full code where x is 0: each group's step is exactly 2^-7
    w[:, 0] = -torch.arange(1, n + 1, dtype=torch.float32).remainder(127).add(1) / 128  # the others: below 0
    w[5, 0], w[100, 0] = 0.0, 0.0
    w[5, 1], w[100, 2] = 127 / 128, 120 / 128
    step = float(torch.tensor(1.0) / (127 if library.screen == "int8" else 32767))
    x = torch.zeros(5, k)
    x[:, 0] = 1.0  # the row's largest magnitude: its step is 1 / 32767
    x[:, 1], x[:, 2] = 10.51 * step, 11.4 * step
    x[2:4, 0] = -1.0  # rows 2 and 3: the negative columns win instead
    x = torch.cat([x, x[[0, 1, 4, 0]]])  # 9 rows: the last one a tile of its own (int16: 4 + 4 + 1, int8: 2 x 4 + 1)
    ids = _expect(library, x, w)
    if library.screen is not None:
        assert all(ids[i].item() == 100 for i in (0, 1, 4, 5, 6, 7, 8)), ids


def test_ties_pick_the_first_column_across_blocks_and_threads(library: Library) -> None:
    w = _q8_0_weight(3000, 96, seed=1, scale=0.05)
    w[2950] = w[5]  # identical rows in the first and the last block: equal float32 logits
    w[1500] = w[5]
    x = torch.stack([w[5] * 40.0, w[2950] * 40.0 + torch.randn(96) * 1e-3, w[1500] * 40.0, -w[5]]).repeat(3, 1)
    ids = _expect(library, x, w)
    if library.screen is not None:
        assert ids[0].item() == ids[2].item() == 5


def test_zero_rows_and_overflowing_candidates_take_the_exact_path(library: Library) -> None:
    ids = _expect(library, torch.zeros(9, 64), _q8_0_weight(1000, 64, seed=4), status=1)
    assert ids.numel() == 0 or ids.tolist() == [0] * 9
    # 5000 equal columns: every one is a candidate, more than the slots hold
    w = _q8_0_weight(1, 64, seed=5).expand(5000, 64).contiguous()
    ids = _expect(library, torch.randn(9, 64), w, status=1)
    assert ids.numel() == 0 or ids.tolist() == [0] * 9


@pytest.mark.parametrize(
    ("fill", "status"),
    [(float("nan"), 1), (float("inf"), 1), (1e35, 1), (1e-40, 0)],  # 1e-40 is subnormal: an ordinary row
    ids=["nan", "inf", "huge", "subnormal"],
)
def test_extreme_rows(library: Library, fill: float, status: int) -> None:
    w = _q8_0_weight(700, 32, seed=6, scale=0.1)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(7))
    x[1, 3] = fill
    _expect(library, x, w, status=status)


def test_the_bounds_are_the_float64_ones_rounded_up() -> None:
    """Row L1 norms summed in float64 a slice of rows at a time, over more rows than one slice, and the largest
    magnitude (a negative entry here)."""
    w = _q8_0_weight(9000, 64, seed=8)
    w[7000, :32] = 0.0
    w[7000, 5] = -200.0  # a group of one code: exactly -200 = -127 x (200 / 127)
    head = _head(_gemm(IsaTier.GENERIC), w)
    wide = w.double()
    assert torch.equal(head.col_abs_sum, (wide.abs().sum(dim=1) * (1 + 1e-6)).float())
    assert head.w_abs_max == 200.0 * (1 + 1e-6)


def test_more_rows_than_a_chunk_is_not_run(library: Library) -> None:
    gemm = library.gemm
    head = _head(gemm, _q8_0_weight(100, 32, seed=9))
    got, status = gemm.argmax_codes8_screened(torch.randn(257, 32), head)
    assert got is None and status == (-2 if library.screen is None else -1)
    got, status = gemm.argmax_codes8_screened(torch.randn(3, 32).bfloat16(), head)
    assert got is None and status == -1


def test_outliers_and_zero_groups(library: Library) -> None:
    """W1's hidden states have entries 12x their row's rms: a row here has one 1000x its others, another a group of
    32 zeros between ordinary ones (the int8 screen's step for it is floored at the row's largest |x| times 2^-40),
    and every row tile runs. The same ids as float32, screened."""
    w = _q8_0_weight(4801, 576, seed=11, scale=0.05)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(12))
    x[0, 100] = 1000.0
    x[3, 64:96] = 0.0
    x[4, 5] = -3000.0
    x[4, 300:332] = 1e-30
    _expect(library, x, w)


def test_the_int8_layout_and_group_bounds() -> None:
    """Where a library has the int8 screen: each group's steps as in the 8-bit layout, then for each quad q of k and
    column c the 4 codes of k = 4q .. 4q + 3 plus 128 (vpdpbusd's unsigned operand); the group norms are the float64
    ones rounded up, [group][column] over whole blocks of columns, zero past n."""
    library = next((lib for lib in LIBRARIES if lib.screen == "int8"), None)
    if library is None:
        pytest.skip("no library here has the int8 screen (AVX512-VNNI without AMX)")
    n, k = 100, 96
    w = _q8_0_weight(n, k, seed=13)
    head = _head(library.gemm, w)
    assert head.quads is not None and head.group_abs_sum is not None
    groups, block_n = k // 32, 48  # the int8 screen's libraries are 512-bit: 48 columns a block
    assert head.group_abs_sum.shape == (groups, -(-n // block_n) * block_n)
    group_bytes = block_n * (4 + 32)
    plain = head.data.numpy().reshape(-1, groups, group_bytes)
    quads = head.quads.numpy().reshape(-1, groups, group_bytes)
    assert np.array_equal(plain[:, :, : 4 * block_n], quads[:, :, : 4 * block_n])  # the steps
    codes = plain[:, :, 4 * block_n :].view(np.int8).reshape(-1, groups, 8, 4, block_n)  # [b][g][q][t][c]
    expect = (codes.astype(np.int16) + 128).astype(np.uint8).transpose(0, 1, 2, 4, 3)  # [b][g][q][c][t]
    assert np.array_equal(quads[:, :, 4 * block_n :].reshape(expect.shape), expect)
    norms = w.double().abs().view(n, groups, 32).sum(dim=2)
    assert torch.equal(head.group_abs_sum[:, :n], (norms * (1 + 1e-6)).float().T)
    assert not head.group_abs_sum[:, n:].any()
    assert library.gemm.pack_codes8(w, with_quads=False).quads is None  # type: ignore[union-attr]

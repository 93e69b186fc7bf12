"""Float32 weights kept as 4-bit codes (folio/kernels/gemm_codes4.h) against the same weights in the float32 layout,
on every ISA tier: the same bits out, or the weight refused at packing.

The weights are what a GGUF's Q4_1 tensors dequantize to (gguf's own quantizer, then Folio's dequantizer), and
hand-made groups at the edges: equal values (a zero step), float16-subnormal and huge steps, huge offsets. Row
counts cover the tiles widened in registers (one tile of rows) and the blocks widened once for several tiles, the
256-row chunks; output widths cover partial blocks and vectors; K from one group of 32 to the down projection's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from folio.kernels.cpu_build import native_tier
from folio.kernels.cpu_gemm import CpuGemm, PackedWeight
from folio.kernels.cpu_kernels import load_cpu_kernels
from folio.kernels.isa import IsaTier
from folio.model.gguf_dequant import dequantize_to_float32
from folio.model.layers.cpu_gemm import pack_weights
from tests.kernels.libraries import gemm_library as _gemm


def _q4_1_weight(n: int, k: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """A float32 [n, k] weight as a GGUF file's Q4_1 tensor dequantizes: gguf's quantizer, then Folio's loader."""
    w = (np.random.default_rng(seed).standard_normal((n, k)) * scale).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q4_1)
    return dequantize_to_float32(raw, GGMLQuantizationType.Q4_1, (n, k)).contiguous()


def _grouped(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Weights fl(fl(d q) + m) from float16 steps d [n, G], offsets m [n, G] and codes q [n, G, 32], as ggml."""
    value = q.float() * d.float().unsqueeze(-1)
    return (value + m.float().unsqueeze(-1)).reshape(d.shape[0], -1).contiguous()


def _pack_both(gemm: CpuGemm, w: torch.Tensor) -> tuple[PackedWeight, PackedWeight]:
    plain, codes = gemm.pack_all([w, w], compact=[False, True])
    assert not plain.codes4
    assert codes.codes4, "an exact Q4_1 weight must be kept as codes"
    assert codes.data.numel() < plain.data.numel() * 4 / 5  # 6 bits a weight (and whole blocks) against 32
    return plain, codes


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


SHAPES = [
    (1, 48, 32),  # one group, one AVX-512 block
    (1, 3072, 576),  # gate|up at a decode of one request
    (3, 7, 64),  # fewer columns than a vector
    (4, 25, 96),  # a column past an AVX2 block; one AVX2 tile
    (5, 49, 128),  # a column past an AVX-512 block; two AVX2 tiles: the widened block
    (8, 960, 576),  # q|k|v, one AVX-512 tile
    (9, 100, 64),  # two AVX-512 tiles
    (64, 576, 1536),  # down, W1's decode batch
    (300, 200, 64),  # two chunks of rows
]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_codes_give_the_float32_layouts_bits(cpu_tier: IsaTier, m: int, n: int, k: int) -> None:
    gemm = _gemm(cpu_tier)
    w = _q4_1_weight(n, k, seed=m * 7919 + n)
    plain, codes = _pack_both(gemm, w)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        want = gemm.linear(x, plain, b)
        _assert_same_bits(gemm.linear(x, codes, b), want)
        reference = x.double() @ w.double().T + (0 if b is None else b.double())
        torch.testing.assert_close(want.double(), reference, rtol=1e-5, atol=1e-4 * k**0.5)
    _assert_same_bits(gemm.linear(x, codes, None, torch.bfloat16), gemm.linear(x, plain, None, torch.bfloat16))
    strided = torch.randn(m, k + 32, generator=gen)[:, 16 : 16 + k]  # rows k + 32 apart
    _assert_same_bits(gemm.linear(strided, codes, None), gemm.linear(strided, plain, None))


def _edge_weight(n: int, groups: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = (torch.rand(n, groups, generator=gen) * 0.1).half()
    m = (torch.randn(n, groups, generator=gen) * 0.5).half()
    q = torch.randint(0, 16, (n, groups, 32), generator=gen)
    q[:, :, 0], q[:, :, 1] = 0, 15  # as ggml's quantizer makes them: the group's minimum and maximum codes
    return d, m, q


def test_edge_groups_keep_their_bits(cpu_tier: IsaTier) -> None:
    """Zero steps (equal values), float16 subnormal and largest steps, tiny offsets: kept as codes, same bits."""
    gemm = _gemm(cpu_tier)
    gen = torch.Generator().manual_seed(3)
    d, m, q = _edge_weight(41, 4, gen)
    d[0:4] = 0.0  # every value of the group equal
    d[4:8] = torch.tensor(5.96e-08).half()  # the smallest float16 subnormal
    d[8:12] = torch.tensor(1e-6).half()  # a subnormal float16 step
    d[12:16] = torch.tensor(65504.0).half()  # the largest float16
    m[16:20] = torch.tensor(3e-7).half()
    m[20:24] = torch.tensor(-2.0).half()
    plain, codes = _pack_both(gemm, _grouped(d, m, q))
    for rows in (1, 6, 40):
        x = torch.randn(rows, 4 * 32, generator=gen)
        x[0, :3] = torch.tensor([1e30, -1e-30, 0.0])
        _assert_same_bits(gemm.linear(x, codes, None), gemm.linear(x, plain, None))


def test_offsets_that_swallow_the_steps_still_give_float32_bits(cpu_tier: IsaTier) -> None:
    """An offset so large that fl(d q + m) rounds away most of d q: the step cannot always be told from the
    values, and such a weight may be refused; kept or not, the products are the float32 layout's."""
    gemm = _gemm(cpu_tier)
    gen = torch.Generator().manual_seed(8)
    d, m, q = _edge_weight(9, 2, gen)
    m[:] = torch.tensor(-65504.0).half()
    w = _grouped(d, m, q)
    [plain, maybe] = gemm.pack_all([w, w], compact=[False, True])
    x = torch.randn(5, 64, generator=gen)
    _assert_same_bits(gemm.linear(x, maybe, None), gemm.linear(x, plain, None))


def test_non_finite_inputs_propagate_alike(cpu_tier: IsaTier) -> None:
    gemm = _gemm(cpu_tier)
    plain, codes = _pack_both(gemm, _q4_1_weight(30, 64, seed=5))
    for rows in (2, 17):
        x = torch.randn(rows, 64)
        x[0, 5], x[1, 9] = float("nan"), float("inf")
        _assert_same_bits(gemm.linear(x, codes, None), gemm.linear(x, plain, None))


def _mutated(w: torch.Tensor, how: str) -> torch.Tensor:
    w = w.clone()
    if how == "one ulp":
        w[3, 17] = torch.nextafter(w[3, 17], torch.tensor(float("inf")))
    elif how == "nan":
        w[0, 0] = float("nan")
    elif how == "inf":
        w[5, 40] = float("inf")
    elif how == "seventeen levels":  # a group of 32 values on 17 levels of one step: no 4-bit code reaches them all
        w[1, :32] = torch.arange(32, dtype=torch.float32) % 17 * 0.125
    return w


@pytest.mark.parametrize("how", ["one ulp", "nan", "inf", "seventeen levels"])
def test_weights_that_are_not_codes_are_packed_as_float32(cpu_tier: IsaTier, how: str) -> None:
    gemm = _gemm(cpu_tier)
    w = _mutated(_q4_1_weight(12, 64, seed=11), how)
    [packed] = gemm.pack_all([w], compact=[True])
    assert not packed.codes4
    x = torch.randn(3, 64)
    [reference] = gemm.pack_all([w])
    _assert_same_bits(gemm.linear(x, packed, None), gemm.linear(x, reference, None))


def test_plain_float32_and_k_off_the_groups_stay_float32(cpu_tier: IsaTier) -> None:
    gemm = _gemm(cpu_tier)
    random_weight = torch.randn(20, 64)
    off_groups = _q4_1_weight(20, 96, seed=2)[:, :80].contiguous()  # K = 80: not whole groups of 32
    exact = _q4_1_weight(20, 64, seed=2)
    packed = gemm.pack_all([random_weight, off_groups, exact], compact=[True, True, True])
    assert [p.codes4 for p in packed] == [False, False, True]


def test_argmax_leaves_codes_to_the_caller(cpu_tier: IsaTier) -> None:
    """The LM head's arg-max reads float32 layouts only: over codes it answers None (the caller's logits path)."""
    gemm = _gemm(cpu_tier)
    [codes] = gemm.pack_all([_q4_1_weight(100, 64, seed=1)], compact=[True])
    assert codes.codes4 and gemm.argmax(torch.randn(2, 64), codes) is None


def test_bfloat16_activations_are_refused(cpu_tier: IsaTier) -> None:
    gemm = _gemm(cpu_tier)
    [codes] = gemm.pack_all([_q4_1_weight(16, 32, seed=4)], compact=[True])
    with pytest.raises(ValueError, match="float32 activations"):
        gemm.linear(torch.randn(1, 32).bfloat16(), codes, None)


def test_the_engines_choice_turns_codes_off() -> None:
    """pack_weights keeps codes only where the engine allows it (cpu_compact_weights)."""
    kernels = load_cpu_kernels(native_tier(), torch.float32)
    if kernels.gemm is None:
        pytest.skip(f"the {native_tier().flag_name} plan packs with oneDNN: no codes")
    assert kernels.compact_weights
    w = _q4_1_weight(24, 64, seed=9)
    [on] = pack_weights([w], kernels)
    [off] = pack_weights([w], dataclasses.replace(kernels, compact_weights=False))
    assert on.codes4 and not off.codes4


def _q8_0_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 [n, k] weight as a GGUF's Q8_0 tensor dequantizes (an int8 code times a float16 step per 32)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType.Q8_0)
    return dequantize_to_float32(raw, GGMLQuantizationType.Q8_0, (n, k)).contiguous()


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 49152, 576), (1, 7, 32), (3, 100, 64), (4, 49, 96), (8, 1000, 576), (9, 50, 64), (64, 3001, 576),
     (256, 97, 160)],
)  # fmt: skip
def test_lm_head_codes_give_the_float32_arg_max(cpu_tier: IsaTier, m: int, n: int, k: int) -> None:
    """8-bit codes (a GGUF's Q8_0) for the greedy LM head: the float32 path's token, ties to the first column; one
    row tile widened in registers, more rows (up to a 256-row chunk) over blocks widened once."""
    gemm = _gemm(cpu_tier)
    w = _q8_0_weight(n, k, seed=n + m)
    w[n // 2] = w[n // 3]  # two equal columns: a tie whenever they win
    head = gemm.pack_codes8(w)
    assert head is not None, "an exact Q8_0 weight must be kept as codes"
    [plain] = gemm.pack_all([w])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    x[0] = w[n // 3] * 4  # row 0 picks the tied pair
    got = gemm.argmax_codes8(x, head)
    tile_rows = {IsaTier.GENERIC: 0, IsaTier.AVX2: 4}.get(cpu_tier, 8)  # no vector tile on generic
    one_tile = gemm.argmax_codes8(x, head, widened=False)  # where the bfloat16 screen takes more rows
    assert (one_tile is None) == (m > tile_rows)
    if cpu_tier == IsaTier.GENERIC:
        assert got is None  # the caller takes the float32 paths
        return
    assert got is not None and got.tolist() == gemm.argmax(x, plain).tolist()
    assert one_tile is None or one_tile.tolist() == got.tolist()
    assert int(got[0]) == min(n // 2, n // 3)
    torch.testing.assert_close(got, (x.double() @ w.double().T).argmax(dim=1), rtol=0, atol=0)


def test_lm_head_codes_leave_more_rows_and_other_weights_to_float32(cpu_tier: IsaTier) -> None:
    gemm = _gemm(cpu_tier)
    head = gemm.pack_codes8(_q8_0_weight(64, 64, seed=1))
    assert head is not None and gemm.argmax_codes8(torch.randn(257, 64), head) is None  # more than one chunk
    assert gemm.pack_codes8(torch.randn(64, 64)) is None
    assert gemm.pack_codes8(_q8_0_weight(64, 96, seed=1)[:, :80].contiguous()) is None
    w = _q8_0_weight(16, 32, seed=2)
    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
    assert gemm.pack_codes8(w) is None

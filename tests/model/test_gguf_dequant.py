"""Folio's GGUF reading pieces: torch dequantization is bit-identical to gguf's numpy; q/k un-permutation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from folio.kernels.cpu_build import load_kernel_library
from folio.kernels.isa import IsaTier
from folio.model.gguf_dequant import NativeDequantizer, dequantize_to_float32
from folio.model.gguf_file import open_gguf
from folio.model.gguf_loader import hf_name_for_gguf, unpermute_rotary_rows


@pytest.mark.parametrize(
    "qtype",
    [
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.F32,
    ],
)
def test_dequantize_bit_identical_to_gguf(qtype: GGMLQuantizationType) -> None:
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32) * 3
    raw = np.array(quantize(x, qtype))  # writable copy, as our memory map is
    ours = dequantize_to_float32(raw, qtype, (8, 256))
    assert torch.equal(ours, torch.from_numpy(np.array(dequantize(raw, qtype))))


def test_default_gguf_tensors_bit_identical(default_model_path: str) -> None:
    gguf = open_gguf(default_model_path)
    assert len(gguf.tensors) == 272
    for name in ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "output_norm.weight"]:
        info = gguf.tensors[name]
        raw = gguf.tensor_bytes(info)
        expected = dequantize(raw, info.ggml_type)
        assert torch.equal(
            dequantize_to_float32(raw, info.ggml_type, info.shape),
            torch.from_numpy(np.array(expected)).reshape(info.shape),
        )
    assert gguf.tensors["token_embd.weight"].shape == (49152, 576)
    assert gguf.tensors["blk.0.attn_k.weight"].ggml_type == GGMLQuantizationType.Q4_1


def test_unpermute_inverts_llama_cpp_permute() -> None:
    num_heads, head_dim, cols = 3, 8, 5
    w = torch.arange(num_heads * head_dim * cols, dtype=torch.float32).reshape(num_heads * head_dim, cols)
    # llama.cpp convert_hf_to_gguf.py: w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(...)
    permuted = w.reshape(num_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rotary_rows(permuted, num_heads), w)
    bias = torch.arange(num_heads * head_dim, dtype=torch.float32)
    assert torch.equal(unpermute_rotary_rows(bias.reshape(num_heads, 2, -1).transpose(1, 2).flatten(), num_heads), bias)


def test_gguf_names() -> None:
    assert hf_name_for_gguf("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj.weight"
    assert hf_name_for_gguf("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name_for_gguf("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name_for_gguf("output.weight") == "lm_head.weight"
    assert hf_name_for_gguf("blk.0.ssm_conv1d.weight") is None


_NATIVE_TYPES = [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]
_HEADER_BYTES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 2}
# float16 bit patterns for the steps and offsets: +-0, the smallest and largest subnormals, the smallest normal, 1,
# the largest finite, +-inf and a NaN
_EXTREME_HALVES = [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00]


def _native(tier: IsaTier) -> NativeDequantizer:
    lib = load_kernel_library("cpu_kernels", tier)
    assert lib is not None, "gcc is part of this machine and of CI"
    return NativeDequantizer(lib)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, zeros' signs included; NaN where the other is NaN (which NaN an inf * 0 + NaN gives depends on the
    operand order the compiler picked for a commutative add)."""
    nan = a.isnan()
    return bool(
        a.shape == b.shape
        and torch.equal(nan, b.isnan())
        and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))
    )


@pytest.mark.parametrize("qtype", _NATIVE_TYPES, ids=lambda t: t.name)
def test_the_kernels_dequantize_to_gguf_bits(cpu_tier: IsaTier, qtype: GGMLQuantizationType) -> None:
    """Folio's one-pass loop (every tier) gives gguf's float32 bits: quantized weights over six decades, a tensor
    large enough for the kernel's threads (4096 blocks and more), and one block."""
    rng = np.random.default_rng(int(qtype))
    native = _native(cpu_tier)
    for rows, cols in [(1, 32), (7, 96), (160, 1024)]:
        x = (rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-4, 3, (rows, 1))).astype(np.float32)
        raw = np.array(quantize(x, qtype))
        expected = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32))
        assert _same_bits(dequantize_to_float32(raw, qtype, (rows, cols), native), expected), (rows, cols)


@pytest.mark.parametrize("qtype", _NATIVE_TYPES, ids=lambda t: t.name)
def test_extreme_steps_and_offsets_give_gguf_bits(cpu_tier: IsaTier, qtype: GGMLQuantizationType) -> None:
    """Every pair of extreme float16 steps and offsets (zeros, subnormals, the largest, infinities, NaN) over random
    codes: the same bits as gguf's numpy, NaN where it gives NaN."""
    rng = np.random.default_rng(7)
    block_bytes = _HEADER_BYTES[qtype] + (32 if qtype == GGMLQuantizationType.Q8_0 else 16)
    pairs = [(d, m) for d in _EXTREME_HALVES for m in _EXTREME_HALVES]
    raw = rng.integers(0, 256, (len(pairs), block_bytes), dtype=np.uint8)
    for i, (d, m) in enumerate(pairs):
        raw[i, 0:2] = (d & 0xFF, d >> 8)
        if qtype == GGMLQuantizationType.Q4_1:
            raw[i, 2:4] = (m & 0xFF, m >> 8)
    with np.errstate(invalid="ignore"):  # inf * 0 and inf - inf are NaN here on purpose
        expected = torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32)).reshape(len(pairs), 32)
    ours = dequantize_to_float32(raw, qtype, (len(pairs), 32), _native(cpu_tier))
    assert _same_bits(ours, expected)


def test_types_the_kernels_do_not_take_fall_back_to_torch(cpu_tier: IsaTier) -> None:
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    native = _native(cpu_tier)
    for qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.F32, GGMLQuantizationType.Q5_0):
        raw = np.array(quantize(x, qtype))
        assert native(raw, qtype, (4, 64)) is None
        ours = dequantize_to_float32(raw, qtype, (4, 64), native)
        assert torch.equal(ours, torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32)))
    with pytest.raises(ValueError, match="Q4_1 data of 21 bytes is not whole 20-byte blocks"):
        native(np.zeros(21, dtype=np.uint8), GGMLQuantizationType.Q4_1, (32,))

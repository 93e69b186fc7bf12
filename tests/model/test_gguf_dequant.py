"""Folio's GGUF reading pieces: torch dequantization is bit-identical to gguf's numpy; q/k un-permutation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from folio.model.gguf_dequant import dequantize_to_float32
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

"""Packed linear layers on the CPU against F.linear on the same weights: the implementation each tier's plan
chooses (Folio's GEMM or oneDNN's packed linear), and oneDNN's path on its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from folio.kernels.cpu_build import native_tier
from folio.kernels.cpu_gemm import PackedWeight
from folio.kernels.cpu_kernels import CpuKernels, load_cpu_kernels, onednn_available
from folio.kernels.isa import IsaTier
from folio.model.layers.cpu_gemm import can_pack, pack_weight, packed_linear
from folio.model.layers.linear import Linear, MergedLinear

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN packing")


def _assert_packed_as_planned(packed: object, kernels: CpuKernels) -> None:
    if kernels.plan.gemm == "folio":
        assert isinstance(packed, PackedWeight)
    else:
        assert kernels.plan.gemm == "onednn" and isinstance(packed, torch.Tensor)  # oneDNN's blocked tensor


def _onednn_kernels() -> CpuKernels:
    """A kernels object whose plan packs with oneDNN: the generic tier has no vectorised GEMM of Folio's."""
    kernels = load_cpu_kernels(IsaTier.GENERIC, torch.float32)
    assert kernels.plan.gemm == "onednn" and kernels.gemm is None
    return kernels


def _check_linear(kernels: CpuKernels, num_tokens: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    layer = Linear(96, 200, bias=bias)
    layer.weight.data = torch.randn(200, 96, generator=gen)
    if layer.bias is not None:
        layer.bias.data = torch.randn(200, generator=gen)
    x = torch.randn(num_tokens, 96, generator=gen)
    expected = F.linear(x, layer.weight.data, None if layer.bias is None else layer.bias.data)
    layer.pack_for_cpu(kernels)
    assert layer.weight.numel() == 0  # the plain copy is released
    _assert_packed_as_planned(layer.packed_weight, kernels)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(x[:, :].t().contiguous().t()), expected, rtol=1e-5, atol=1e-4)  # strided input


@needs_onednn
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_plan_gemm_matches_f_linear(cpu_tier: IsaTier, num_tokens: int, bias: bool) -> None:
    _check_linear(load_cpu_kernels(cpu_tier, torch.float32), num_tokens, bias)


@needs_onednn
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_packed_linear_matches_f_linear(num_tokens: int, bias: bool) -> None:
    _check_linear(_onednn_kernels(), num_tokens, bias)


@needs_onednn
@pytest.mark.skipif(native_tier() < IsaTier.AVX512, reason="oneDNN's bfloat16 linear needs AVX-512 BW/VL/DQ")
def test_onednn_bfloat16_packing() -> None:
    w = torch.randn(64, 32).bfloat16()
    x = torch.randn(4, 32).bfloat16()
    packed = pack_weight(w, _onednn_kernels())
    assert not isinstance(packed, PackedWeight)
    torch.testing.assert_close(packed_linear(x, packed, None).float(), F.linear(x, w).float(), rtol=2e-2, atol=5e-2)


@needs_onednn
def test_merged_linear_still_splits_after_packing(cpu_tier: IsaTier) -> None:
    layer = MergedLinear(32, {"q": 16, "k": 8, "v": 8})
    layer.weight.data = torch.randn(32, 32)
    x = torch.randn(5, 32)
    expected = [part.clone() for part in layer.split(layer(x))]
    layer.pack_for_cpu(load_cpu_kernels(cpu_tier, torch.float32))
    for got, want in zip(layer.split(layer(x)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_bfloat16_plan_gemm(cpu_tier: IsaTier) -> None:
    """bfloat16 packs with the plan's GEMM; where neither Folio nor oneDNN runs it, the plan says torch."""
    kernels = load_cpu_kernels(cpu_tier, torch.bfloat16)
    if not can_pack(kernels):
        assert kernels.plan.gemm == "torch"
        return
    w = torch.randn(64, 32).bfloat16()
    x = torch.randn(4, 32).bfloat16()
    packed = pack_weight(w, kernels)
    _assert_packed_as_planned(packed, kernels)
    torch.testing.assert_close(packed_linear(x, packed, None).float(), F.linear(x, w).float(), rtol=2e-2, atol=5e-2)


@needs_onednn
def test_default_model_loads_packed_on_cpu(cpu_tier: IsaTier) -> None:
    from folio.model.loader import default_model_path, load_model

    kernels = load_cpu_kernels(cpu_tier, torch.float32)
    model, _ = load_model(
        default_model_path(), torch.float32, torch.device("cpu"), show_progress=False, cpu_kernels=kernels
    )
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 30
    for m in linears:
        _assert_packed_as_planned(m.packed_weight, kernels)
    assert model.tied_lm_head_packed is not None  # SmolLM2 ties its embeddings
    hidden = torch.randn(3, 576)
    expected = F.linear(hidden, model.model.embed_tokens.weight)
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-3)

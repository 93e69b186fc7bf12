"""oneDNN-packed linear layers (the CPU default) against F.linear on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from folio.model.layers.cpu_gemm import can_pack, pack_weight, packed_linear
from folio.model.layers.linear import Linear, MergedLinear

pytestmark = pytest.mark.skipif(
    not can_pack(torch.device("cpu"), torch.float32), reason="this torch build has no oneDNN packing"
)


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(num_tokens: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    layer = Linear(96, 200, bias=bias)
    layer.weight.data = torch.randn(200, 96, generator=gen)
    if layer.bias is not None:
        layer.bias.data = torch.randn(200, generator=gen)
    x = torch.randn(num_tokens, 96, generator=gen)
    expected = F.linear(x, layer.weight.data, None if layer.bias is None else layer.bias.data)
    layer.pack_for_cpu()
    assert layer.weight.numel() == 0  # the plain copy is released
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(x[:, :].t().contiguous().t()), expected, rtol=1e-5, atol=1e-4)  # strided input


def test_merged_linear_still_splits_after_packing() -> None:
    layer = MergedLinear(32, {"q": 16, "k": 8, "v": 8})
    layer.weight.data = torch.randn(32, 32)
    x = torch.randn(5, 32)
    expected = [part.clone() for part in layer.split(layer(x))]
    layer.pack_for_cpu()
    for got, want in zip(layer.split(layer(x)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_bfloat16_packing() -> None:
    w = torch.randn(64, 32).bfloat16()
    x = torch.randn(4, 32).bfloat16()
    torch.testing.assert_close(
        packed_linear(x, pack_weight(w), None).float(), F.linear(x, w).float(), rtol=2e-2, atol=5e-2
    )


def test_default_model_loads_packed_on_cpu() -> None:
    from folio.model.loader import default_model_path, load_model

    model, _ = load_model(default_model_path(), torch.float32, torch.device("cpu"), show_progress=False)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 30 and all(m.packed_weight is not None for m in linears)
    assert model.tied_lm_head_packed is not None  # SmolLM2 ties its embeddings
    hidden = torch.randn(3, 576)
    expected = F.linear(hidden, model.model.embed_tokens.weight)
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-3)

"""The fused CPU element-wise ops (folio/kernels/cpu_ops.c) against the torch ops they replace, on every ISA tier
this CPU can run (the ``cpu_tier`` fixture: the same assertions on the scalar, AVX2 and AVX-512 bodies)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from folio.attention.backends.paged_cache import write_kv
from folio.kernels.cpu_build import load_kernel_library, native_tier
from folio.kernels.cpu_kernels import load_cpu_kernels
from folio.kernels.cpu_ops import CpuOps
from folio.kernels.isa import IsaTier
from folio.model.layers.norm import RMSNorm
from folio.model.layers.rotary import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.bfloat16]


def _ops(dtype: torch.dtype, tier: IsaTier) -> CpuOps:
    """The tier's ops whether or not its plan would choose them: every body is tested."""
    lib = load_kernel_library("cpu_kernels", tier)
    assert lib is not None, "the fused ops must build here (gcc is part of this machine and of CI)"
    return CpuOps(lib, dtype)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: float noise only. bfloat16: the same roundings as torch, so at most one bf16 step apart where a
    float32 intermediate sat on a rounding boundary (summation order differs)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-6, atol=1e-3)  # one bf16 step
        assert (actual == expected).float().mean() > 0.98  # nearly all elements bit-identical


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 crosses the threshold for running on all threads
@pytest.mark.parametrize("hidden", [576, 100, 13])  # 100, 13: the vector loops' scalar tails (13: no vector)
@pytest.mark.parametrize("scale", [3.0, 1e15])  # 1e15: sums of squares near 1e33, far from float32's 1e38
def test_rms_norm_with_and_without_residual(
    cpu_tier: IsaTier, dtype: torch.dtype, rows: int, hidden: int, scale: float
) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dtype)
    x = (torch.randn(rows, hidden, generator=gen) * scale).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    out, summed = _ops(dtype, cpu_tier).rms_norm(x, norm.weight, norm.eps, residual)
    assert summed is not None
    _assert_close(summed, x + residual)
    _assert_close(out, norm._norm(x + residual))
    plain, none = _ops(dtype, cpu_tier).rms_norm(x, norm.weight, norm.eps, None)
    assert none is None
    _assert_close(plain, norm._norm(x))
    # the layer, given the tier's kernels, takes the fused path where the plan chose it
    norm.cpu_kernels = load_cpu_kernels(cpu_tier, dtype)
    _assert_close(norm(x), norm._norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_a_strided_input(cpu_tier: IsaTier, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=gen).to(dtype)
    wide = torch.randn(5, 200, generator=gen).to(dtype)
    x = wide[:, 10:74]  # rows 200 apart
    _assert_close(_ops(dtype, cpu_tier).rms_norm(x, norm.weight, norm.eps, None)[0], norm._norm(x.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 64, 40])
def test_silu_and_mul(cpu_tier: IsaTier, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 4
    gate_up[:, :8] = torch.tensor([-1e4, -120.0, -89.0, -87.5, 80.0, 89.0, 200.0, 0.0])  # exp(-g) past float range
    gate_up = gate_up.to(dtype)
    expected = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    _assert_close(_ops(dtype, cpu_tier).silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 48, 20])  # half 24: AVX-512 16 + 8 scalar, AVX2 3 x 8; half 10: tails
def test_rotary_in_place_on_a_fused_qkv_view(cpu_tier: IsaTier, dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_heads, num_kv_heads, rows = 9, 3, 37
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 3000, (rows,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, None)(positions, dtype)
    untouched_v = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    q = qkv[:, : num_heads * head_dim].view(rows, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(rows, num_kv_heads, head_dim)
    expected_q, expected_k = apply_rotary(q.clone(), cos, sin), apply_rotary(k.clone(), cos, sin)
    ops = _ops(dtype, cpu_tier)
    assert ops.rotary_(q, cos, sin) is q
    ops.rotary_(k, cos, sin)
    _assert_close(q, expected_q)
    _assert_close(k, expected_k)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], untouched_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_major", [False, True])
def test_write_kv_matches_the_torch_write(cpu_tier: IsaTier, dtype: torch.dtype, head_major: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim, rows = 9, 4, 3, 16, 11
    kv = torch.randn(rows, 2 * num_kv_heads * head_dim, generator=gen).to(dtype)  # a fused k|v output
    key = kv[:, : num_kv_heads * head_dim].view(rows, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim :].view(rows, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    expected = cache.clone()
    if head_major:  # [2, NB, KV, BS, D] storage seen as [2, NB, BS, KV, D]
        cache = cache.transpose(2, 3).contiguous().transpose(2, 3)
        assert not cache.is_contiguous()
    write_kv(key, value, expected, slots)
    _ops(dtype, cpu_tier).write_kv(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_other_dtypes_and_devices_take_the_torch_path() -> None:
    if native_tier() == IsaTier.GENERIC:  # aarch64 and other CPUs without a vector tier (seen under qemu-aarch64)
        pytest.skip("this CPU's best tier is generic: torch ops (test_generic_tier_plans_the_torch_ops)")
    kernels = load_cpu_kernels(None, torch.float32)
    assert kernels.ops_for(torch.empty(2, 2)) is not None  # this CPU's best tier has the fused ops
    assert kernels.ops_for(torch.empty(2, 2, dtype=torch.float16)) is None
    assert kernels.ops_for(torch.empty(2, 2), torch.empty(2, 2, dtype=torch.bfloat16)) is None  # mixed dtypes
    assert kernels.ops_for(torch.empty(4, 4).t()) is None  # last dim not contiguous
    assert kernels.ops_for(torch.empty(2, 2, device="meta")) is None


def test_generic_tier_plans_the_torch_ops() -> None:
    assert load_cpu_kernels(IsaTier.GENERIC, torch.float32).ops_for(torch.empty(2, 2)) is None

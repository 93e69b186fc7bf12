"""Whole-block KV copies (folio/kernels/kv_block_copy.py) against ATen's gather-then-scatter, on every ISA tier this
CPU can run: the same layer caches the worker builds (offset, huge-page backed, head-major storage), host caches of
another size, and the plans the C call must hand back to ATen."""

from __future__ import annotations

import pytest
import torch

from folio.kernels.cpu_build import load_kernel_library
from folio.kernels.cpu_kernels import load_cpu_kernels
from folio.kernels.isa import IsaTier
from folio.kernels.kv_block_copy import CpuBlockCopy, aten_copy_blocks
from folio.worker.kv_cache_shape import KVCacheShape
from folio.worker.kv_offload import storage_view

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 16, 3, 64


def _copier(tier: IsaTier) -> CpuBlockCopy:
    lib = load_kernel_library("cpu_kernels", tier)
    assert lib is not None, "the kernels must build here (gcc is part of this machine and of CI)"
    return CpuBlockCopy(lib)


def _device_caches(num_blocks: int, dtype: torch.dtype, head_major: bool, seed: int) -> list[torch.Tensor]:
    """The worker's own layer caches, filled with random values, in storage order."""
    shape = KVCacheShape(LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, head_major=head_major)
    caches = [storage_view(c, head_major) for c in shape.allocate(num_blocks, torch.device("cpu"))]
    gen = torch.Generator().manual_seed(seed)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    return caches


def _host_caches(num_blocks: int, dtype: torch.dtype, seed: int, head_major: bool = False) -> list[torch.Tensor]:
    """HostKVCache's layer caches: the device's storage order, another number of blocks."""
    gen = torch.Generator().manual_seed(seed)
    inner = (KV_HEADS, BLOCK_SIZE) if head_major else (BLOCK_SIZE, KV_HEADS)
    shape = (2, num_blocks, *inner, HEAD_DIM)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(LAYERS)]


def _clone(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [c.clone() for c in caches]


def _assert_same(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_major", [False, True], ids=["position_major", "head_major"])
@pytest.mark.parametrize("num_blocks", [1, 7, 100])
def test_loads_and_stores_equal_aten(cpu_tier: IsaTier, dtype: torch.dtype, head_major: bool, num_blocks: int) -> None:
    copy = _copier(cpu_tier)
    gen = torch.Generator().manual_seed(num_blocks)
    host_ids = torch.randperm(400, generator=gen)[:num_blocks].tolist()
    device_ids = torch.randperm(120, generator=gen)[:num_blocks].tolist()
    for load in (True, False):
        device, host = (
            _device_caches(120, dtype, head_major, seed=1),
            _host_caches(400, dtype, seed=2, head_major=head_major),
        )
        src, src_ids, dst, dst_ids = (
            (host, host_ids, device, device_ids) if load else (device, device_ids, host, host_ids)
        )
        assert copy._runs_in_c(src, src_ids, dst, dst_ids)  # the C call, not its fallback
        expected = _clone(dst)
        aten_copy_blocks(src, src_ids, expected, dst_ids)
        assert not all(torch.equal(a, b) for a, b in zip(expected, dst, strict=True))  # the copy changes something
        copy(src, src_ids, dst, dst_ids)
        _assert_same(dst, expected)


def test_copy_on_write_within_one_cache_and_extreme_values(cpu_tier: IsaTier) -> None:
    """Distinct blocks of the same caches (copy-on-write); NaN, infinities and -0.0 are copied bit for bit."""
    caches = _device_caches(40, torch.float32, False, seed=3)
    caches[1][0, 5, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    src, dst = [5, 6, 30], [10, 39, 0]
    assert _copier(cpu_tier)._runs_in_c(caches, src, caches, dst)
    expected = _clone(caches)
    aten_copy_blocks(_clone(caches), src, expected, dst)
    _copier(cpu_tier)(caches, src, caches, dst)
    for a, e in zip(caches, expected, strict=True):
        assert torch.equal(a.view(torch.int32), e.view(torch.int32))  # bit for bit, NaN included


@pytest.mark.parametrize(
    ("src", "dst", "why"),
    [([1, 2], [2, 3], "a block both read and written"), ([1, 2], [4, 4], "a destination named twice")],
)
def test_plans_the_c_call_cannot_order_go_to_aten(src: list[int], dst: list[int], why: str) -> None:
    copy = _copier(IsaTier.GENERIC)
    caches = _device_caches(8, torch.float32, False, seed=4)
    assert not copy._runs_in_c(caches, src, caches, dst), why
    expected = _clone(caches)
    aten_copy_blocks(_clone(caches), src, expected, dst)  # every source read before any destination is written
    before = _clone(caches)
    copy(caches, src, caches, dst)
    if len(set(dst)) == len(dst):
        _assert_same(caches, expected)  # block 3 holds block 2's old K/V, as ATen's order gives
    else:  # block 4 holds one of its two sources, whole
        assert all(
            any(torch.equal(cache[:, 4], old[:, s]) for s in src) for cache, old in zip(caches, before, strict=True)
        )


def test_odd_block_sizes(cpu_tier: IsaTier) -> None:
    """Blocks of 5 positions x 1 head x 7 dims (140 bytes a run): no size the vector width divides."""
    gen = torch.Generator().manual_seed(8)
    src = [torch.randn((2, 9, 5, 1, 7), generator=gen) for _ in range(2)]
    dst = [torch.randn((2, 4, 5, 1, 7), generator=gen) for _ in range(2)]
    expected = _clone(dst)
    aten_copy_blocks(src, [8, 0, 3], expected, [1, 3, 0])
    copy = _copier(cpu_tier)
    assert copy._runs_in_c(src, [8, 0, 3], dst, [1, 3, 0])
    copy(src, [8, 0, 3], dst, [1, 3, 0])
    _assert_same(dst, expected)


def test_bad_plans_are_clear_errors() -> None:
    copy = _copier(IsaTier.GENERIC)
    device, host = _device_caches(8, torch.float32, False, seed=5), _host_caches(4, torch.float32, seed=6)
    with pytest.raises(IndexError, match="source block id 4 is outside the cache's 4 blocks"):
        copy(host, [1, 4], device, [0, 1])
    with pytest.raises(IndexError, match="destination block id -1 is outside the cache's 8 blocks"):
        copy(host, [0], device, [-1])
    with pytest.raises(ValueError, match="2 source blocks but 1 destination blocks"):
        copy(host, [0, 1], device, [0])
    with pytest.raises(ValueError, match="zip"):
        copy(host[:2], [0], device, [0])


def test_the_plan_chooses_the_c_copy_and_the_worker_shapes_take_it(cpu_tier: IsaTier) -> None:
    kernels = load_cpu_kernels(cpu_tier, torch.float32)
    assert kernels.plan.kv_block_copy == "folio" and isinstance(kernels.block_copy, CpuBlockCopy)
    assert "kv_block_copy=folio" in kernels.describe()

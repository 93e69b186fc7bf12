"""The worker's CPU KV caches: zeroed, the documented shape for both storage orders, and each layer starting at
its own offset within the L2's set index (the same slot of successive layers must not share L2 sets)."""

from __future__ import annotations

import pytest
import torch

from folio.worker.kv_cache_shape import KVCacheShape


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_caches_are_zeroed_shaped_and_staggered(head_major: bool, dtype: torch.dtype) -> None:
    shape = KVCacheShape(num_layers=6, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype, head_major=head_major)
    caches = shape.allocate(10, torch.device("cpu"))
    assert len(caches) == 6
    for cache in caches:
        assert cache.shape == (2, 10, 16, 3, 64) and cache.dtype == dtype
        assert not cache.any()
        cache[1, 9, 15, 2, 63] = 1.0  # the last element lies inside the layer's own storage
        assert cache.sum().item() == 1.0
    if head_major:
        assert caches[0].stride()[2:] == (64, 16 * 64, 1)  # [.., num_kv_heads, block_size, ..] storage
    offsets = {cache.data_ptr() % (64 << 10) for cache in caches}
    assert len(offsets) == len(caches)  # every layer in different L2 sets
    assert all(cache.data_ptr() % 64 == 0 for cache in caches)  # on a cache-line boundary

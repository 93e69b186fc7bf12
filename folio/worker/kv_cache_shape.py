"""The KV cache's per-layer tensors: their shape and layout, and the CPU's default KV budget."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from folio.kernels.hugepages import empty_hugepage_backed, slow_first_touch_hint
from folio.worker.kv_offload import mem_available_bytes

logger = logging.getLogger("folio")

_DEFAULT_CPU_KV_BYTES = 4 * 2**30
_CPU_KV_FRACTION_OF_FREE = 0.3
# Layer l's CPU cache starts (l * 67 mod 1024) cache lines past a 2 MiB boundary: 1024 lines span the L2's set
# index (64 KiB), 67 is odd so successive layers take distinct offsets.
_LAYER_LINE_STRIDE, _LAYER_OFFSET_LINES = 67, 1024


@dataclass
class KVCacheShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    head_major: bool = False  # the attention backend's kv_cache_head_major
    huge_pages: bool = True  # CPU caches on 2 MiB pages (cpu_huge_pages)

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate(self, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
        """One cache per layer, always shaped [2, num_blocks, block_size, num_kv_heads, head_dim]; head-major
        storage ([.., num_kv_heads, block_size, ..]) is handed out as that shape through a transposed view."""
        if not self.head_major:
            shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        else:
            shape = (2, num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        start = time.perf_counter()
        caches = [self._zeros(shape, layer, device) for layer in range(self.num_layers)]
        if device.type == "cpu" and self.huge_pages:
            hint = slow_first_touch_hint("KV cache", num_blocks * self.bytes_per_block, time.perf_counter() - start)
            if hint is not None:
                logger.info(hint)
        return [cache.transpose(2, 3) for cache in caches] if self.head_major else caches

    def _zeros(self, shape: tuple[int, ...], layer: int, device: torch.device) -> torch.Tensor:
        """A zeroed layer cache. On the CPU it is backed by 2 MiB pages (a decode step reads every live block of
        every layer, scattered over the cache: 4 KiB pages cost a TLB miss each) and starts a layer-dependent
        number of cache lines past the page boundary, so that the same slot of successive layers does not land in
        the same L2 sets (the GEMMs prefetch the next layer's blocks while this layer's are live). W1 bf16,
        decode-only steps: 2.845 -> 2.707 s, decode attention 0.670 -> 0.608 (docs/performance.md)."""
        if device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=device)
        numel = math.prod(shape)
        offset = (layer * _LAYER_LINE_STRIDE) % _LAYER_OFFSET_LINES * 64 // self.dtype.itemsize
        backing = empty_hugepage_backed(numel + offset, self.dtype, self.huge_pages)
        return backing[offset:].zero_().view(shape)


def default_cpu_kv_bytes() -> int:
    """A sensible share of free RAM, capped at 4 GiB (vLLM CPU's default KV space)."""
    available = mem_available_bytes() or _DEFAULT_CPU_KV_BYTES
    return min(_DEFAULT_CPU_KV_BYTES, int(available * _CPU_KV_FRACTION_OF_FREE))

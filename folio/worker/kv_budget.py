"""A rank's KV budget in blocks: how many blocks a budget holds, a budget too small for one refused before the
weights are read where the spec alone gives the block, and the capacity line logged at start. The worker chooses
the budget (an override, kv_cache_memory_bytes, CUDA profiling or the CPU default) and calls these."""

from __future__ import annotations

import logging

import torch

from folio.config import EngineConfig
from folio.model.loader import ModelSpec
from folio.worker.kv_cache_shape import KVCacheShape

logger = logging.getLogger("folio")


def blocks_in_budget(budget: int, bytes_per_block: int) -> int:
    """Blocks of ``bytes_per_block`` in ``budget``; a ValueError naming both if not even one."""
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes {budget} holds no KV block (one block needs {bytes_per_block} bytes)")
    return int(num_blocks)


def check_budget_before_loading(config: EngineConfig, spec: ModelSpec, world_size: int, kv_dtype: torch.dtype) -> None:
    """A kv_cache_memory_bytes below one block fails before the weights are read (a large model loads for
    minutes), where the block is known from the spec alone: one rank, no draft model (the worker checks every case
    again after loading)."""
    cache = config.cache_config
    speculative = config.speculative_config
    if (
        cache.kv_cache_memory_bytes is None
        or cache.num_gpu_blocks_override is not None
        or world_size > 1
        or (speculative is not None and speculative.method == "draft_model")
    ):
        return
    shape = KVCacheShape(spec.num_hidden_layers, cache.block_size, spec.num_key_value_heads, spec.head_dim, kv_dtype)
    blocks_in_budget(cache.kv_cache_memory_bytes, shape.bytes_per_block)


def report_capacity(config: EngineConfig, num_blocks: int, bytes_per_block: int, kv_dtype: torch.dtype) -> None:
    """The start-up lines: the KV cache's blocks, tokens, GiB and dtype, and how many max_model_len requests fit."""
    block_size = config.cache_config.block_size
    max_len = config.scheduler_config.max_model_len
    num_tokens = num_blocks * block_size
    gib = num_blocks * bytes_per_block / 2**30
    dtype = str(kv_dtype).removeprefix("torch.")
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)", num_blocks, block_size, num_tokens, gib, dtype
    )
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_len, num_tokens / max_len)

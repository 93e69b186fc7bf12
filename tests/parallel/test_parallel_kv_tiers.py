"""The host KV tier on several ranks (issue 18's tier on issue 20's ranks): every rank holds every host block id for
its own KV heads and layers and runs the scheduler's store and load plans on its own caches. A device pool small
enough to swap every request and evict cached prefixes: tp=2 on the real model (uneven heads: 1 and 2 of its 3 KV
heads) and pp=2 (2 steps in flight, so requests are swapped while their step is in flight) give the greedy outputs
of the same ranks without the tier; the host tier's size is the total over the ranks, as vLLM's
kv_offloading_size is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from folio import LLM
from tests.engine.test_kv_tiers import GREEDY, HOST_GIB, SMALL_POOL, _Run
from tests.parallel.conftest import shutdown

TP2 = dict(tensor_parallel_size=2, tensor_parallel_uneven_heads=True)
PP2 = dict(pipeline_parallel_size=2)


@pytest.mark.parametrize("ranks", [TP2, PP2], ids=["tp2", "pp2"])
def test_swaps_and_host_prefix_hits_keep_the_greedy_outputs(
    make_engine: Callable[..., LLM], ranks: dict[str, Any]
) -> None:
    runs = {}
    for tier in (0.0, HOST_GIB):
        llm = make_engine(**SMALL_POOL, **ranks, kv_offloading_size=tier)
        try:
            runs[tier] = _Run(llm, lambda i: GREEDY)
            num_host_blocks = llm.llm_engine.config.cache_config.num_host_blocks
            swaps_in_flight = llm.llm_engine.scheduler.preemption.num_swaps_with_a_pending_token
        finally:
            shutdown(llm)
    plain, tiered = runs[0.0], runs[HOST_GIB]
    assert plain.stats.num_preemptions_total > 0 and plain.stats.kv_offload_blocks_to_cpu_total == 0
    stats = tiered.stats
    assert 0 < stats.num_swapped_preemptions_total == stats.num_preemptions_total, stats
    assert stats.kv_offload_blocks_to_cpu_total > 0 and stats.kv_offload_blocks_to_device_total > 0, stats
    assert stats.external_prefix_cache_hits > 0, stats
    assert tiered.tokens == plain.tokens
    # the ranks' blocks together cost one block of every layer and KV head (30 layers, 3 KV heads, 16 tokens, 64 dims,
    # K and V, float32): the tp ranks' heads and the pp stages' layers add up to the whole
    assert num_host_blocks == int(HOST_GIB * 2**30) // (30 * 2 * 16 * 3 * 64 * 4)
    if ranks is PP2:
        assert swaps_in_flight > 0  # swapped while the step computing their next token was in flight

"""The host KV tier on several ranks (issue 18's tier on issue 20's ranks): every rank holds every host block id for
its own KV heads and layers and runs the scheduler's store and load plans on its own caches. A device pool small
enough to swap every request and evict cached prefixes: tp=2 with uneven heads (1 and 2 of the model's 3 KV heads)
and pp=2 (2 steps in flight, so requests are swapped while their step is in flight) give the greedy outputs of the
same ranks without the tier; the host tier's size is the total over the ranks, as vLLM's kv_offloading_size is.

The model is a tiny random Llama of the real one's head layout (3 KV heads, 3 query heads each), with weights
large enough that attention is peaked: a wrong or stale K/V block changes the tokens (a tier that loaded zeros
instead of the stored blocks, or loaded each into its neighbour's place, failed here). tests/engine/test_kv_tiers.py
runs the same rounds on the real model, one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from folio import LLM
from tests.engine.test_kv_tiers import GREEDY, PROMPTS, SMALL_POOL, _Run
from tests.parallel.conftest import shutdown
from tests.tiny_models import save_tiny_llama

TP2 = dict(tensor_parallel_size=2, tensor_parallel_uneven_heads=True)
PP2 = dict(pipeline_parallel_size=2)
# SmolLM2's 3 KV heads and group of 3 query heads, 4 layers (2 per pipeline stage), a vocabulary the prompts fit in
SHAPE = dict(
    vocab_size=max(max(p) for p in PROMPTS) + 100,
    hidden_size=288,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=256,
)
HEAD_DIM = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
BLOCK_BYTES = SHAPE["num_hidden_layers"] * 2 * 16 * SHAPE["num_key_value_heads"] * HEAD_DIM * 4  # float32
HOST_BLOCKS = 70  # room for every swap and every evicted prefix block
HOST_GIB = HOST_BLOCKS * BLOCK_BYTES / 2**30


@pytest.fixture(scope="module")
def peaked_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_kv_tiers"), initializer_range=0.25, **SHAPE)


@pytest.mark.parametrize("ranks", [TP2, PP2], ids=["tp2", "pp2"])
def test_swaps_and_host_prefix_hits_keep_the_greedy_outputs(
    make_engine: Callable[..., LLM], peaked_tiny_model: str, ranks: dict[str, Any]
) -> None:
    runs = {}
    for tier in (0.0, HOST_GIB):
        llm = make_engine(peaked_tiny_model, **SMALL_POOL, **ranks, kv_offloading_size=tier)
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
    assert len({tuple(t[0]) for t in plain.tokens.values()}) == len(PROMPTS)  # the prompts' outputs differ
    # the ranks' blocks together cost one block of every layer and KV head: the tp ranks' heads and the pp stages'
    # layers add up to the whole
    assert num_host_blocks == HOST_BLOCKS
    if ranks is PP2:
        assert swaps_in_flight > 0  # swapped while the step computing their next token was in flight

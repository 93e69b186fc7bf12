"""kv_cache_dtype="bfloat16" under a float32 model (vLLM's --kv-cache-dtype): the cache holds K/V rounded to
bfloat16, twice the blocks fit the same KV memory, and the outputs are held to transformers' float32 runs by the
top-5 rule, on the fused decoder (this CPU's tier) and on the generic tier's torch ops. The host tier and swaps keep
the greedy outputs of the same engine without them, and so does a draft model (whose cache takes the same type)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from folio import LLM
from folio.config import CacheConfig
from folio.kernels.cpu_build import native_tier
from folio.kernels.isa import IsaTier
from folio.worker.device import resolve_kv_cache_dtype
from tests.engine.conftest import assert_no_leaks, greedy_verdicts
from tests.engine.greedy_compare import GreedyRun
from tests.engine.test_kv_tiers import GREEDY, PROMPTS, SMALL_POOL, _Run
from tests.small_engine import SMALL_ENGINE, TEST_KV_BYTES

# float32 K/V of SmolLM2: 30 layers, K and V, 3 KV heads of 64 dims, 16 tokens a block
FLOAT32_BLOCK_BYTES = 30 * 2 * 3 * 64 * 16 * 4


@pytest.mark.parametrize("tier", sorted({IsaTier.GENERIC, native_tier()}), ids=lambda t: t.flag_name)
def test_a_bfloat16_cache_under_float32_matches_transformers(
    tier: IsaTier, tokenizer: Any, hf_reference: list[GreedyRun]
) -> None:
    llm = LLM(
        device="cpu",
        dtype="float32",
        kv_cache_dtype="bfloat16",
        cpu_isa=tier.flag_name,
        **SMALL_ENGINE,
    )
    worker = llm.llm_engine.executor.worker
    caches = worker.model_runner.kv_caches
    assert {cache.dtype for cache in caches} == {torch.bfloat16}
    assert llm.llm_engine.config.cache_config.num_blocks == TEST_KV_BYTES // (FLOAT32_BLOCK_BYTES // 2)
    fused = worker.model.model.fused_cpu is not None
    assert fused == (tier >= IsaTier.AVX2)  # the fused decoder's float32-over-bfloat16 entry point where it runs
    # the generic tier runs torch's ops, slow at the engine's shapes: a third of the prompts keep CI's time
    verdicts = greedy_verdicts(llm, tokenizer, hf_reference, 4 if tier == IsaTier.GENERIC else None)
    print(tier.flag_name, "bfloat16 cache verdicts:", verdicts)
    assert verdicts.count("identical") >= len(verdicts) - 2, verdicts
    assert_no_leaks(llm)


def test_swaps_and_host_prefix_hits_keep_greedy_outputs_over_a_bfloat16_cache(
    make_llm: Callable[..., LLM],
) -> None:
    """The host tier's blocks are bfloat16 too (half the bytes a block); loads give back exactly what was stored."""
    plain = _Run(make_llm(**SMALL_POOL, kv_cache_dtype="bfloat16"), lambda i: GREEDY)
    tiered_llm = make_llm(**SMALL_POOL, kv_cache_dtype="bfloat16", kv_offloading_size=0.05)
    tiered = _Run(tiered_llm, lambda i: GREEDY)
    assert tiered_llm.llm_engine.config.cache_config.num_host_blocks == int(0.05 * 2**30) // (FLOAT32_BLOCK_BYTES // 2)
    stats = tiered.stats
    assert plain.stats.num_preemptions_total > 0
    assert 0 < stats.num_swapped_preemptions_total == stats.num_preemptions_total, stats
    assert stats.kv_offload_blocks_to_device_total > 0 and stats.external_prefix_cache_hits > 0, stats
    assert tiered.tokens == plain.tokens


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, bfloat16, got 'fp8'"):
        CacheConfig(cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, bfloat16, got 'fp8'"):
        LLM(dtype="float32", kv_cache_dtype="fp8", **SMALL_ENGINE)


def test_a_float32_model_over_a_bfloat16_cache_is_refused_off_the_cpu_and_auto_is_the_models_dtype() -> None:
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'bfloat16' under a float32 model runs on the CPU only"):
        resolve_kv_cache_dtype("bfloat16", torch.float32, cuda)
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16  # the model's own type
    assert resolve_kv_cache_dtype("auto", torch.float32, torch.device("cpu")) == torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, torch.device("cpu")) == torch.bfloat16


def test_a_draft_model_over_bfloat16_caches_gives_the_same_tokens(make_llm: Callable[..., LLM]) -> None:
    """The draft's own cache takes the same type; the model as its own draft then proposes what the target picks:
    the tokens without speculation, nearly every draft accepted."""
    from folio import SamplingParams
    from folio.model.loader import default_model_path

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS[:2]]
    common = dict(kv_cache_dtype="bfloat16", kv_cache_memory_bytes=2**27, max_model_len=1024)
    expected = [o.outputs[0].token_ids for o in make_llm(**common).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "draft_model", "model": default_model_path(), "num_speculative_tokens": 4}
    llm = make_llm(**common, speculative_config=spec)
    assert llm.llm_engine.executor.worker.draft_kv_shape.dtype == torch.bfloat16
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    stats = llm.llm_engine.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens, stats
    assert_no_leaks(llm)

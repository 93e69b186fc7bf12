"""Draft-model speculative decoding end to end on the real model.

SmolLM2 as its own draft: greedy outputs identical to decoding without speculation, and the draft's arg-max is the
target's, so nearly every draft is accepted: a real check of the plumbing (the draft's own KV cache under the
target's block tables, its catch-up on accepted tokens, the lookahead slots, prefix-cache hits, preemption). A tiny
random Llama of the same vocabulary as a draft: identical outputs with drafts nearly all rejected. A draft of
another vocabulary is refused by name. The conftest checks every engine for leaked blocks after each test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from folio import LLM, SamplingParams
from folio.core.spec_decode import SpecDecodingStats
from folio.model.loader import default_model_path
from tests.engine.conftest import assert_no_leaks
from tests.engine.prompts import PLAIN_PROMPTS
from tests.engine.test_spec_decode import COPY_PROMPTS
from tests.small_engine import TEST_KV_BYTES
from tests.tiny_models import NoTokenizer, save_tiny_llama

K = 4
SMOLLM2_VOCAB = 49152
# Target and draft K/V share each block: the test budget holds half the tokens, so a shorter max_model_len.
MAX_MODEL_LEN = 1024  # the target and its draft share the KV bytes: 1456 tokens each in TEST_KV_BYTES
PROMPTS = [*COPY_PROMPTS, *PLAIN_PROMPTS[:6]]  # PLAIN_PROMPTS[5]: a long story (~200 tokens)
MAX_TOKENS = [48, 48, 48, 48, 1, 2, 5, 48, 48, 48]  # short ones: drafts cut by max_tokens


def _self_draft(k: int = K) -> dict[str, Any]:
    return {"method": "draft_model", "model": default_model_path(), "num_speculative_tokens": k}


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return [list(completion.token_ids) for output in outputs for completion in output.outputs]


def _delta(llm: LLM, before: tuple[int, int, int]) -> tuple[int, int, int]:
    """(verifications, draft tokens, accepted tokens) since ``before``."""
    stats: SpecDecodingStats = llm.llm_engine.scheduler.spec_decoding_stats
    now = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    return now[0] - before[0], now[1] - before[1], now[2] - before[2]


@pytest.fixture(scope="module")
def self_draft_llm() -> LLM:
    return LLM(
        dtype="float32",
        kv_cache_memory_bytes=TEST_KV_BYTES,
        max_model_len=MAX_MODEL_LEN,
        speculative_config=_self_draft(),
    )


@pytest.fixture(scope="module")
def baseline(llm: LLM) -> list[list[int]]:
    return _tokens(llm, PROMPTS, [_greedy(n) for n in MAX_TOKENS])


def test_self_draft_gives_the_same_tokens_and_accepts_nearly_every_draft(
    self_draft_llm: LLM, baseline: list[list[int]]
) -> None:
    got = _tokens(self_draft_llm, PROMPTS, [_greedy(n) for n in MAX_TOKENS])
    for i, (want, have) in enumerate(zip(baseline, got, strict=True)):
        assert have == want, f"request {i} ({PROMPTS[i][:30]!r})"
    verifications, drafted, accepted = _delta(self_draft_llm, (0, 0, 0))
    assert verifications > 0 and accepted >= 0.95 * drafted, (verifications, drafted, accepted)
    mean_acceptance_length = 1 + accepted / verifications
    assert mean_acceptance_length > 0.9 * (K + 1), mean_acceptance_length
    # The long prompt again: its blocks come from the prefix cache, the draft's K/V in them too (still accepted).
    manager, before = self_draft_llm.llm_engine.kv_cache_manager, _delta(self_draft_llm, (0, 0, 0))
    hits = manager.prefix_cache_hits
    assert _tokens(self_draft_llm, PROMPTS[-1:], [_greedy(48)]) == baseline[-1:]
    assert manager.prefix_cache_hits - hits >= 8 * 16  # 12 of its blocks
    verifications, drafted, accepted = _delta(self_draft_llm, before)
    assert verifications > 0 and accepted >= 0.95 * drafted, (verifications, drafted, accepted)


def test_self_draft_with_requests_verified_by_the_sampler(llm: LLM, self_draft_llm: LLM) -> None:
    """Logprobs, penalties, a seeded sampled request with n = 2: the tokens of decoding without drafts."""
    prompts = [COPY_PROMPTS[0], COPY_PROMPTS[1], COPY_PROMPTS[3]]
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    params = [
        SamplingParams(**greedy, logprobs=2),
        SamplingParams(**greedy, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, n=2, max_tokens=24, ignore_eos=True),
    ]
    stats = self_draft_llm.llm_engine.scheduler.spec_decoding_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert _tokens(self_draft_llm, prompts, params) == _tokens(llm, prompts, params)
    verifications, _, accepted = _delta(self_draft_llm, before)
    assert verifications > 0 and accepted > 0


def test_tiny_random_draft_gives_the_same_tokens_with_drafts_rejected(
    make_llm: Callable[..., LLM], baseline: list[list[int]], tmp_path: Path
) -> None:
    draft = save_tiny_llama(
        tmp_path / "draft", tokenizer=NoTokenizer(), vocab_size=SMOLLM2_VOCAB, max_position_embeddings=MAX_MODEL_LEN
    )
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    spec_llm = make_llm(speculative_config=spec, max_model_len=MAX_MODEL_LEN)
    assert _tokens(spec_llm, PROMPTS[:7], [_greedy(n) for n in MAX_TOKENS[:7]]) == baseline[:7]
    verifications, drafted, accepted = _delta(spec_llm, (0, 0, 0))
    assert verifications > 0 and drafted > 2 * verifications  # drafts were proposed (3 each but near the end)
    assert accepted < 0.2 * drafted, (drafted, accepted)  # random weights: almost never the target's token


def test_self_draft_under_chunked_prefill_and_preemption(
    make_llm: Callable[..., LLM], baseline: list[list[int]]
) -> None:
    """24 blocks of 16 for 11 requests (preemptions, recompute through the prefix cache) and a budget of 32 tokens
    (chunked prefill, drafts cut by the budget): the same tokens, and the draft's cache still right (acceptance)."""
    tight: Any = make_llm(
        speculative_config=_self_draft(), max_num_batched_tokens=32, num_gpu_blocks_override=24, max_model_len=256
    )
    assert _tokens(tight, PROMPTS, [_greedy(n) for n in MAX_TOKENS]) == baseline
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    _, drafted, accepted = _delta(tight, (0, 0, 0))
    assert accepted >= 0.9 * drafted, (drafted, accepted)


def test_a_draft_of_another_vocabulary_or_path_is_refused_by_name(tmp_path: Path) -> None:
    other = save_tiny_llama(tmp_path / "other_vocab")  # 96 tokens
    for path, message in [
        (other, r"speculative_config.model '.*other_vocab' has a vocabulary of 96 tokens, the target 49152"),
        (str(tmp_path / "missing"), r"speculative_config.model '.*missing': model path does not exist"),
    ]:
        spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
        with pytest.raises(ValueError, match=message):
            LLM(
                dtype="float32",
                kv_cache_memory_bytes=TEST_KV_BYTES,
                max_model_len=MAX_MODEL_LEN,
                speculative_config=spec,
            )

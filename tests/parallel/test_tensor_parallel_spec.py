"""Speculative decoding under tensor parallelism (issue 19's methods on issue 20's ranks), tp=2 with uneven heads.
N-gram drafts on the real model: every rank proposes from the same tokens. A model as its own draft: the draft is
the sharded target itself (its forward makes the same collectives on every rank), so nearly every draft is accepted.
A separate tiny random draft of the same vocabulary: every rank runs it whole, with no collectives, and proposes the
same drafts. Every way, the greedy tokens are tp=2's without speculation. The two draft-model cases run on a random
model of SmolLM2's layout (9 query heads, 3 KV heads): every rank loads the whole target and draft, and on the real
model the two took 37 of this file's 50 CPU-s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from folio import LLM, SamplingParams
from tests.engine.test_spec_decode import COPY_PROMPTS
from tests.parallel.conftest import shutdown
from tests.tiny_models import SMOLLM2_LAYOUT, NoTokenizer, save_tiny_llama

TP2 = dict(tensor_parallel_size=2, tensor_parallel_uneven_heads=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = COPY_PROMPTS[1:3]
LAYOUT_VOCAB = 512
LAYOUT_PROMPTS = [{"prompt_token_ids": [1, *range(40, 80)]}, {"prompt_token_ids": [1, *[7, 8, 9, 10] * 6]}]


def _run(llm: LLM, prompts: list[Any] = PROMPTS) -> tuple[list[list[int]], tuple[int, int, int]]:
    """Greedy tokens, then (verifications, draft tokens, accepted tokens); the engine shut down."""
    try:
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        stats = llm.llm_engine.scheduler.spec_decoding_stats
        return tokens, (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def tp2_tokens(make_engine: Callable[..., LLM]) -> list[list[int]]:
    return _run(make_engine(**TP2))[0]


@pytest.fixture(scope="module")
def layout_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(
        tmp_path_factory.mktemp("spec_layout"),
        vocab_size=LAYOUT_VOCAB,
        num_hidden_layers=2,
        max_position_embeddings=256,
        initializer_range=0.25,
        **SMOLLM2_LAYOUT,
    )


@pytest.fixture(scope="module")
def layout_tp2_tokens(make_engine: Callable[..., LLM], layout_model: str) -> list[list[int]]:
    return _run(make_engine(layout_model, **TP2), LAYOUT_PROMPTS)[0]


def test_tp2_with_the_self_draft_gives_tp2s_tokens_and_accepts_nearly_every_draft(
    make_engine: Callable[..., LLM], layout_model: str, layout_tp2_tokens: list[list[int]]
) -> None:
    spec = {"method": "draft_model", "model": layout_model, "num_speculative_tokens": 4}
    tokens, (verifications, drafted, accepted) = _run(
        make_engine(layout_model, **TP2, speculative_config=spec), LAYOUT_PROMPTS
    )
    assert tokens == layout_tp2_tokens
    assert verifications > 0 and accepted >= 0.9 * drafted, (verifications, drafted, accepted)


def test_tp2_with_a_separate_draft_run_whole_on_every_rank_gives_tp2s_tokens(
    make_engine: Callable[..., LLM], layout_model: str, layout_tp2_tokens: list[list[int]], tmp_path: Path
) -> None:
    draft = save_tiny_llama(
        tmp_path / "draft", tokenizer=NoTokenizer(), vocab_size=LAYOUT_VOCAB, max_position_embeddings=256
    )
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    tokens, (verifications, drafted, accepted) = _run(
        make_engine(layout_model, **TP2, speculative_config=spec), LAYOUT_PROMPTS
    )
    assert tokens == layout_tp2_tokens
    assert verifications > 0 and drafted > 2 * verifications and accepted < 0.2 * drafted, (drafted, accepted)


def test_tp2_with_ngram_drafts_gives_tp2s_tokens(make_engine: Callable[..., LLM], tp2_tokens: list[list[int]]) -> None:
    """The n-gram proposer runs on every rank from the same tokens: the same drafts everywhere."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    tokens, (verifications, drafted, accepted) = _run(make_engine(**TP2, speculative_config=spec))
    assert tokens == tp2_tokens
    assert verifications > 0 and accepted > 0, (verifications, drafted, accepted)

"""Folio vs Hugging Face transformers on the same weights (the default GGUF, float32): greedy, one batch."""

from __future__ import annotations

from typing import Any

from folio import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks, greedy_verdicts
from tests.engine.greedy_compare import GreedyRun
from tests.engine.prompts import all_prompt_token_ids


def test_greedy_batch_matches_transformers(llm: LLM, tokenizer: Any, hf_reference: list[GreedyRun]) -> None:
    prompts = all_prompt_token_ids(tokenizer)
    assert len(prompts) >= 8
    assert len({len(p) for p in prompts}) >= 8, "prompts of varied length"
    verdicts = greedy_verdicts(llm, tokenizer, hf_reference)
    print("per-prompt verdicts:", verdicts)
    # float noise may flip a near-tie, but most prompts must match exactly
    assert verdicts.count("identical") >= len(verdicts) - 2, verdicts
    assert_no_leaks(llm)


def test_chat_capital_of_france(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
        use_tqdm=False,
    )
    assert out[0].outputs[0].text.startswith("The capital of France is Paris")
    assert out[0].outputs[0].finish_reason == "stop"
    assert_no_leaks(llm)

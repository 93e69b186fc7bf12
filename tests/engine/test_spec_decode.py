"""n-gram speculative decoding end to end on the real model: greedy outputs identical to decoding without it,
for a batch of mixed prompts (copy-heavy ones, others, and requests that do not speculate), with drafts really
accepted; no block leaks (the conftest checks every engine after each test)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from folio import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks
from tests.engine.prompts import PLAIN_PROMPTS

_PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold. "
)
_CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
COPY_PROMPTS = [
    "Repeat the following text exactly.\nText: " + _PASSAGE + "\nRepeated text: " + _PASSAGE[:40],
    _CODE,
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
    _PASSAGE * 3,
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def _generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def prompts_and_params() -> tuple[list[str], list[SamplingParams]]:
    prompts = COPY_PROMPTS + PLAIN_PROMPTS[:5]
    params = [GREEDY] * len(prompts)
    # Requests verified through the sampler's pipeline share the batch: logprobs, a penalty, a seeded sampled one.
    prompts += [COPY_PROMPTS[0], COPY_PROMPTS[1], COPY_PROMPTS[3]]
    params += [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=7),
    ]
    return prompts, params


def test_greedy_outputs_identical_with_ngram_speculation(
    llm: LLM, make_llm: Callable[..., LLM], prompts_and_params: tuple[list[str], list[SamplingParams]]
) -> None:
    prompts, params = prompts_and_params
    baseline = _generate(llm, prompts, params)
    spec_llm = make_llm(speculative_config=SPEC)
    speculative = _generate(spec_llm, prompts, params)
    for i, (want, got) in enumerate(zip(baseline, speculative, strict=True)):
        assert got == want, f"request {i} ({prompts[i][:30]!r}): {got} != {want}"
    stats = spec_llm.llm_engine.scheduler.spec_decoding_stats
    # Drafts were proposed, verified and mostly accepted on the copy-heavy prompts.
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    assert stats.mean_acceptance_length > 1.5, stats
    assert len(stats.num_accepted_tokens_per_pos) == 4


def test_max_tokens_and_stops_are_exact_with_speculation(make_llm: Callable[..., LLM], llm: LLM) -> None:
    """max_tokens cuts drafts (never more tokens than asked); one prompt alone and in a batch of one."""
    spec_llm = make_llm(speculative_config=SPEC, max_num_seqs=1)
    for max_tokens in (1, 2, 5, 13):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        want = _generate(llm, [COPY_PROMPTS[2]], [params])
        got = _generate(spec_llm, [COPY_PROMPTS[2]], [params])
        assert got == want and len(got[0]) == max_tokens


def test_speculation_under_chunked_prefill_and_preemption(
    make_llm: Callable[..., LLM], llm: LLM, prompts_and_params: tuple[list[str], list[SamplingParams]]
) -> None:
    """A small token budget (chunked prefill, drafts cut by the budget) and few KV blocks (preemption)."""
    prompts, params = prompts_and_params
    greedy = [(p, s) for p, s in zip(prompts, params, strict=True) if s.temperature == 0.0]
    baseline = _generate(llm, [p for p, _ in greedy], [s for _, s in greedy])
    tight: Any = make_llm(
        speculative_config=SPEC, max_num_batched_tokens=32, num_gpu_blocks_override=24, max_model_len=256
    )
    got = _generate(tight, [p for p, _ in greedy], [s for _, s in greedy])
    assert got == baseline
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    assert tight.llm_engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0


def test_a_step_with_drafted_and_undrafted_greedy_rows_runs_the_lm_head_once(make_llm: Callable[..., LLM]) -> None:
    """The fused arg-max streams the whole LM-head weight: a step whose greedy batch mixes drafted requests and
    requests without drafts picks every row's token in one call, not one call per group."""
    spec_llm = make_llm(speculative_config=SPEC)
    runner = spec_llm.llm_engine.executor.worker.model_runner
    model = runner.model
    calls_in_step: list[int] = []
    mixed_steps: list[int] = []
    real_argmax, real_logits, real_execute = model.compute_greedy_token_ids, model.compute_logits, runner.execute_model

    # a pass of the LM head: the fused arg-max (CPU), or the logits where the model has none (CUDA)
    def counting_argmax(rows: Any) -> Any:
        token_ids = real_argmax(rows)
        calls_in_step[-1] += token_ids is not None
        return token_ids

    def counting_logits(rows: Any) -> Any:
        calls_in_step[-1] += 1
        return real_logits(rows)

    def counting_execute(sched: Any) -> Any:
        calls_in_step.append(0)
        num_drafted = len(sched.scheduled_spec_decode_tokens)
        if 0 < num_drafted < len(sched.num_scheduled_tokens):
            mixed_steps.append(len(calls_in_step) - 1)
        return real_execute(sched)

    model.compute_greedy_token_ids = counting_argmax
    model.compute_logits = counting_logits
    runner.execute_model = counting_execute
    _generate(spec_llm, [COPY_PROMPTS[2], PLAIN_PROMPTS[0], COPY_PROMPTS[3]], [GREEDY] * 3)
    assert mixed_steps, "no step mixed drafted and undrafted requests: the test checks nothing"
    assert [calls_in_step[step] for step in mixed_steps] == [1] * len(mixed_steps)

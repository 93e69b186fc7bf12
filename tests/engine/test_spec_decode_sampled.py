"""n-gram speculation for requests that are not plain greedy, on the real model: sampled (temperature, top-p,
top-k) seeded requests, greedy requests with logprobs, and requests with penalties, bad words and min_tokens.

Each row of a drafted request is sampled as plain decoding samples that output position (the same pipeline, the
drafts before it as output history, a seeded request's generator of that position), so the outputs equal those
without speculation, token for token; drafts are really proposed and accepted for these requests.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from folio import LLM, SamplingParams
from folio.outputs import RequestOutput
from tests.engine.conftest import assert_no_leaks
from tests.engine.test_spec_decode import COPY_PROMPTS, SPEC
from tests.small_engine import SMALL_ENGINE


def _run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[RequestOutput]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return outputs


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    return LLM(dtype="float32", **SMALL_ENGINE, speculative_config=SPEC)


def test_seeded_sampled_requests_speculate_reproducibly(llm: LLM, spec_llm: LLM) -> None:
    """Seeded temperature > 0 requests: the same tokens on two runs, alone or in a batch, and the same as without
    speculation (each emitted token is the plain sampler's draw at its position)."""
    prompts = COPY_PROMPTS * 2
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k, seed=seed, max_tokens=32, ignore_eos=True)
        for seed, (t, p, k) in enumerate([(0.8, 1.0, 0), (1.0, 0.9, 0), (0.7, 1.0, 40), (1.2, 0.95, 20)] * 2)
    ]
    stats = spec_llm.llm_engine.scheduler.spec_decoding_stats
    before = (stats.num_drafts, stats.num_accepted_tokens)
    first = _tokens(_run(spec_llm, prompts, params))
    assert stats.num_drafts > before[0] and stats.num_accepted_tokens > before[1], stats
    assert _tokens(_run(spec_llm, prompts, params)) == first
    assert _tokens(_run(spec_llm, prompts[5:6], params[5:6])) == first[5:6]  # alone
    assert _tokens(_run(llm, prompts, params)) == first
    assert len({tuple(tokens) for tokens in first}) > 4  # the seeds matter: not all the same sample


def test_logprobs_and_penalties_speculate_with_the_plain_results(llm: LLM, spec_llm: LLM) -> None:
    """Greedy requests with logprobs, penalties, bad words or min_tokens: the tokens of decoding without drafts,
    and the logprobs of every accepted token equal the plain path's at that position."""
    prompts = [COPY_PROMPTS[0], COPY_PROMPTS[1], COPY_PROMPTS[3], COPY_PROMPTS[2], COPY_PROMPTS[3]]
    greedy = {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}
    params = [
        SamplingParams(**greedy, logprobs=3),
        SamplingParams(**greedy, frequency_penalty=0.4, presence_penalty=0.2, logprobs=0),
        SamplingParams(**greedy, repetition_penalty=1.1),
        SamplingParams(**greedy, bad_words=[" 3"], min_tokens=30),
        SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True, frequency_penalty=0.3, logprobs=2),
    ]
    stats = spec_llm.llm_engine.scheduler.spec_decoding_stats
    before = (stats.num_drafts, stats.num_accepted_tokens)
    got = _run(spec_llm, prompts, params)
    assert stats.num_drafts > before[0] and stats.num_accepted_tokens > before[1], stats
    want = _run(llm, prompts, params)
    assert _tokens(got) == _tokens(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g_logprobs, w_logprobs = g.outputs[0].logprobs, w.outputs[0].logprobs
        if params[i].logprobs is None:
            assert g_logprobs is None
            continue
        assert g_logprobs is not None and w_logprobs is not None and len(g_logprobs) == len(w_logprobs) == 40
        for position, (g_pos, w_pos) in enumerate(zip(g_logprobs, w_logprobs, strict=True)):
            assert list(g_pos) == list(w_pos), (i, position)  # the chosen token, then the same top k
            for token_id, w_logprob in w_pos.items():
                assert g_pos[token_id].rank == w_logprob.rank, (i, position)
                assert g_pos[token_id].logprob == pytest.approx(w_logprob.logprob, abs=1e-4), (i, position)


def test_sampled_speculation_under_preemption(make_llm: Callable[..., LLM], llm: LLM) -> None:
    """Few KV blocks and a small budget: seeded sampled requests still give the plain tokens after preemptions."""
    prompts = COPY_PROMPTS * 2
    params = [SamplingParams(temperature=0.8, seed=seed, max_tokens=40, ignore_eos=True) for seed in range(8)]
    tight = make_llm(speculative_config=SPEC, max_num_batched_tokens=32, num_gpu_blocks_override=24, max_model_len=256)
    got = _tokens(_run(tight, prompts, params))
    assert tight.llm_engine.scheduler.num_preemptions_total > 0
    assert tight.llm_engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    assert got == _tokens(_run(llm, prompts, params))

"""Sampling features end to end on the real model: seeds, n > 1 with shared blocks, stops, logprobs."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from folio import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks

PROMPT = "Once upon a time"


def test_seeded_sampling_alone_equals_in_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=s) for s in (7, None, 99)]
    batch = llm.generate(
        ["Hello there", PROMPT, "The weather today", "def main():"],
        [others[0], seeded, others[1], others[2]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    different_seed = llm.generate(
        [PROMPT], SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=24, ignore_eos=True), use_tqdm=False
    )
    assert different_seed[0].outputs[0].token_ids != alone
    assert_no_leaks(llm)


def test_n_samples_share_prompt_blocks(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(enable_prefix_caching=False)  # sharing must come from the fork, not from prefix hits
    prompt = "Write three words about the ocean:" * 3  # a prompt ending in a partial block
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "different seeds per sample give different text"
    assert all(len(c.token_ids) == 16 for c in out.outputs)
    assert llm.llm_engine.kv_cache_manager.num_cow_copies > 0, "the shared partial block was copied before writing"
    assert_no_leaks(llm)
    # n greedy samples are all the single greedy answer
    greedy = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[
        0
    ]
    single = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert all(c.token_ids == single.outputs[0].token_ids for c in greedy.outputs)
    assert_no_leaks(llm)


def test_stop_strings_and_finish_reasons(llm: LLM) -> None:
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 20
    assert " 6" in base.text
    stopped = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop=[" 6"]), use_tqdm=False)[
        0
    ].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 6"
    assert stopped.text == base.text[: base.text.index(" 6")]
    kept = llm.generate(
        ["1, 2, 3, 4,"],
        SamplingParams(temperature=0, max_tokens=20, stop=[" 6"], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == base.text[: base.text.index(" 6") + 2]
    token_stop = base.token_ids[3]
    by_token = llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[token_stop]), use_tqdm=False
    )[0].outputs[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token_stop
    assert by_token.token_ids == base.token_ids[: base.token_ids.index(token_stop) + 1]
    assert_no_leaks(llm)


def test_eos_min_tokens_and_ignore_eos(llm: LLM) -> None:
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.stop_reason is None and short.token_ids[-1] == 2
    longer = llm.chat(
        chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(short.token_ids) + 3), use_tqdm=False
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 3
    ignored = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[
        0
    ]
    assert len(ignored.token_ids) == 40 and ignored.finish_reason == "length"
    assert_no_leaks(llm)


def test_logprobs_and_prompt_logprobs(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 5
    total = 0.0
    for token_id, step in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in step and step[token_id].rank == 1  # greedy picks the most likely token
        assert 3 <= len(step) <= 4
        assert all(lp.logprob <= 0 for lp in step.values())
        total += step[token_id].logprob
    assert completion.cumulative_logprob is not None and math.isclose(
        completion.cumulative_logprob, total, rel_tol=1e-5
    )
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None
    for token_id, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert step is not None and token_id in step
    assert_no_leaks(llm)


def test_prompt_logprobs_once_per_token_when_preempted_during_chunked_prefill(
    make_llm: Callable[..., LLM], tokenizer: Any
) -> None:
    """A request preempted mid-prefill recomputes its prompt from position 0; the positions it had already
    delivered prompt logprobs for must not be delivered again (they were, twice, before the fix).

    The KV cache holds 2 blocks of 16 tokens and a step 16 tokens. "a" (15 prompt tokens) comes first, "b" (30,
    with prompt_logprobs) second: step 1 runs a[0:15] + b[0:1], step 2 a's position 15 + b[1:16], and in step 3
    a's position 16 needs a second block: b, last in running, is preempted after positions 0..15 delivered their
    prompt logprobs. a then fills both blocks until it finishes, and b runs again from position 0.
    """
    llm = make_llm(max_model_len=32, num_gpu_blocks_override=2, max_num_batched_tokens=16)
    text_ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6, add_special_tokens=False)
    prompt_a, prompt_b = text_ids[:15], text_ids[15:45]
    assert (len(prompt_a), len(prompt_b)) == (15, 30)
    params_a = SamplingParams(temperature=0, max_tokens=17, ignore_eos=True)
    params_b = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)

    alone = llm.generate([{"prompt_token_ids": prompt_b}], params_b, use_tqdm=False)[0]
    assert llm.llm_engine.scheduler.num_preemptions_total == 0
    out_a, out_b = llm.generate(
        [{"prompt_token_ids": prompt_a}, {"prompt_token_ids": prompt_b}], [params_a, params_b], use_tqdm=False
    )
    assert llm.llm_engine.scheduler.num_preemptions_total == 1, "b must be preempted once, during its prefill"
    assert len(out_a.outputs[0].token_ids) == 17

    # One entry per prompt token, the first None (no token before it), as vLLM returns them.
    assert out_b.prompt_logprobs is not None and len(out_b.prompt_logprobs) == len(prompt_b)
    assert out_b.prompt_logprobs[0] is None
    assert alone.prompt_logprobs is not None and len(alone.prompt_logprobs) == len(prompt_b)
    for position, (token_id, got, want) in enumerate(
        zip(prompt_b[1:], out_b.prompt_logprobs[1:], alone.prompt_logprobs[1:], strict=True), start=1
    ):
        assert got is not None and want is not None
        assert token_id in got and sorted(got) == sorted(want), position  # the prompt token and the same top-2
        for token in want:
            assert got[token].rank == want[token].rank, (position, token)
            assert math.isclose(got[token].logprob, want[token].logprob, abs_tol=1e-4), (position, token)
    assert out_b.outputs[0].token_ids == alone.outputs[0].token_ids
    assert_no_leaks(llm)


def test_multibyte_text_is_clean(llm: LLM) -> None:
    out = llm.generate(
        ["Les caractères accentués: é, è, à, ç. En japonais: こんにちは"],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )
    assert "\ufffd" not in out[0].outputs[0].text
    assert_no_leaks(llm)


def test_greedy_without_logits_equals_greedy_from_logits(llm: LLM, monkeypatch: Any) -> None:
    # Plain greedy rows take the LM head's fused arg-max (no logits); asking for logprobs forces the logits path.
    model = llm.llm_engine.executor.worker.model
    calls: list[int] = []
    fused_argmax = model.compute_greedy_token_ids

    def counting(hidden: Any) -> Any:
        calls.append(hidden.shape[0])
        return fused_argmax(hidden)

    monkeypatch.setattr(model, "compute_greedy_token_ids", counting)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert calls and all(n >= 1 for n in calls)
    num_calls = len(calls)
    with_logits = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, logprobs=1), use_tqdm=False)
    assert len(calls) == num_calls  # the logprobs run never asked for the fused arg-max
    for a, b in zip(plain, with_logits, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_no_leaks(llm)

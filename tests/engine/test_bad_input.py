"""Bad input raises a ValueError naming the field and the limit, and leaves nothing allocated."""

from __future__ import annotations

import pytest

from folio import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"seed": 2**70}, "seed must be a signed 64-bit integer"),
    ],
)
def test_sampling_params_out_of_range(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_engine_rejects_bad_requests_and_keeps_nothing(llm: LLM) -> None:
    max_len = llm.llm_engine.config.scheduler_config.max_model_len
    vocab = llm.llm_engine.model_spec.vocab_size
    cases = [
        ([""], SamplingParams(), "prompt must not be empty"),
        ([{"prompt_token_ids": []}], SamplingParams(), "prompt_token_ids must not be empty"),
        ([[1, 2, vocab + 5]], SamplingParams(), f"outside the vocabulary \\[0, {vocab}\\)"),
        ([[5] * max_len], SamplingParams(), f"max_model_len {max_len}"),
        ([[5] * 10], SamplingParams(max_tokens=max_len), f"max_tokens {max_len}.*max_model_len {max_len}"),
        (["hi"], SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
        (["hi"], SamplingParams(logit_bias={vocab + 1: 1.0}), "logit_bias"),
        # a lone surrogate makes the tokenizer raise TypeError: the caller's input, so a ValueError naming it
        (["hi\ud800"], SamplingParams(), "prompt could not be tokenized"),
        (["hi"], SamplingParams(bad_words=["ok", "\ud800"]), r"bad_words\[1\] could not be tokenized"),
    ]
    for prompts, params, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            llm.generate(["A fine prompt", *prompts], params, use_tqdm=False)
        assert_no_leaks(llm)
    # the engine still serves afterwards
    assert llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_unknown_engine_argument() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=3)


def test_engine_refuses_a_duplicate_request_id(llm: LLM) -> None:
    """A second add_request under a live id is a ValueError naming it and changes nothing: the first request runs
    to its end as if alone, and the id is free again afterwards."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    alone = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids
    for _ in range(2):
        engine.add_request("dup", "Hello", params)
        with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
            engine.add_request("dup", "Goodbye", params)
        finished = []
        while engine.has_unfinished_requests():
            finished += [out for out in engine.step() if out.finished]
        assert [(out.request_id, out.prompt, out.outputs[0].token_ids) for out in finished] == [("dup", "Hello", alone)]
        assert_no_leaks(llm)


def test_a_kv_budget_below_one_block_fails_before_the_weights_are_read(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block's bytes come from the model's spec, so a budget too small for one fails before the load (minutes for
    a large model), naming the same figure the loaded engine's worker uses."""
    import folio.worker.worker as worker_module

    bytes_per_block = llm.llm_engine.executor.worker.bytes_per_block
    loads: list[object] = []
    monkeypatch.setattr(worker_module, "load_model", lambda *args, **kwargs: loads.append(args))
    message = f"kv_cache_memory_bytes {bytes_per_block - 1} holds no KV block \\(one block needs {bytes_per_block} "
    with pytest.raises(ValueError, match=message):
        LLM(dtype="float32", kv_cache_memory_bytes=bytes_per_block - 1)
    assert loads == []

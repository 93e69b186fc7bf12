"""/v1/completions through the official openai client and raw httpx, on the shared real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from folio import LLM, SamplingParams
from tests.server.conftest import MODEL_NAME, TEST_KV_BYTES, ServerProcess

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES)


def tokenize(server: ServerProcess, **body: Any) -> list[int]:
    response = httpx.post(server.url("/tokenize"), json=body, timeout=30)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["count"] == len(data["tokens"])
    return list(data["tokens"])


def sse_events(server: ServerProcess, path: str, body: dict[str, Any]) -> list[Any]:
    """The stream's data payloads, parsed; the last one must be [DONE] (returned as the string)."""
    events: list[Any] = []
    with httpx.stream("POST", server.url(path), json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]"
    return events


def test_greedy_text_equals_llm_generate(client: Any, llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = [out.outputs[0].text for out in llm.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, text in zip(PROMPTS, expected, strict=True):
        completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
        assert completion.choices[0].text == text
        assert completion.model == MODEL_NAME and completion.object == "text_completion"


def test_greedy_chat_equals_llm_chat(client: Any, llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == expected.text
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == len(expected.token_ids)


def test_usage_equals_token_counts(client: Any, server: ServerProcess) -> None:
    prompt = "Count to ten: one, two, three"
    completion = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}
    )
    num_prompt = len(tokenize(server, prompt=prompt))
    assert completion.usage.prompt_tokens == num_prompt
    assert completion.usage.completion_tokens == 7
    assert completion.usage.total_tokens == num_prompt + 7
    messages = [{"role": "user", "content": "Say hello"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=5)
    assert chat.usage.prompt_tokens == len(tokenize(server, messages=messages))
    assert chat.usage.completion_tokens <= 5


def test_stream_equals_non_stream(client: Any, server: ServerProcess) -> None:
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    events = sse_events(server, "/v1/completions", body)
    chunks = events[:-1]
    usage_chunk = chunks.pop()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole.usage.model_dump(exclude_none=True)
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.choices[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason == "length"
    # the openai client's streaming reads the same
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_n2_choices_and_usage(client: Any) -> None:
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in completion.choices] == [0, 1]
    assert completion.usage.completion_tokens == 16
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="Once upon a time",
        n=2,
        max_tokens=8,
        temperature=1.0,
        seed=7,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in completion.choices]  # same seed, same samples


def test_multiple_prompts_and_token_ids(client: Any, server: ServerProcess) -> None:
    ids = tokenize(server, prompt=PROMPTS[0])
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=6, temperature=0)
    assert [c.index for c in by_text.choices] == [0, 1]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    by_id_lists = client.completions.create(model=MODEL_NAME, prompt=[ids, ids], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in by_id_lists.choices] == [0, 1, 2, 3]
    assert {c.text for c in by_id_lists.choices} == {by_text.choices[0].text}
    assert by_id_lists.usage.prompt_tokens == 2 * len(ids)


def test_logprobs(client: Any) -> None:
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    choice = completion.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0
        assert 3 <= len(top) <= 4 and token in top
        assert top[token] == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    streamed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3, stream=True
    )
    tokens, offsets = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_stop_strings(client: Any) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[len(words) // 2]
    for stream in (False, True):
        response = client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop], stream=stream
        )
        if stream:
            chunks = [c for c in response if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = response.choices[0].text, response.choices[0].finish_reason
        assert text == full[: full.index(stop)]
        assert finish == "stop"


def test_seed_reproducible(client: Any) -> None:
    def sample(seed: int) -> str:
        kwargs = {"max_tokens": 12, "temperature": 1.0, "seed": seed}
        return str(
            client.completions.create(model=MODEL_NAME, prompt="My favourite animal is", **kwargs).choices[0].text
        )

    assert sample(1234) == sample(1234)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


def test_vllm_extra_sampling_fields_accepted(client: Any) -> None:
    extra = {
        "top_k": 5,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 3,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "priority": 0,
    }
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=4,
        seed=1,
        user="someone",
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"2": -100},
        extra_body=extra,
    )
    assert completion.usage.completion_tokens == 4


def test_max_tokens_null_fills_the_context(server: ServerProcess) -> None:
    """Token ids near max_model_len with max_tokens null: the request gets exactly the room left."""
    max_model_len = httpx.post(server.url("/tokenize"), json={"prompt": "x"}).json()["max_model_len"]
    ids = tokenize(server, prompt="hello world " * 8)
    prompt = (ids * (max_model_len // len(ids) + 1))[: max_model_len - 3]
    body = {"prompt": prompt, "max_tokens": None, "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=300)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    assert response.json()["choices"][0]["finish_reason"] == "length"

"""/v1/completions through the official openai client and raw httpx, on the shared real server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from folio import LLM, SamplingParams
from tests.server.conftest import MODEL_NAME, ServerProcess
from tests.small_engine import SMALL_ENGINE

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(dtype="float32", **SMALL_ENGINE)


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


def test_the_api_server_process_never_loads_torch(client: Any, server: ServerProcess) -> None:
    """The API server process tokenizes and serves HTTP; only the engine core needs torch, whose import costs every
    server start about 1.5 s of CPU. (The one-core path once imported it just to read torch's thread count.)"""
    completion = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, temperature=0)
    assert completion.usage.completion_tokens == 2
    maps = Path(f"/proc/{server.process.pid}/maps").read_text()
    assert "libtorch" not in maps, "the API server process loaded torch"


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


def complete(server: ServerProcess, prompt: str, **fields: Any) -> dict[str, Any]:
    """One greedy /v1/completions call (8 tokens unless given) with extra body fields; the first choice plus usage."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    return {**data["choices"][0], "num_tokens": data["usage"]["completion_tokens"]}


def chat_hi(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    """Greedy chat "Hi": the model answers in 10 tokens and ends with EOS (a short answer to hold EOS back on)."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0, **fields}
    response = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    choice = data["choices"][0]
    return {"text": choice["message"]["content"], "finish_reason": choice["finish_reason"], **data["usage"]}


def one_token(server: ServerProcess, text: str) -> int:
    (token_id,) = tokenize(server, prompt=text)
    return token_id


# vLLM's extra fields, each shown to change what comes out (the baseline is the same request without it).
# `priority` needs a full batch under the priority policy: tests/server/test_lifecycle.py (its own small server).
# `seed` has tests/server/test_completions.py::test_seed_reproducible.


def test_logit_bias_forces_a_token(server: ServerProcess) -> None:
    banana = one_token(server, " banana")
    assert complete(server, "Hello")["text"] != " banana" * 8
    assert complete(server, "Hello", logit_bias={str(banana): 100})["text"] == " banana" * 8


def test_allowed_token_ids_restrict_the_vocabulary(server: ServerProcess) -> None:
    allowed = [one_token(server, ","), one_token(server, "-")]
    assert set(complete(server, "Hello")["text"]) - {",", "-"}
    restricted = complete(server, "Hello", allowed_token_ids=allowed, temperature=1.0, seed=3)
    assert restricted["num_tokens"] == 8 and set(restricted["text"]) <= {",", "-"}, restricted["text"]


def test_bad_words_are_never_generated(server: ServerProcess) -> None:
    assert "-by" in complete(server, "Hello")["text"]
    assert "-by" not in complete(server, "Hello", bad_words=["-by"])["text"]


def test_min_tokens_holds_eos_back(server: ServerProcess) -> None:
    baseline = chat_hi(server)
    assert baseline["finish_reason"] == "stop" and baseline["completion_tokens"] < 12, baseline
    held = chat_hi(server, min_tokens=12)
    assert held["completion_tokens"] >= 12 and held["text"].startswith(baseline["text"]), held


def test_ignore_eos_runs_to_max_tokens(server: ServerProcess) -> None:
    assert chat_hi(server)["finish_reason"] == "stop"
    ignored = chat_hi(server, ignore_eos=True)
    assert ignored["finish_reason"] == "length" and ignored["completion_tokens"] == 16, ignored


def test_stop_token_ids_end_the_request(server: ServerProcess) -> None:
    baseline = complete(server, "Hello")
    assert baseline["finish_reason"] == "length" and baseline["text"].startswith("-by"), baseline
    by = tokenize(server, prompt="-by")[-1]  # the second token the model generates
    stopped = complete(server, "Hello", stop_token_ids=[by])
    assert (stopped["finish_reason"], stopped["stop_reason"], stopped["num_tokens"]) == ("stop", by, 2), stopped


def test_include_stop_str_in_output(server: ServerProcess) -> None:
    assert complete(server, "Hello", stop=["date"])["text"] == "-by-"
    assert complete(server, "Hello", stop=["date"], include_stop_str_in_output=True)["text"] == "-by-date"


def test_skip_special_tokens(server: ServerProcess) -> None:
    """EOS forced three times (logit_bias, ignore_eos): hidden by default, spelled out without skipping."""
    forced = {"logit_bias": {"2": 100}, "ignore_eos": True, "max_tokens": 3}
    assert complete(server, "Hello", **forced)["text"] == ""
    assert complete(server, "Hello", **forced, skip_special_tokens=False)["text"] == "<|im_end|>" * 3


def test_top_k_1_and_min_p_1_are_greedy(server: ServerProcess) -> None:
    """At temperature 1 the n=3 samples differ from greedy; top_k=1 or min_p=1 leave only the greedy token."""
    greedy = complete(server, "Hello")["text"]

    def samples(**fields: Any) -> list[str]:
        body = {"prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "seed": 0, "n": 3, **fields}
        response = httpx.post(server.url("/v1/completions"), json=body, timeout=120)
        assert response.status_code == 200, response.text
        return [choice["text"] for choice in response.json()["choices"]]

    assert any(text != greedy for text in samples())
    assert samples(top_k=1) == [greedy] * 3
    assert samples(min_p=1.0) == [greedy] * 3


@pytest.mark.parametrize(
    ("prompt", "penalty"),
    [
        ("1, 1, 1, 1, 1, 1, 1, 1,", {"repetition_penalty": 1.5}),
        ("1, 1, 1, 1, 1, 1, 1, 1,", {"frequency_penalty": 2.0}),
        ("Hello", {"presence_penalty": 1.0}),
    ],
)
def test_penalties_change_a_repetitive_output(server: ServerProcess, prompt: str, penalty: dict[str, float]) -> None:
    baseline = complete(server, prompt, max_tokens=16)["text"]
    assert complete(server, prompt, max_tokens=16, **penalty)["text"] != baseline


def test_user_is_accepted_and_ignored(server: ServerProcess) -> None:
    """As in vLLM: `user` changes nothing (not the seed, not the sampling)."""
    sampled = {"temperature": 1.0, "seed": 5}
    assert complete(server, "Hello", user="someone", **sampled) == complete(server, "Hello", **sampled)


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

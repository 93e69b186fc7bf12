"""/v1/chat/completions and the small endpoints (/v1/models, /tokenize, /detokenize, /version) on the shared server."""

from __future__ import annotations

from typing import Any

import httpx

from tests.server.conftest import MODEL_NAME, ServerProcess

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_stream_chunks(client: Any) -> None:
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_max_completion_tokens_and_n2(client: Any) -> None:
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=3, n=2, seed=3, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in chat.choices)
    assert chat.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_completion_tokens=3,
        n=2,
        seed=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]


def test_chat_logprobs(client: Any) -> None:
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_chat_stop_string_and_system_prompt(client: Any) -> None:
    messages = [{"role": "system", "content": "You answer briefly."}, *MESSAGES]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    stop = text.split()[1]
    stopped = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0, stop=stop
    )
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_models_version_tokenize_detokenize(client: Any, server: ServerProcess) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    version = httpx.get(server.url("/version")).json()
    assert isinstance(version["version"], str) and version["engine_core_pid"] > 0
    tokens = httpx.post(server.url("/tokenize"), json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    text = httpx.post(server.url("/detokenize"), json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    chat_tokens = httpx.post(server.url("/tokenize"), json={"messages": MESSAGES}).json()
    assert chat_tokens["count"] > tokens["count"]
    assert httpx.get(server.url("/health")).status_code == 200

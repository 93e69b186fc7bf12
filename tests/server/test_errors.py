"""Each bad request gets its status and OpenAI's error envelope, and the server still serves the next request."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]

# (path, body, status, param, substring of the message)
CASES = [
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 9000}, 400, "max_tokens", "9000"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 10**6}, 400, "max_completion_tokens", "1000000"),
    (COMPLETIONS, {"prompt": "Hi", "temperature": -1}, 400, "temperature", "temperature"),
    (COMPLETIONS, {"prompt": "Hi", "top_p": 1.5}, 400, "top_p", "top_p"),
    (COMPLETIONS, {"prompt": "Hi", "n": 0}, 400, "n", "n must be"),
    (COMPLETIONS, {"prompt": "Hi", "logprobs": 21}, 400, "logprobs", "logprobs"),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", "20"),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    (COMPLETIONS, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature", "temperature"),
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids", "vocabulary"),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt", "vocabulary"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", "empty"),
    (COMPLETIONS, {"prompt": "Hi", "frobnicate": 1}, 400, "frobnicate", "frobnicate"),
    (CHAT, {"messages": MESSAGES, "temperture": 0.5}, 400, "temperture", "temperture"),
    (CHAT, {"messages": [{"role": "user", "content": "Hi", "mood": "x"}]}, 400, "messages[0].mood", "mood"),
    (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role", "role"),
    (CHAT, {"messages": []}, 400, "messages", "messages"),
    (COMPLETIONS, {"max_tokens": 5}, 400, "prompt", "prompt"),
    (COMPLETIONS, {"prompt": "Hi", "echo": True}, 400, "echo", "echo"),
    (COMPLETIONS, {"prompt": "Hi", "suffix": "end"}, 400, "suffix", "suffix"),
    (COMPLETIONS, {"prompt": "Hi", "best_of": 3}, 400, "best_of", "best_of"),
    (COMPLETIONS, {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (COMPLETIONS, {"prompt": "Hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
    (CHAT, {"messages": MESSAGES, "model": "gpt-4"}, 404, "model", "gpt-4"),
]


def assert_envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def assert_still_serving(server: ServerProcess) -> None:
    body = {"prompt": "Hi", "max_tokens": 2}
    assert httpx.post(server.url(COMPLETIONS), json=body, timeout=60).status_code == 200


@pytest.mark.parametrize(("path", "body", "status", "param", "text"), CASES)
def test_error_envelope(
    server: ServerProcess, path: str, body: dict[str, Any], status: int, param: str, text: str
) -> None:
    error = assert_envelope(httpx.post(server.url(path), json=body, timeout=60), status)
    assert error["param"] == param
    assert text in error["message"]
    assert error["type"] == "invalid_request_error"
    assert_still_serving(server)


def test_context_length_message_states_both_numbers(server: ServerProcess) -> None:
    ids = httpx.post(server.url("/tokenize"), json={"prompt": "one two three"}).json()
    body = {"prompt": "one two three", "max_tokens": ids["max_model_len"]}
    error = assert_envelope(httpx.post(server.url(COMPLETIONS), json=body), 400)
    assert str(ids["count"]) in error["message"] and str(ids["max_model_len"]) in error["message"]
    long_prompt = list(range(100, 100 + ids["max_model_len"]))
    error = assert_envelope(httpx.post(server.url(COMPLETIONS), json={"prompt": long_prompt}), 400)
    assert error["param"] == "prompt" and str(ids["max_model_len"]) in error["message"]
    assert_still_serving(server)


@pytest.mark.parametrize(
    "raw", [b'{"prompt": "Hi",', b"not json at all", b"[1, 2, 3]", b"", b'{"prompt": "Hi"}garbage'], ids=str
)
def test_malformed_json(server: ServerProcess, raw: bytes) -> None:
    response = httpx.post(server.url(COMPLETIONS), content=raw, headers={"content-type": "application/json"})
    error = assert_envelope(response, 400)
    assert error["type"] == "invalid_request_error"
    assert_still_serving(server)


def test_unknown_route_and_method(server: ServerProcess) -> None:
    assert_envelope(httpx.get(server.url("/v1/nothing-here")), 404)
    assert_envelope(httpx.get(server.url(COMPLETIONS)), 405)
    assert_still_serving(server)


def test_openai_client_raises_typed_errors(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=10**6)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model=MODEL_NAME, prompt="Hi", extra_body={"top_kk": 3})
    assert unknown.value.param == "top_kk"
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices

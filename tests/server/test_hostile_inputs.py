"""Hostile input against a real `folio serve`: each row gets its exact status, param and code in OpenAI's envelope
(never a 500), and /health answers 200 after it.

Bodies are raw JSON text where Python's json would not write them: lone surrogates as "\\ud800" escapes,
Infinity / NaN literals, integers past 64 bits.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from folio.server.limits import DEFAULT_MAX_N_SEQUENCES, DEFAULT_MAX_REQUEST_BODY_BYTES
from tests.server.conftest import ServerProcess, folio_script

CMPL, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
BIG = 2**70
SURROGATE = r"\ud800"  # as JSON text: a valid escape that decodes to a lone surrogate
JSON_HEADERS = {"content-type": "application/json"}
UNICODE = "invalid_unicode"


@dataclass
class Row:
    name: str
    path: str
    body: str | bytes | dict[str, Any]  # a dict is sent as json.dumps(body); text and bytes as they are
    status: int
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON_HEADERS))
    chunked: bool = False

    def content(self) -> bytes | Iterator[bytes]:
        body = self.body
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        raw = raw.encode() if isinstance(raw, str) else raw
        if self.chunked:
            return (raw[i : i + 2**16] for i in range(0, len(raw), 2**16))
        return raw


def cmpl(extra: str) -> str:
    """A completions body as JSON text: a valid prompt plus ``extra`` fields (raw JSON members)."""
    return '{"prompt": "Hi", "max_tokens": 1, ' + extra + "}"


def chat(extra: str = "", content: str = '"Hi"') -> str:
    """A chat body as JSON text: one user message with ``content`` (raw JSON) plus ``extra`` fields."""
    members = [
        '"messages": [{"role": "user", "content": ' + content + "}]",
        '"max_tokens": 1',
        *([extra] if extra else []),
    ]
    return "{" + ", ".join(members) + "}"


def over_limit_body() -> bytes:
    return b'{"prompt": "' + b"a" * DEFAULT_MAX_REQUEST_BODY_BYTES + b'"}'


ROWS = [
    # -- lone surrogates in every text field: 400 naming the field, before tokenizer, template or error message
    Row("prompt", CMPL, '{"prompt": "abc' + SURROGATE + '"}', 400, "prompt", UNICODE),
    Row("prompt-low-half", CMPL, r'{"prompt": "\udc00"}', 400, "prompt", UNICODE),
    Row("prompt-reversed-pair", CMPL, r'{"prompt": "\ude00\ud83d"}', 400, "prompt", UNICODE),
    Row("prompt-list", CMPL, '{"prompt": ["hi", "' + SURROGATE + '"]}', 400, "prompt[1]", UNICODE),
    Row("stop-str", CMPL, cmpl('"stop": "' + SURROGATE + '"'), 400, "stop", UNICODE),
    Row("stop-list", CMPL, cmpl('"stop": ["ok", "' + SURROGATE + '"]'), 400, "stop[1]", UNICODE),
    Row("bad_words", CMPL, cmpl('"bad_words": ["' + SURROGATE + '"]'), 400, "bad_words[0]", UNICODE),
    Row("model", CMPL, cmpl('"model": "' + SURROGATE + '"'), 400, "model", UNICODE),
    Row("user", CMPL, cmpl('"user": "' + SURROGATE + '"'), 400, "user", UNICODE),
    Row("suffix", CMPL, cmpl('"suffix": "' + SURROGATE + '"'), 400, "suffix", UNICODE),
    Row("unknown-key", CMPL, cmpl('"' + SURROGATE + 'x": 1'), 400, r"\ud800x", UNICODE),
    Row("logit_bias-key", CMPL, cmpl('"logit_bias": {"' + SURROGATE + '": 1}'), 400, r"logit_bias.\ud800", UNICODE),
    Row("chat-content", CHAT, chat(content='"a' + SURROGATE + '"'), 400, "messages[0].content", UNICODE),
    Row("chat-part-text", CHAT, chat(content='[{"type": "text", "text": "' + SURROGATE + '"}]'), 400,
        "messages[0].content[0].text", UNICODE),
    Row("chat-part-type", CHAT, chat(content='[{"type": "' + SURROGATE + '", "text": "x"}]'), 400,
        "messages[0].content[0].type", UNICODE),
    Row("chat-name", CHAT, '{"messages": [{"role": "user", "content": "Hi", "name": "' + SURROGATE + '"}]}', 400,
        "messages[0].name", UNICODE),
    Row("chat-role", CHAT, '{"messages": [{"role": "' + SURROGATE + '", "content": "Hi"}]}', 400,
        "messages[0].role", UNICODE),
    Row("chat-stop", CHAT, chat('"stop": ["' + SURROGATE + '"]'), 400, "stop[0]", UNICODE),
    Row("chat-bad_words", CHAT, chat('"bad_words": ["' + SURROGATE + '"]'), 400, "bad_words[0]", UNICODE),
    Row("chat-model", CHAT, chat('"model": "' + SURROGATE + '"'), 400, "model", UNICODE),
    Row("chat-user", CHAT, chat('"user": "' + SURROGATE + '"'), 400, "user", UNICODE),
    Row("tokenize-prompt", TOKENIZE, '{"prompt": "' + SURROGATE + '"}', 400, "prompt", UNICODE),
    Row("tokenize-messages", TOKENIZE, '{"messages": [{"role": "user", "content": "' + SURROGATE + '"}]}', 400,
        "messages[0].content", UNICODE),
    Row("tokenize-model", TOKENIZE, '{"prompt": "x", "model": "' + SURROGATE + '"}', 400, "model", UNICODE),
    Row("detokenize-model", DETOKENIZE, '{"tokens": [1], "model": "' + SURROGATE + '"}', 400, "model", UNICODE),
    Row("raw-cesu8-surrogate-bytes", CMPL, b'{"prompt": "a\xed\xa0\x80"}', 400, "prompt", UNICODE),
    Row("complete-pair-is-fine", CMPL, r'{"prompt": "smile \ud83d\ude00", "max_tokens": 1}', 200),
    # -- floats: finite and within their documented ranges
    Row("temperature-Infinity", CMPL, cmpl('"temperature": Infinity'), 400, "temperature"),
    Row("temperature--Infinity", CMPL, cmpl('"temperature": -Infinity'), 400, "temperature"),
    Row("temperature-NaN", CMPL, cmpl('"temperature": NaN'), 400, "temperature"),
    Row("temperature-1e308", CMPL, cmpl('"temperature": 1e308'), 400, "temperature"),
    Row("temperature-1e400", CMPL, cmpl('"temperature": 1e400'), 400, "temperature"),
    Row("temperature-2.5", CMPL, cmpl('"temperature": 2.5'), 400, "temperature"),
    Row("top_p-NaN", CMPL, cmpl('"top_p": NaN'), 400, "top_p"),
    Row("top_p-Infinity", CMPL, cmpl('"top_p": Infinity'), 400, "top_p"),
    Row("min_p-1e308", CMPL, cmpl('"min_p": 1e308'), 400, "min_p"),
    Row("presence_penalty-Infinity", CMPL, cmpl('"presence_penalty": Infinity'), 400, "presence_penalty"),
    Row("frequency_penalty--Infinity", CMPL, cmpl('"frequency_penalty": -Infinity'), 400, "frequency_penalty"),
    Row("repetition_penalty-NaN", CMPL, cmpl('"repetition_penalty": NaN'), 400, "repetition_penalty"),
    Row("logit_bias-Infinity", CMPL, cmpl('"logit_bias": {"5": Infinity}'), 400, "logit_bias"),
    Row("logit_bias-NaN", CMPL, cmpl('"logit_bias": {"5": NaN}'), 400, "logit_bias"),
    Row("chat-temperature-Infinity", CHAT, chat('"temperature": Infinity'), 400, "temperature"),
    Row("chat-top_p-1e308", CHAT, chat('"top_p": 1e308'), 400, "top_p"),
    # -- integers: signed 64-bit, and n within --max-n-sequences
    Row("seed-2**70", CMPL, cmpl(f'"seed": {BIG}'), 400, "seed"),
    Row("seed--2**70", CMPL, cmpl(f'"seed": {-BIG}'), 400, "seed"),
    Row("seed-2**63", CMPL, cmpl(f'"seed": {2**63}'), 400, "seed"),
    Row("seed-2**63-1-is-fine", CMPL, cmpl(f'"seed": {2**63 - 1}, "temperature": 1'), 200),
    Row("priority-2**70", CMPL, cmpl(f'"priority": {BIG}'), 400, "priority"),
    Row("priority--2**63-is-fine", CMPL, cmpl(f'"priority": {-(2**63)}'), 200),
    Row("n-2**70", CMPL, cmpl(f'"n": {BIG}'), 400, "n"),
    Row("max_tokens-2**70", CMPL, f'{{"prompt": "Hi", "max_tokens": {BIG}}}', 400, "max_tokens"),
    Row("logprobs-2**70", CMPL, cmpl(f'"logprobs": {BIG}'), 400, "logprobs"),
    Row("top_k-2**70", CMPL, cmpl(f'"top_k": {BIG}'), 400, "top_k"),
    Row("min_tokens-2**70", CMPL, cmpl(f'"min_tokens": {BIG}'), 400, "min_tokens"),
    Row("best_of-2**70", CMPL, cmpl(f'"best_of": {BIG}'), 400, "best_of"),
    Row("prompt-token-2**70", CMPL, f'{{"prompt": [{BIG}], "max_tokens": 1}}', 400, "prompt"),
    Row("stop_token_ids-2**70", CMPL, cmpl(f'"stop_token_ids": [{BIG}]'), 400, "stop_token_ids"),
    Row("allowed_token_ids-2**70", CMPL, cmpl(f'"allowed_token_ids": [{BIG}]'), 400, "allowed_token_ids"),
    Row("logit_bias-token-2**70", CMPL, cmpl(f'"logit_bias": {{"{BIG}": 1}}'), 400, "logit_bias"),
    Row("chat-max_completion_tokens-2**70", CHAT, chat(f'"max_completion_tokens": {BIG}'), 400,
        "max_completion_tokens"),
    Row("chat-top_logprobs-2**70", CHAT, chat(f'"logprobs": true, "top_logprobs": {BIG}'), 400, "top_logprobs"),
    Row("chat-seed-2**70", CHAT, chat(f'"seed": {BIG}'), 400, "seed"),
    Row("detokenize-token-2**70", DETOKENIZE, f'{{"tokens": [{BIG}]}}', 400, "tokens"),
    Row("n-over-cap", CMPL, cmpl(f'"n": {DEFAULT_MAX_N_SEQUENCES + 1}'), 400, "n"),
    Row("n-1000-stream", CMPL, cmpl('"n": 1000, "stream": true'), 400, "n"),
    Row("chat-n-over-cap", CHAT, chat(f'"n": {DEFAULT_MAX_N_SEQUENCES + 1}'), 400, "n"),
    # -- missing, extra and mistyped fields
    Row("chat-no-content", CHAT, '{"messages": [{"role": "user"}]}', 400, "messages[0].content"),
    Row("chat-null-content", CHAT, '{"messages": [{"role": "user", "content": null}]}', 400, "messages[0].content"),
    Row("chat-assistant-no-content", CHAT, '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant"}]}',
        400, "messages[1].content"),
    Row("chat-part-no-text", CHAT, chat(content='[{"type": "text"}]'), 400, "messages[0].content[0].text"),
    Row("completions-no-prompt", CMPL, '{"max_tokens": 1}', 400, "prompt"),
    Row("chat-no-messages", CHAT, '{"max_tokens": 1}', 400, "messages"),
    Row("extra-field", CMPL, cmpl('"temprature": 0.5'), 400, "temprature"),
    Row("extra-field-in-message", CHAT, '{"messages": [{"role": "user", "content": "Hi", "mood": 1}]}', 400,
        "messages[0].mood"),
    Row("prompt-object", CMPL, '{"prompt": {"text": "Hi"}}', 400, "prompt"),
    Row("prompt-mixed-list", CMPL, '{"prompt": [[1], "x", 5]}', 400, "prompt[0]"),
    Row("n-string", CMPL, cmpl('"n": "many"'), 400, "n"),
    Row("stream-list", CMPL, cmpl('"stream": [1]'), 400, "stream"),
    Row("stop-int", CMPL, cmpl('"stop": 5'), 400, "stop"),
    Row("logit_bias-list", CMPL, cmpl('"logit_bias": [1]'), 400, "logit_bias"),
    Row("messages-object", CHAT, '{"messages": {"role": "user", "content": "Hi"}}', 400, "messages"),
    Row("content-int", CHAT, chat(content="5"), 400, "messages[0].content"),
    # -- whole bodies: empty, not an object, not JSON, not UTF-8, too deep, too large, not labelled JSON
    Row("empty-body", CMPL, b"", 400),
    Row("body-array", CMPL, "[]", 400),
    Row("body-string", CMPL, '"Hi"', 400),
    Row("body-number", CMPL, "42", 400),
    Row("body-null", CMPL, "null", 400),
    Row("truncated-json", CMPL, '{"prompt": ', 400, None, "json_invalid"),
    Row("invalid-utf8", CMPL, b'{"prompt": "\xff"}', 400),
    Row("nested-100000", CMPL, "[" * 100_000 + "]" * 100_000, 400),
    Row("over-limit-content-length", CMPL, over_limit_body(), 413, None, "request_too_large"),
    Row("over-limit-chunked", CMPL, over_limit_body(), 413, None, "request_too_large", chunked=True),
    Row("json-as-text-plain", CMPL, cmpl('"temperature": 0'), 200, headers={"content-type": "text/plain"}),
    Row("json-without-content-type", CMPL, cmpl('"temperature": 0'), 200, headers={}),
    Row("json-as-form", CMPL, cmpl('"temperature": 0'), 200,
        headers={"content-type": "application/x-www-form-urlencoded"}),
    Row("browser-text-plain", CMPL, cmpl('"temperature": 0'), 415, None, "unsupported_media_type",
        headers={"content-type": "text/plain", "origin": "http://example.com"}),
]  # fmt: skip


def test_table_is_large_and_unique() -> None:
    assert len(ROWS) >= 60
    assert len({row.name for row in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_hostile_input(server: ServerProcess, row: Row) -> None:
    response = httpx.post(server.url(row.path), content=row.content(), headers=row.headers, timeout=60)
    assert response.status_code == row.status, response.text[:1000]
    if row.status == 200:
        assert response.json()["choices"]
    else:
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert (error["param"], error["code"]) == (row.param, row.code), error
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


def test_serve_help_documents_the_limits() -> None:
    result = subprocess.run([folio_script(), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--max-n-sequences" in text and f"Default {DEFAULT_MAX_N_SEQUENCES}" in text
    assert "--max-request-body-bytes" in text and f"Default {DEFAULT_MAX_REQUEST_BODY_BYTES}" in text

"""Structured outputs through a real `folio serve` with the official openai client: response_format (json_schema,
json_object) and vLLM's extra structured_outputs field on both endpoints; bad grammars are 400s naming the field,
and the server goes on serving with nothing left allocated."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.conftest import ServerProcess, server_is_idle, wait_until

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 15},
        "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Tell me about Paris as JSON."}]


def _json_schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_response_format_json_schema(client: openai.OpenAI, temperature: float) -> None:
    response = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=MESSAGES,  # type: ignore[arg-type]
        response_format=_json_schema_format(SCHEMA),  # type: ignore[arg-type]
        temperature=temperature,
        seed=11,
        n=2,
        max_tokens=120,
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_streamed_completion_with_json_schema(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Paris facts in JSON:",
        extra_body={"response_format": _json_schema_format(SCHEMA)},  # the client's completions take it as extra
        temperature=0.0,
        max_tokens=120,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_on_both_endpoints(client: openai.OpenAI) -> None:
    prompt = 'What is 2+2? Reply as JSON like {"answer": 4}.'
    chat = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": prompt}],
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=100,
    )
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    completion = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="A JSON object with one key 'answer' for 2+2:",
        extra_body={"response_format": {"type": "json_object"}},
        temperature=0.0,
        max_tokens=100,
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].text), dict)


def test_vllm_structured_outputs_field(client: openai.OpenAI) -> None:
    regex = r"[0-9]{3}-[A-Z]{2}"
    by_regex = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Part number:",
        extra_body={"structured_outputs": {"regex": regex}},
        temperature=1.0,
        seed=5,
        max_tokens=20,
    )
    assert re.fullmatch(regex, by_regex.choices[0].text)
    by_choice = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Is water wet?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        temperature=0.0,
        max_tokens=5,
    )
    assert by_choice.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"response_format": _json_schema_format({"type": "object", "properties": {"a": {"type": "nope"}}})},
            "response_format.json_schema.schema",
            "nope",
        ),
        (
            {"response_format": _json_schema_format({"type": "array", "uniqueItems": True})},
            "response_format.json_schema.schema",
            "uniqueItems",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs.grammar", "nowhere"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs", "not valid JSON"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a 'json_schema'"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ],
)
def test_bad_grammars_are_400s_naming_the_field(
    server: ServerProcess, client: openai.OpenAI, body: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=8,
            extra_body=body,
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert error["param"] == param, error
    assert message.lower() in error["message"].lower(), error
    assert error["type"] == "invalid_request_error"
    # Still serving, and nothing left allocated for the refused request.
    ok = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2, temperature=0.0)
    assert ok.choices[0].text
    assert wait_until(lambda: server_is_idle(server), timeout_s=30)

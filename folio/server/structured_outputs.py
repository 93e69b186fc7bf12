"""Structured outputs on the OpenAI endpoints: OpenAI's ``response_format`` and vLLM's extra ``structured_outputs``
body field -> ``StructuredOutputsParams``, checked with the engine's grammar backend before anything is queued.

A schema, regex or grammar that does not compile (or uses a feature the backend cannot enforce) is a 400 naming
the field it came from, with the compiler's message. ``strict`` is accepted and changes nothing: the grammar is
always enforced. Setting both fields is a 400 (one would otherwise be silently ignored).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from folio.server.errors import bad_request
from folio.structured.backend import GrammarError, validate_grammar_spec
from folio.structured.params import StructuredOutputsParams

_STRICT = ConfigDict(extra="forbid", populate_by_name=True)  # unknown fields are a 400, as in protocol.py


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` extra body field: set exactly one."""

    model_config = _STRICT

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def structured_outputs_params(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputsField | None, backend: str
) -> StructuredOutputsParams | None:
    """The request's grammar, validated with ``backend``; raises a 400 APIError naming the field."""
    if response_format is not None and response_format.type != "text" and structured_outputs is not None:
        raise bad_request("set either response_format or structured_outputs, not both", param="structured_outputs")
    if structured_outputs is not None:
        field = structured_outputs
        try:
            params = StructuredOutputsParams(
                json=field.json_, regex=field.regex, choice=field.choice, grammar=field.grammar,
                json_object=field.json_object,
            )  # fmt: skip
        except ValueError as e:
            raise bad_request(str(e), param="structured_outputs") from e
        return _checked(params, f"structured_outputs.{params.kind}", backend)
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return _checked(StructuredOutputsParams(json_object=True), "response_format", backend)
    if response_format.json_schema is None:
        raise bad_request(
            "response_format of type 'json_schema' needs a 'json_schema' object", param="response_format.json_schema"
        )
    params = StructuredOutputsParams(json=response_format.json_schema.schema_)
    return _checked(params, "response_format.json_schema.schema", backend)


def _checked(params: StructuredOutputsParams, param: str, backend: str) -> StructuredOutputsParams:
    try:
        validate_grammar_spec(backend, params.grammar_spec())
    except GrammarError as e:
        raise bad_request(f"invalid {param}: {e.detail}", param=param) from e
    except ValueError as e:  # no grammar library installed
        raise bad_request(str(e), param=param) from e
    return params

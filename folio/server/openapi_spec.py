"""/openapi.json as the server really answers: FastAPI's spec of the routes, with every response documented.

FastAPI documents a 422 ``HTTPValidationError`` that this server never sends (validation errors are 400 in
OpenAI's envelope) and a JSON 200 for routes that answer otherwise. ``install_openapi`` replaces the
responses of each operation from one table: the success body each route sends, and the error statuses it can
answer, all in the envelope. Fuzzers (Schemathesis) and client generators then see the server's real contract.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import folio
from folio.server.admission import RETRY_AFTER_S
from folio.server.protocol import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionStreamResponse,
)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every 4xx and 5xx of this server."""

    error: ErrorDetail


class VersionInfo(BaseModel):
    version: str
    engine_core_pid: int
    engine_core_pids: list[int]  # every engine core's, in engine order (data parallelism); [engine_core_pid] at N=1


ERROR_DESCRIPTIONS = {
    400: "Invalid request (malformed JSON, a wrong type, a value out of range, a prompt too long): `param` names "
    "the field.",
    401: "Missing or wrong `Authorization: Bearer` key (only when the server runs with --api-key).",
    404: "The requested `model` is not served here.",
    413: "The request body is larger than the server accepts (--max-request-body-bytes).",
    415: "A browser's request (one with an Origin header) whose Content-Type is not application/json.",
    500: "The engine failed or died while serving the request.",
    503: "The server refuses new work: it is full (then with Retry-After), draining, or its engine core is dead.",
}
RETRY_AFTER_HEADER = {
    "description": f"Seconds to wait before retrying; sent with the refusals of a full server ({RETRY_AFTER_S}).",
    "schema": {"type": "integer", "minimum": 0},
}

_GENERATION_ERRORS = (400, 401, 404, 413, 415, 500, 503)
_UTILITY_ERRORS = (400, 401, 404, 413, 415, 503)  # /tokenize, /detokenize: 503 while draining


def _ref(schema_name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{schema_name}"}


def _json(schema_name: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(schema_name)}}


def _sse_event(chunk_model: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 has a text/event-stream ``schema`` describe each event): ``data`` is a
    JSON chunk, an error envelope when the engine fails mid-stream, or the literal ``[DONE]`` that ends it."""
    chunk_or_error = {"anyOf": [{"$ref": f"#/components/schemas/{chunk_model}"}, _ref("ErrorResponse")]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"const": "message"},
            "data": {
                "type": "string",
                "if": {"const": "[DONE]"},
                "else": {"contentMediaType": "application/json", "contentSchema": chunk_or_error},
            },
        },
    }


def _generation_success(response_model: str, chunk_model: str) -> dict[str, Any]:
    return {
        "description": f"The whole answer; with `stream: true`, server-sent events of {chunk_model} chunks, an "
        "error event if the engine fails mid-stream, then `data: [DONE]`.",
        "content": {**_json(response_model), "text/event-stream": {"schema": _sse_event(chunk_model)}},
    }


_EMPTY_HEALTH = {"description": "The engine core is alive; an empty body with no content type (as vLLM's)."}

# (path, method) -> (success response, error statuses). None keeps FastAPI's success response.
OPERATIONS: dict[tuple[str, str], tuple[dict[str, Any] | None, tuple[int, ...]]] = {
    ("/v1/completions", "post"): (
        _generation_success("CompletionResponse", "CompletionStreamResponse"),
        _GENERATION_ERRORS,
    ),
    ("/v1/chat/completions", "post"): (
        _generation_success("ChatCompletionResponse", "ChatCompletionStreamResponse"),
        _GENERATION_ERRORS,
    ),
    ("/v1/models", "get"): (None, (401, 503)),
    ("/tokenize", "post"): (None, _UTILITY_ERRORS),
    ("/detokenize", "post"): (None, _UTILITY_ERRORS),
    ("/health", "get"): (_EMPTY_HEALTH, (503,)),
    ("/ping", "get"): (_EMPTY_HEALTH, (503,)),
    ("/ping", "post"): (_EMPTY_HEALTH, (413, 503)),
    ("/version", "get"): ({"description": "The server's version", "content": _json("VersionInfo")}, ()),
    ("/metrics", "get"): (
        {
            "description": "Prometheus text exposition of the server's metrics.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        (),
    ),
}
# What pydantic cannot infer: DeltaMessage's serializer drops its unset fields, so it reads as any object.
SCHEMA_OVERRIDES = {
    "DeltaMessage": {
        "type": "object",
        "description": "The new part of a streamed message; fields with nothing new are left out.",
        "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
        "additionalProperties": False,
    }
}
_EXTRA_MODELS: list[type[BaseModel]] = [
    ErrorResponse,
    VersionInfo,
    CompletionResponse,
    CompletionStreamResponse,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
]


def _error_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {"description": ERROR_DESCRIPTIONS[status], "content": _json("ErrorResponse")}
    if status == 503:
        response["headers"] = {"Retry-After": RETRY_AFTER_HEADER}
    return response


def document(spec: dict[str, Any]) -> dict[str, Any]:
    """Rewrites FastAPI's spec in place from OPERATIONS; an operation missing from the table is an error."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    _, extra = models_json_schema(
        [(m, "serialization") for m in _EXTRA_MODELS], ref_template="#/components/schemas/{model}"
    )
    for name, schema in extra.get("$defs", {}).items():
        schemas.setdefault(name, schema)
    for path, operations in spec.get("paths", {}).items():
        for method, operation in operations.items():
            if (path, method) not in OPERATIONS:
                raise KeyError(f"{method.upper()} {path} is not documented in folio.server.openapi_spec.OPERATIONS")
            success, errors = OPERATIONS[(path, method)]
            responses = {"200": success or operation["responses"]["200"]}
            responses.update({str(status): _error_response(status) for status in errors})
            operation["responses"] = responses
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas.update(SCHEMA_OVERRIDES)
    schemas["TokenizeRequest"]["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]
    return spec


def install_openapi(app: FastAPI) -> None:
    """Serves the documented spec at /openapi.json (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=folio.__version__, routes=app.routes)
            app.openapi_schema = document(spec)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

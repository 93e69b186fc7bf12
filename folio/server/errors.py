"""Errors in OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause or see leaves the server through here, so the official clients raise their
typed exceptions (BadRequestError, NotFoundError, ...) and the server never answers a bare 422 or an HTML page.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import traceback
from collections.abc import Collection, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from folio.server.input_hygiene import InvalidTextError, encodable
from folio.server.streaming import ClientDisconnected

logger = logging.getLogger("folio")

# OpenAI's error types by status (the official API uses these strings; clients map on the status).
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client in the envelope, with its HTTP status.

    Message and param are made encodable here (a lone surrogate becomes its escape), so that an error which
    echoes a client's text can always be sent.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = encodable(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = None if param is None else encodable(param)
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.headers = headers  # e.g. Retry-After on a 503 refusal

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status, headers=self.headers)

    def to_sse(self) -> str:
        """A stream's error event; the caller follows it with ``data: [DONE]``."""
        return f"data: {json.dumps(self.to_dict())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# SamplingParams / InputProcessor messages start with the field's name: "temperature must be >= 0, got -1".
_LEADING_FIELD = re.compile(r"^([a-z_]+)(\[[^\]]*\])?\s")
_FIELD_ALIASES = {"prompt_token_ids": "prompt"}


def from_value_error(error: ValueError, known_fields: Collection[str] = ()) -> APIError:
    """Folio's ValueErrors name the field first; that name becomes ``param``."""
    message = str(error)
    match = _LEADING_FIELD.match(message)
    param = None
    if match:
        name = _FIELD_ALIASES.get(match.group(1), match.group(1))
        if not known_fields or name in known_fields:
            param = name
    return bad_request(message, param=param)


def _format_loc(loc: Sequence[Any], body: Any = None, missing: bool = False) -> str:
    """("body", "messages", 0, "content") -> "messages[0].content".

    With the request ``body``, the path follows the data: a location item that is neither a key nor an index of
    the value reached so far is a union member's tag (pydantic's "str", "list[int]") and is left out, so that
    ``{"prompt": {}}`` names ``prompt``, not ``prompt.str``. A missing field's name (the last item) is kept.
    """
    items = list(loc[1:] if loc and loc[0] == "body" else loc)
    parts: list[str] = []
    value, follow = body, body is not None
    for position, item in enumerate(items):
        if item == "[key]":
            continue
        if follow:
            in_dict = isinstance(value, dict) and item in value
            in_list = isinstance(value, list) and isinstance(item, int) and 0 <= item < len(value)
            if in_dict or in_list:
                value = value[item]
            elif not (missing and position == len(items) - 1):
                continue  # a union tag
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts)


def from_validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error becomes the message, its location the ``param``."""
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    # A union field fails once per member; the member that got deepest into the value says what is wrong.
    field = tuple(errors[0].get("loc", ()))[:2]
    err = max((e for e in errors if tuple(e.get("loc", ()))[:2] == field), key=lambda e: len(e.get("loc", ())))
    kind = err.get("type", "")
    invalid_text = (err.get("ctx") or {}).get("error")
    if isinstance(invalid_text, InvalidTextError):
        return bad_request(str(invalid_text), param=invalid_text.path, code="invalid_unicode")
    param = _format_loc(err.get("loc", ()), getattr(exc, "body", None), missing=kind == "missing") or None
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", err.get("msg", ""))
        return bad_request(f"malformed JSON in the request body: {detail}", code="json_invalid")
    if kind == "extra_forbidden":
        return bad_request(f"unknown field '{param}': this server does not accept it", param=param)
    if kind == "missing":
        if param is None:
            return bad_request("the request body must be a JSON object")
        return bad_request(f"missing required field '{param}'", param=param)
    if param is None:
        return bad_request(f"the request body must be a JSON object ({err.get('msg', '')})")
    value = err.get("input")
    shown = json.dumps(value) if _is_small_json(value) else type(value).__name__
    return bad_request(f"invalid value for '{param}': {err.get('msg', '')} (got {shown})", param=param)


def _is_small_json(value: Any) -> bool:
    try:
        return len(json.dumps(value)) <= 200
    except (TypeError, ValueError):
        return False


def _describe(exc: BaseException) -> str:
    """'TypeName: message', encodable; falls back to the type name when str(exc) itself fails."""
    try:
        return encodable(f"{type(exc).__name__}: {exc}")
    except Exception:
        return type(exc).__name__


def install_exception_handlers(app: FastAPI) -> None:
    """Validation errors, HTTP errors and anything unexpected all answer in the envelope."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.to_response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_validation_error(exc).to_response()

    async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) and exc.detail else phrase
        return APIError(exc.status_code, message).to_response()

    async def on_client_disconnected(_: Request, exc: Exception) -> Response:
        """The client went away and its request was aborted: one info line, and a response nobody receives."""
        assert isinstance(exc, ClientDisconnected)
        logger.info("request %s aborted: client disconnected", exc.request_id)
        return Response(status_code=499)  # nginx's "client closed request"; uvicorn drops it unsent

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        """The last resort: it must answer whatever ``exc`` holds, so nothing here may raise."""
        # A broken log handler or an exception whose str() raises must not stop the 500 from going out.
        # The traceback is made encodable too: a lone surrogate in a log record breaks UTF-8 log files and pipes.
        with contextlib.suppress(Exception):
            trace = "".join(traceback.format_exception(exc))
            logger.error("unexpected error while serving a request\n%s", encodable(trace.rstrip()))
        return APIError(500, f"internal server error: {_describe(exc)}").to_response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(ClientDisconnected, on_client_disconnected)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)

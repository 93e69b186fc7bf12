"""The request body before anything parses it: its size (413 past --max-request-body-bytes) and its media type.

A pure ASGI middleware, like the gate: it reads the whole body first, counting the bytes as they arrive. A
Content-Length over the limit is refused unread, a chunked body as soon as it passes the limit; only a body within
the limit reaches the route, in one piece, to be parsed there.

Media type: a body is taken as JSON whatever its Content-Type says (text/plain, form-urlencoded, none), as OpenAI's
API takes it, so ``curl -d '{...}'`` works without a JSON header. Except from a browser (a request with an Origin
header): a browser sends text/plain across sites without asking the server first (no CORS preflight), so any web
page could make a local server generate. A browser must say application/json, which it sends only after a
preflight this server does not grant; otherwise the answer is 415.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from folio.server.errors import APIError

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json_media_type(content_type: str | None) -> bool:
    """application/json, or a +json type such as application/merge-patch+json; parameters (charset) ignored."""
    if not content_type:
        return False
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


def too_large(limit: int, size: int, whole: bool) -> APIError:
    amount = f"{size} bytes" if whole else f"more than {limit} bytes (reading stopped at {size})"
    return APIError(
        413,
        f"The request body is {amount}; this server accepts at most {limit} bytes (--max-request-body-bytes).",
        code="request_too_large",
    )


class RequestBodyMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        content_length = _content_length(headers)
        if content_length is not None and content_length > self.max_body_bytes:
            await too_large(self.max_body_bytes, content_length, whole=True).to_response()(scope, receive, send)
            return
        body = await self._read_body(receive)
        if isinstance(body, APIError):
            await body.to_response()(scope, receive, send)
            return
        if body is None:
            return  # the client went away while sending: nobody to answer
        if body and not is_json_media_type(headers.get("content-type")):
            if "origin" in headers:
                error = APIError(
                    415,
                    "A request from a browser must send its JSON body with 'Content-Type: application/json'.",
                    code="unsupported_media_type",
                )
                await error.to_response()(scope, receive, send)
                return
            scope = _with_json_content_type(scope)
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | APIError | None:
        """The whole body, or a 413 once it passes the limit, or None if the client disconnected first."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return too_large(self.max_body_bytes, size, whole=False)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _content_length(headers: Headers) -> int | None:
    try:
        return int(headers["content-length"])
    except (KeyError, ValueError):
        return None


def _with_json_content_type(scope: Scope) -> Scope:
    """A copy of ``scope`` whose Content-Type is application/json, so that the route parses the body as JSON."""
    raw = [(name, value) for name, value in scope["headers"] if name.lower() != b"content-type"]
    return {**scope, "headers": [*raw, (b"content-type", b"application/json")]}


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body read here in one message, then whatever the client sends next (its
    disconnect, which the routes watch to abort a request)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

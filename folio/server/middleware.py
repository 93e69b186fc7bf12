"""The gate in front of every route: API key (401) and drain (503).

A pure ASGI middleware rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware wraps the
response stream, which would stand between a streaming response and the client's disconnect.
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

from folio.server.errors import APIError

if TYPE_CHECKING:
    from folio.server.api_server import ServerState

# Open without a key, as in vLLM: health checkers and Prometheus scrapers hold no secret.
UNAUTHENTICATED_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})
# Still answered while draining: the orchestrator and the scraper watch the drain.
DRAIN_EXEMPT_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


class GateMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is not None:
            await error.to_response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> APIError | None:
        path = scope.get("path", "")
        if self.state.draining and path not in DRAIN_EXEMPT_PATHS:
            return APIError(503, "The server is shutting down and accepts no new requests.", code="draining")
        if self.state.api_key and path not in UNAUTHENTICATED_PATHS and not self._authorized(scope):
            return APIError(
                401,
                "Incorrect API key provided: send 'Authorization: Bearer <key>' with the server's --api-key.",
                code="invalid_api_key",
            )
        return None

    def _authorized(self, scope: Scope) -> bool:
        assert self.state.api_key is not None
        expected = f"Bearer {self.state.api_key}".encode()
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                return hmac.compare_digest(value, expected)
        return False

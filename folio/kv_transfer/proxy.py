"""`folio proxy`: one OpenAI endpoint over a prefill instance (kv_producer) and a decode instance (kv_consumer).

Each /v1/completions and /v1/chat/completions request goes first, as a copy, to the prefill instance: one token
(``max_tokens`` 1), one sample, no stream, nothing that only shapes the output (logprobs, grammars, beam search), and
``kv_transfer_params`` asking it to push the prompt's blocks to the decode instance (``do_remote_decode``; the
consumer's KV address when the proxy was given one, else the producer's kv_transfer_config names it). The producer
answers once the blocks are on the consumer. Then the original request goes to the decode instance with the
``kv_transfer_params`` the prefill answered, and its answer (streamed or whole) is the client's: its prompt is found
in its prefix cache but for the tail. A client's time to first token therefore includes the prefill, the transfer
and the decode's first step. Errors of either instance pass through as they are (OpenAI's envelope); an instance
that cannot be reached is a 502 in the envelope naming it. /v1/models goes to the decode instance; /health answers 200
only while both instances do.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from folio.server.errors import APIError, bad_request

CHAT_PATH = "/v1/chat/completions"
# Fields of the client's request that the prefill copy leaves out: they shape only the output, which is discarded.
_PREFILL_DROPPED = (
    "stream_options",
    "best_of",
    "min_tokens",
    "use_beam_search",
    "length_penalty",
    "logprobs",
    "top_logprobs",
    "response_format",
    "structured_outputs",
    "max_tokens",
    "max_completion_tokens",
)


def prefill_body(body: dict[str, Any], path: str, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The copy of a client's request that the prefill instance gets."""
    copy = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
    copy.update(stream=False, n=1, kv_transfer_params=kv_transfer_params)
    copy["max_completion_tokens" if path == CHAT_PATH else "max_tokens"] = 1
    return copy


class Upstreams:
    """The two instances' base URLs, the consumer's KV address (if given) and the HTTP client."""

    def __init__(self, prefill_url: str, decode_url: str, kv_host: str | None, kv_port: int | None) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.kv_transfer_params: dict[str, Any] = {"do_remote_decode": True}
        if kv_port is not None:
            host = kv_host or urlsplit(self.decode_url).hostname or "127.0.0.1"
            self.kv_transfer_params.update(remote_host=host, remote_port=kv_port)
        self.client: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        assert self.client is not None, "the proxy's lifespan opens the client"
        return self.client


def _unreachable(role: str, url: str, error: Exception) -> Response:
    message = f"the {role} instance {url} did not answer: {type(error).__name__}: {error}"
    return APIError(502, message, code="upstream_unreachable", type="server_error").to_response()


def _passthrough(response: httpx.Response) -> Response:
    return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))


def _auth(request: Request) -> dict[str, str]:
    value = request.headers.get("authorization")
    return {"authorization": value} if value else {}


async def _forward(up: Upstreams, request: Request, path: str) -> Response:
    try:
        body = json.loads(await request.body())
    except ValueError:
        return bad_request("the request body is not valid JSON").to_response()
    if not isinstance(body, dict):
        return bad_request("the request body must be a JSON object").to_response()
    headers = _auth(request)
    try:
        prefilled = await up.http.post(
            up.prefill_url + path, json=prefill_body(body, path, up.kv_transfer_params), headers=headers
        )
    except httpx.HTTPError as e:
        return _unreachable("prefill", up.prefill_url, e)
    if prefilled.status_code != 200:
        return _passthrough(prefilled)
    decode_body = dict(body)
    decode_body["kv_transfer_params"] = prefilled.json().get("kv_transfer_params")
    if decode_body["kv_transfer_params"] is None:
        del decode_body["kv_transfer_params"]
    try:
        upstream = await up.http.send(
            up.http.build_request("POST", up.decode_url + path, json=decode_body, headers=headers),
            stream=bool(body.get("stream")),
        )
    except httpx.HTTPError as e:
        return _unreachable("decode", up.decode_url, e)
    if not body.get("stream") or upstream.status_code != 200:
        await upstream.aread()
        return _passthrough(upstream)

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:  # the client went away, or the stream ended: the decode instance sees its end too
            await upstream.aclose()

    return StreamingResponse(relay(), media_type=upstream.headers.get("content-type"))


def build_proxy_app(up: Upstreams, timeout_s: float = 600.0) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:
            up.client = client
            yield

    app = FastAPI(title="folio proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(up, request, "/v1/completions")

    @app.post(CHAT_PATH)
    async def chat(request: Request) -> Response:
        return await _forward(up, request, CHAT_PATH)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            return _passthrough(await up.http.get(up.decode_url + "/v1/models", headers=_auth(request)))
        except httpx.HTTPError as e:
            return _unreachable("decode", up.decode_url, e)

    @app.get("/health")
    async def health() -> Response:
        for role, url in (("prefill", up.prefill_url), ("decode", up.decode_url)):
            try:
                answer = await up.http.get(url + "/health", timeout=10)
            except httpx.HTTPError as e:
                return APIError(
                    503, f"the {role} instance {url} did not answer: {e}", code="upstream_unhealthy"
                ).to_response()
            if answer.status_code != 200:
                message = f"the {role} instance {url} is unhealthy ({answer.status_code})"
                return APIError(503, message, code="upstream_unhealthy").to_response()
        return Response(status_code=200)

    return app


def run_proxy(prefill_url: str, decode_url: str, host: str, port: int, kv_host: str | None, kv_port: int | None) -> int:
    import uvicorn

    from folio.logger import init_logger

    init_logger()
    app = build_proxy_app(Upstreams(prefill_url, decode_url, kv_host, kv_port))
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0

"""The HTTP routes: the two OpenAI generation endpoints and the small ones around them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import folio
from folio.server.errors import APIError, bad_request
from folio.server.metrics import PrometheusStatLogger
from folio.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from folio.server.serving_base import ServingContext
from folio.server.serving_chat import OpenAIServingChat
from folio.server.serving_completion import OpenAIServingCompletion

if TYPE_CHECKING:
    from folio.server.api_server import ServerState


def register_routes(
    app: FastAPI,
    ctx: ServingContext,
    state: ServerState,
    prometheus: PrometheusStatLogger,
    model_path: str | None,
) -> None:
    completions = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(body, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create(body, raw_request)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        card = ModelCard(id=ctx.model_name, root=model_path or ctx.model_name, max_model_len=ctx.max_model_len)
        return ModelList(data=[card])

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine core is alive; 503 once it died or while the server drains."""
        return await _health_response(ctx, state)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """/health under the name SageMaker-style load balancers probe (GET or POST), as vLLM serves it."""
        return await _health_response(ctx, state)

    @app.get("/version")
    async def version() -> JSONResponse:
        """The version, plus the engine cores' pids (operators and tests use them to find the core processes):
        ``engine_core_pid`` is core 0's, ``engine_core_pids`` every core's (data parallelism)."""
        pids = ctx.engine.engine_core_pids
        return JSONResponse({"version": folio.__version__, "engine_core_pid": pids[0], "engine_core_pids": pids})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(prometheus.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """The ids the generation endpoints would feed the engine: ``prompt`` as /v1/completions tokenizes it,
        ``messages`` through the chat template."""
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            messages = [m.to_template_dict() for m in body.messages]
            tokens = await ctx.apply_chat_template(messages, body.add_generation_prompt)
        else:
            assert body.prompt is not None
            tokens = await ctx.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.max_model_len)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        vocab_size = ctx.engine.model_spec.vocab_size
        for token_id in body.tokens:
            if not 0 <= token_id < vocab_size:
                raise bad_request(f"tokens contains {token_id}, outside the vocabulary [0, {vocab_size})", "tokens")
        return DetokenizeResponse(prompt=await ctx.detokenize(body.tokens))


async def _health_response(ctx: ServingContext, state: ServerState) -> Response:
    """200 while the engine core is alive; 503 once it died or while the server drains (/health and /ping)."""
    if state.engine_dead or getattr(ctx.engine, "errored", False):
        return APIError(503, "The engine core is dead.", code="engine_dead").to_response()
    if state.draining:
        return APIError(503, "The server is draining.", code="draining").to_response()
    try:
        await ctx.engine.check_health()
    except Exception as e:
        return APIError(503, f"The engine core is unhealthy: {e}", code="engine_dead").to_response()
    return Response(status_code=200)

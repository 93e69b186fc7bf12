"""The FastAPI app (``build_app``) and the process around it (``run_server``): uvicorn, drain, engine death.

Lifecycle rules:
- SIGTERM/SIGINT drains: new requests get 503, in-flight ones finish (or are cancelled, which aborts them, after
  DRAIN_TIMEOUT_S), then the engine core stops and the process exits 0.
- If the engine-core process dies, /health answers 503, in-flight requests get an error, and after
  ENGINE_DEAD_EXIT_DELAY_S (so health checkers see the 503) the server exits 1 for an orchestrator to restart.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Generator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from folio.config import EngineArgs
from folio.server.admission import Admission, AdmissionLimits, register_admission_metrics
from folio.server.errors import install_exception_handlers
from folio.server.limits import DEFAULT_MAX_N_SEQUENCES, DEFAULT_MAX_REQUEST_BODY_BYTES
from folio.server.metrics import EngineLogLines, LoggingStatLogger, PrometheusStatLogger
from folio.server.middleware import GateMiddleware
from folio.server.openapi_spec import install_openapi
from folio.server.request_body import RequestBodyMiddleware
from folio.server.routes import register_routes
from folio.server.serving_base import ServingContext
from folio.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from folio.engine.async_llm import AsyncLLM

logger = logging.getLogger("folio")

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
DRAIN_TIMEOUT_S = 30.0
ENGINE_DEAD_EXIT_DELAY_S = 2.0


@dataclass
class ServerState:
    """Mutable facts about the running server that the middleware and routes read."""

    api_key: str | None = None
    draining: bool = False
    engine_dead: bool = False
    exit_code: int = 0
    request_shutdown: Callable[[], None] = field(default=lambda: None)


def served_model_name(args: argparse.Namespace) -> str:
    """--served-model-name, else the model path's base name, else the default model's name."""
    name = getattr(args, "served_model_name", None)
    if name:
        return str(name)
    model = getattr(args, "model", None)
    if model:
        return os.path.basename(str(model).rstrip("/")) or str(model)
    return DEFAULT_SERVED_MODEL_NAME


def build_app(
    engine: AsyncLLM,
    args: argparse.Namespace,
    prometheus: PrometheusStatLogger | None = None,
    logging_stats: LoggingStatLogger | EngineLogLines | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over a running engine; ``prometheus`` must be the logger the engine records to."""
    model_name = served_model_name(args)
    limits = AdmissionLimits(
        max_num_seqs=engine.config.scheduler_config.max_num_seqs * engine.data_parallel_size,  # every core's
        max_num_queued_reqs=getattr(args, "max_num_queued_reqs", None),
        max_num_queued_tokens=getattr(args, "max_num_queued_tokens", None),
    )
    ctx = ServingContext(
        engine=engine,
        model_name=model_name,
        max_model_len=engine.config.scheduler_config.max_model_len,
        admission=Admission(limits),
        max_n_sequences=getattr(args, "max_n_sequences", DEFAULT_MAX_N_SEQUENCES),
    )
    state = ServerState(api_key=getattr(args, "api_key", None))
    prometheus = prometheus or PrometheusStatLogger(model_name)
    register_admission_metrics(prometheus.registry, ctx.admission, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(_watch_engine(engine, state))]
        if logging_stats is not None:
            tasks.append(asyncio.create_task(_log_stats_periodically(logging_stats)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ctx.async_tokenizer.shutdown()

    app = FastAPI(title="Folio OpenAI-compatible server", lifespan=lifespan)
    app.state.folio = state
    app.state.ctx = ctx
    app.state.prometheus = prometheus
    install_exception_handlers(app)
    install_openapi(app)
    register_routes(app, ctx, state, prometheus, model_path=getattr(args, "model", None))
    max_body_bytes = getattr(args, "max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES)
    app.add_middleware(RequestBodyMiddleware, max_body_bytes=max_body_bytes)  # inside the gate: 401/503 unread
    app.add_middleware(GateMiddleware, state=state)
    return app


async def _watch_engine(engine: AsyncLLM, state: ServerState) -> None:
    """When the engine core dies: mark the server dead (503 on /health), then stop it with exit code 1."""
    await engine.wait_for_dead()
    state.engine_dead = True
    state.exit_code = 1
    logger.error(
        "The engine-core process died; /health answers 503 and the server exits in %.0f s", ENGINE_DEAD_EXIT_DELAY_S
    )
    await asyncio.sleep(ENGINE_DEAD_EXIT_DELAY_S)
    state.request_shutdown()


async def _log_stats_periodically(stats: LoggingStatLogger | EngineLogLines) -> None:
    while True:
        await asyncio.sleep(stats.interval_s)
        stats.log_if_due()


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signals drain (new requests 503) and end in exit code 0.

    uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would kill the process with the
    signal's status; this server handles the signal itself and returns normally instead.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.folio_state = state

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.folio_state.draining:
            logger.info("Received signal %d: draining (new requests get 503, in-flight ones finish)", sig)
        self.folio_state.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def serve(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    """Loads the engine (blocking, before the port opens), serves until told to stop; returns the exit code."""
    from folio.engine.async_llm import AsyncLLM

    model_name = served_model_name(args)
    speculative = SpeculativeConfig.from_value(engine_args.speculative_config)
    num_spec_tokens = speculative.num_speculative_tokens if speculative is not None else None
    data_parallel_size = getattr(args, "data_parallel_size", 1)
    kv_transfer = engine_args.kv_transfer_config is not None
    prometheus = PrometheusStatLogger(model_name, num_spec_tokens, max(1, data_parallel_size), kv_transfer)
    host_tier, spec_decode = engine_args.kv_offloading_size > 0, bool(num_spec_tokens)
    logging_stats: LoggingStatLogger | EngineLogLines = LoggingStatLogger(host_tier=host_tier, spec_decode=spec_decode)
    if data_parallel_size > 1:
        logging_stats = EngineLogLines(data_parallel_size, host_tier=host_tier, spec_decode=spec_decode)
    routing = getattr(args, "data_parallel_routing", "prefix")
    engine = AsyncLLM(engine_args, [prometheus, logging_stats], data_parallel_size, data_parallel_routing=routing)
    try:
        app = build_app(engine, args, prometheus, logging_stats)
        state: ServerState = app.state.folio
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=int(DRAIN_TIMEOUT_S),
            lifespan="on",
        )
        server = DrainingServer(config, state)

        def request_shutdown() -> None:
            server.should_exit = True

        state.request_shutdown = request_shutdown
        logger.info("Serving %s on http://%s:%d (OpenAI API under /v1)", model_name, args.host, args.port)
        await server.serve()
        if not server.started and state.exit_code == 0:
            state.exit_code = 1  # e.g. the port was taken
        return state.exit_code
    finally:
        engine.shutdown()


def run_server(args: argparse.Namespace, engine_args: EngineArgs | None = None) -> int:
    """Entry point of ``folio serve``: runs the event loop and returns the process exit code.

    ``engine_args`` defaults to the engine flags found in ``args`` (the same names as EngineArgs' fields).
    """
    if engine_args is None:
        names = {f.name for f in fields(EngineArgs)}
        engine_args = EngineArgs(**{k: v for k, v in vars(args).items() if k in names})
    return asyncio.run(serve(args, engine_args))

"""AsyncLLM: the serving frontend. Tokenizes and detokenizes here; the engine core steps in its own process.

Each request gets an async stream of DELTA outputs. Closing the stream early (client gone, timeout) aborts the
request in the core, which frees its KV blocks. If the core process dies, every stream raises EngineDeadError
and ``wait_for_dead`` returns, so the server can exit for its orchestrator to restart it. With data parallelism
there are N cores (folio/engine/dp_client.py): each request lives on the one the router picked, and the death of
any core is the engine's death.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncGenerator

from folio.config import EngineArgs
from folio.core.scheduler import SchedulerStats
from folio.engine.core_proc import StepOutputs
from folio.engine.dp_client import DPEngineCoreClient
from folio.engine.input_processor import InputProcessor, PromptType
from folio.engine.output_processor import OutputProcessor, RequestOutputKind
from folio.engine.stats import IterationStats, IterationStatsCollector, StatLogger
from folio.logger import init_logger
from folio.model.model_files import default_model_path, load_tokenizer, read_model_spec
from folio.outputs import RequestOutput
from folio.sampling_params import SamplingParams

logger = logging.getLogger("folio")

_REAP_TIMEOUT_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine-core process died; no request can make progress until the server is restarted."""


class AsyncLLM:
    def __init__(
        self,
        engine_args: EngineArgs,
        stat_loggers: list[StatLogger] | None = None,
        data_parallel_size: int = 1,
        data_parallel_routing: str = "prefix",
    ) -> None:
        init_logger()
        model_path = engine_args.model or default_model_path()
        spec = read_model_spec(model_path)
        self.config = engine_args.create_engine_config(model_path, spec.max_position_embeddings)
        # Starts loading the model in the core processes right away.
        self.cores = DPEngineCoreClient(self.config, data_parallel_size, routing=data_parallel_routing)
        self.core = self.cores.engines[0]  # the one core without data parallelism
        try:
            self.tokenizer = load_tokenizer(engine_args.tokenizer or model_path)  # meanwhile, here
            ready = self.cores.wait_ready()
        except BaseException:
            self.cores.shutdown()
            raise
        self.config.cache_config.num_blocks = ready.num_blocks
        self.config.cache_config.num_host_blocks = ready.num_host_blocks
        self.model_spec = ready.model_spec
        self.input_processor = InputProcessor(
            self.tokenizer,
            vocab_size=self.model_spec.vocab_size,
            max_model_len=self.config.scheduler_config.max_model_len,
            eos_token_ids=self.model_spec.eos_token_ids,
            structured_outputs_backend=self.config.structured_outputs_config.backend,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.stats_collector = IterationStatsCollector()
        self.num_waiting_requests = 0
        self.last_scheduler_stats = SchedulerStats(0, 0, 0.0, 0, 0, 0)  # the last snapshot, from any core
        self.scheduler_stats = [SchedulerStats(0, 0, 0.0, 0, 0, 0) for _ in self.cores.engines]  # per core
        self.errored = False
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException | None]] = {}
        self._core_request_counter = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: asyncio.Event | None = None

    @property
    def engine_core_pid(self) -> int:
        return self.core.pid

    @property
    def engine_core_pids(self) -> list[int]:
        return self.cores.pids

    @property
    def data_parallel_size(self) -> int:
        return self.cores.num_engines

    # ------------------------------------------------------------------ requests

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """Streams DELTA outputs until the request finishes; bad input raises ValueError before anything runs."""
        self._start_output_handler()
        if self.errored:
            raise EngineDeadError("the engine core is dead")
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = self.input_processor.tokenize_prompt(prompt)
        core_request_id = self._new_core_request_id(request_id)
        requests = self.input_processor.make_requests(core_request_id, processed, sampling_params, priority=priority)
        queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(
            request_id, processed, sampling_params, RequestOutputKind.DELTA, core_request_id=core_request_id
        )
        self.stats_collector.add_request(request_id, requests[0].arrival_time, len(processed.prompt_token_ids))
        self.cores.add_requests(requests)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if item is None:
                    return  # aborted through abort(): the stream just ends
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)

    def _new_core_request_id(self, request_id: str) -> str:
        """The id the core gets: the caller's plus a number never used before. A request id may be used again as
        soon as its stream ended, while outputs the core sent for the earlier request are still in the pipe (an
        abort reaches the core a step late); under the new core id those are dropped instead of being taken for
        the new request's (vLLM makes its internal request ids unique the same way)."""
        return f"{request_id}-{next(self._core_request_counter)}"

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        """Synchronous, so that it also runs from a generator being closed (client disconnected)."""
        child_ids = self.output_processor.child_ids(request_id)
        engine_index = next((e for c in child_ids if (e := self.cores.engine_of(c)) is not None), 0)
        self.output_processor.abort_requests([request_id])
        self.cores.abort_requests(child_ids)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(None)
        iteration = IterationStats()
        self.stats_collector.finish_request(iteration, request_id, "abort", time.monotonic())
        if iteration.finished_requests:
            self._log_stats(self.scheduler_stats[engine_index], iteration, engine_index)

    # ------------------------------------------------------------------ health

    async def check_health(self) -> None:
        self._start_output_handler()
        if self.errored:
            raise EngineDeadError("the engine core is dead")

    async def wait_for_dead(self) -> None:
        self._start_output_handler()
        assert self._dead is not None
        await self._dead.wait()

    def shutdown(self) -> None:
        self._remove_readers()
        self.cores.shutdown()

    # ------------------------------------------------------------------ outputs from the core

    def _start_output_handler(self) -> None:
        """Outputs are read when the pipe is readable, on the loop that serves the requests (started lazily)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        self._remove_readers()
        self._loop = loop
        self._dead = asyncio.Event()
        if self.errored:
            self._dead.set()
            return
        for index, core in enumerate(self.cores.engines):
            self._loop.add_reader(core.outputs_conn.fileno(), self._on_outputs_readable, index)
            self._loop.add_reader(core.process.sentinel, self._on_core_exit, index)

    def _remove_readers(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for core in self.cores.engines:
                self._loop.remove_reader(core.outputs_conn.fileno())
                self._loop.remove_reader(core.process.sentinel)

    def _on_outputs_readable(self, engine_index: int) -> None:
        conn = self.cores.engines[engine_index].outputs_conn
        try:
            while conn.poll():
                message = conn.recv()
                if isinstance(message, StepOutputs):
                    self._handle_step(message, engine_index)
        except (EOFError, OSError):
            self._on_core_exit(engine_index)

    def _handle_step(self, message: StepOutputs, engine_index: int = 0) -> None:
        now = time.monotonic()
        self.last_scheduler_stats = message.scheduler_stats
        self.scheduler_stats[engine_index] = message.scheduler_stats
        self.num_waiting_requests = sum(stats.num_waiting for stats in self.scheduler_stats)
        self.cores.on_outputs(engine_index, message.outputs)
        iteration = IterationStats()
        for out in message.outputs:
            parent_id = self.output_processor.child_to_parent.get(out.request_id)
            if parent_id is not None:
                self.stats_collector.record_tokens(iteration, parent_id, len(out.new_token_ids), now, out.queue_time)
        processed = self.output_processor.process_outputs(message.outputs)
        self.cores.abort_requests(processed.child_ids_to_abort)
        for request_output in processed.request_outputs:
            queue = self._queues.get(request_output.request_id)
            if queue is not None:
                queue.put_nowait(request_output)
            if request_output.finished:
                reason = next((o.finish_reason for o in request_output.outputs if o.finish_reason), "stop")
                self.stats_collector.finish_request(iteration, request_output.request_id, reason, now)
        self._log_stats(message.scheduler_stats, iteration, engine_index)

    def _log_stats(self, scheduler_stats: SchedulerStats, iteration: IterationStats, engine_index: int) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration, engine_index)
            except Exception:  # a broken metrics sink must not take the serving loop down
                logger.exception("stat logger failed")

    def _on_core_exit(self, engine_index: int = 0) -> None:
        if self.errored:
            return
        self.errored = True
        process = self.cores.engines[engine_index].process
        process.join(_REAP_TIMEOUT_S)  # its pipe's EOF can come before it is reaped: the exit code is known then
        exit_code = process.exitcode
        which = f" {engine_index} of {self.cores.num_engines}" if self.cores.num_engines > 1 else ""
        logger.error("the engine core process%s died (exit code %s)", which, exit_code)
        self._remove_readers()
        error = EngineDeadError(f"the engine core process{which} died (exit code {exit_code})")
        for queue in self._queues.values():
            queue.put_nowait(error)
        if self._dead is not None:
            self._dead.set()

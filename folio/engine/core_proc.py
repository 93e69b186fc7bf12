"""The engine core in its own process, and the client the frontend talks to it through.

The step loop runs apart from the HTTP server, so it never waits on the GIL of request handling (vLLM V1's
split). Two multiprocessing pipes carry pickled messages: requests and aborts in, each step's outputs plus a
scheduler snapshot out. The child exits when the parent says so or when the parent's end of the pipe closes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import traceback
from dataclasses import dataclass
from typing import Any

from folio.config import EngineConfig
from folio.core.sched_output import EngineCoreOutput
from folio.core.scheduler import SchedulerStats
from folio.model.spec import ModelSpec
from folio.request import Request

_READY_TIMEOUT_S = 600.0
_SHUTDOWN_TIMEOUT_S = 5.0
_DISK_FLUSH_TIMEOUT_S = 120.0  # with a disk tier the core writes its cached blocks there before it exits


@dataclass
class AddRequests:
    requests: list[Request]


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class CoreReady:
    num_blocks: int
    model_spec: ModelSpec
    num_host_blocks: int = 0  # the host KV tier's blocks, as the worker resolved them (0: no tier)


@dataclass
class CoreFailed:
    message: str


@dataclass
class StepOutputs:
    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats


@dataclass
class CorePlacement:
    """Where one of several engine cores runs (data parallelism, folio/engine/dp_client.py); None: the defaults."""

    num_cpu_threads: int | None = None  # the core's share of the CPU threads (its worker ranks divide it again)
    cuda_visible_devices: str | None = None  # the core's GPUs, e.g. "2,3": its rank r uses the r-th of them

    def apply(self) -> None:
        """In the core's process, before CUDA starts. The environment carries the share to its worker processes."""
        if self.cuda_visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.cuda_visible_devices
        if self.num_cpu_threads is not None:
            import torch

            os.environ["OMP_NUM_THREADS"] = str(self.num_cpu_threads)
            torch.set_num_threads(self.num_cpu_threads)


def run_engine_core(
    config: EngineConfig, requests_in: Any, outputs_out: Any, placement: CorePlacement | None = None
) -> None:
    """Child-process entry: load the model, report ready, then serve the step loop until told to stop."""
    if placement is not None:
        placement.apply()
    from folio.engine.core import EngineCore
    from folio.executor import make_executor
    from folio.logger import init_logger

    init_logger()
    try:
        executor = make_executor(config)
        core = EngineCore(config, executor)
    except Exception as e:  # reported to the frontend, which raises it for the user
        outputs_out.send(CoreFailed(f"{type(e).__name__}: {e}"))
        return
    cache = config.cache_config
    outputs_out.send(CoreReady(cache.num_blocks, executor.model_spec, cache.num_host_blocks))
    try:
        _serve(core, requests_in, outputs_out)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the frontend went away: nothing left to serve
    except Exception:
        traceback.print_exc()
        os._exit(1)
    core.shutdown()  # the disk tier keeps the prefix cache for a restart


def _serve(core: Any, requests_in: Any, outputs_out: Any) -> None:
    while True:
        if not core.has_unfinished_requests():
            requests_in.poll(None)  # idle: sleep until there is input
        while requests_in.poll(0):  # take whatever has arrived, then step
            message = requests_in.recv()
            if isinstance(message, Shutdown):
                return
            if isinstance(message, AddRequests):
                for request in message.requests:
                    core.add_request(request)
            elif isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids)
        # An idle core still reports once after each batch of input, so the frontend sees aborts land.
        outputs = core.step()
        outputs_out.send(StepOutputs(outputs, core.get_stats()))


class EngineCoreClient:
    """Frontend side: starts the core process and moves messages; knows nothing of tokens or text."""

    def __init__(self, config: EngineConfig, placement: CorePlacement | None = None, name: str = "") -> None:
        ctx = multiprocessing.get_context("spawn")
        requests_out, requests_in = ctx.Pipe(duplex=False)  # (receive end, send end)
        outputs_in, outputs_out = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=run_engine_core,
            args=(config, requests_out, outputs_out, placement),
            name=f"folio-engine-core{name}",
            daemon=True,
        )
        self.process.start()
        requests_out.close()
        outputs_out.close()  # the child holds its own copies; closing ours makes EOF visible when it dies
        self._send_conn = requests_in
        self.outputs_conn = outputs_in
        disk_tier = config.cache_config.kv_offloading_disk_path is not None
        self.shutdown_timeout_s = _DISK_FLUSH_TIMEOUT_S if disk_tier else _SHUTDOWN_TIMEOUT_S

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def wait_ready(self) -> CoreReady:
        """Blocks until the model is loaded; raises the core's own error (as ValueError) if it failed."""
        if not self.outputs_conn.poll(_READY_TIMEOUT_S):
            self.shutdown()
            raise RuntimeError(f"the engine core did not start within {_READY_TIMEOUT_S:.0f} s")
        try:
            message = self.outputs_conn.recv()
        except EOFError:
            self.process.join(5)  # its exit code is known once it is reaped
            raise RuntimeError(f"the engine core exited during start-up (exit code {self.process.exitcode})") from None
        if isinstance(message, CoreFailed):
            self.process.join(5)
            raise ValueError(message.message)
        assert isinstance(message, CoreReady)
        return message

    def add_requests(self, requests: list[Request]) -> None:
        self._send(AddRequests(requests))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(request_ids))

    def _send(self, message: object) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):  # a dead core is reported by the output side
            self._send_conn.send(message)

    def send_shutdown(self) -> None:
        """Asks the core to stop without waiting (several cores stop together); ``shutdown`` then waits."""
        if self.process.is_alive():
            self._send(Shutdown())

    def shutdown(self, timeout_s: float | None = None) -> None:
        if self.process.is_alive():
            self._send(Shutdown())
            self.process.join(self.shutdown_timeout_s if timeout_s is None else timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout_s)
        self._send_conn.close()
        self.outputs_conn.close()

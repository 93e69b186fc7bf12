"""MultiProcExecutor: one worker process per rank (folio/executor/worker_proc.py), started by the engine core.

Each step the SchedulerOutput is pickled once and the same bytes go down every rank's pipe; one rank (the driver:
rank 0, or with pipeline parallelism the last stage's first rank) sends the ModelRunnerOutput back. Under tensor
parallelism the other ranks only take part in the collectives inside the forward pass and sample the same tokens
from the same gathered numbers, so their copies of the requests stay the same; pipeline stages before the last do
not sample and learn the tokens from the next SchedulerOutput (CachedRequestData.new_token_ids). Steps may be
submitted before the previous one is answered (pipeline parallelism: up to pp in flight); outputs come in order.
Every wait on the workers also waits on their process sentinels: a worker that dies (killed, crashed, or failed
with its error reported) is an engine error at once, never a hang; the executor then stops the other ranks.
Why pipes: one pickled decode step of 256 requests is a few KiB, and a pipe round trip costs tens of
microseconds (docs/scale_out.md), small beside a step; a shared-memory ring (vLLM's) pays off with many ranks.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import pickle
import time
import weakref
from typing import Any, NoReturn

from folio.config import EngineConfig
from folio.core.sched_output import ModelRunnerOutput, SchedulerOutput
from folio.executor.distributed import DistributedExecutor, check_parallel_start
from folio.executor.rank_start import EngineSurroundings, rank_process_context
from folio.executor.worker_proc import WorkerFailed, WorkerReady, apply_ready, run_worker

_READY_TIMEOUT_S = 600.0
_STOP_TIMEOUT_S = 5.0
_PEER_EXIT_WAIT_S = 5.0  # a rank that saw its peer die: how long the peer's exit may take to be observable here
_FAILURE_GRACE_S = 1.0  # any other failure: how long a peer's death that caused it may take to be seen here


class MultiProcExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        check_parallel_start(config)
        _allow_children()
        import torch

        from folio.worker.device import resolve_device

        ctx = rank_process_context(resolve_device(config.device).type)

        from folio.parallel.group import rendezvous_store  # torch: imported once an executor is built

        self._rendezvous = rendezvous_store()  # the ranks meet here; it lives as long as this executor
        port = self._rendezvous.port
        num_threads = max(1, torch.get_num_threads() // self.world_size)  # the ranks share this process's threads
        self._procs: list[Any] = []
        self._to_workers: list[Any] = []
        self._from_workers: list[Any] = []
        for rank in range(self.world_size):
            sched_out, sched_in = ctx.Pipe(duplex=False)  # (receive end, send end)
            results_out, results_in = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=run_worker,
                args=(config, rank, self.world_size, port, sched_out, results_in, num_threads, EngineSurroundings()),
                name=f"folio-worker-{rank}",
                daemon=True,
            )
            proc.start()
            sched_out.close()  # the child holds its own copies; closing ours makes EOF visible when it dies
            results_in.close()
            self._procs.append(proc)
            self._to_workers.append(sched_in)
            self._from_workers.append(results_out)
        # shutdown(): tells every worker to stop, kills those still alive after a few seconds
        self._stop = weakref.finalize(self, _stop_workers, self._procs, self._to_workers, self._from_workers)
        ready = self._wait_ready()
        apply_ready(config, ready)
        self._model_spec = ready.model_spec

    @property
    def worker_pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """The step's pickled SchedulerOutput down every rank's pipe; does not wait for its output."""
        self._raise_if_failed()
        payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._to_workers):
            try:
                conn.send_bytes(payload)
            except OSError:  # its end of the pipe is closed: the process is gone
                self._fail(self._death_message(rank))

    def _collect(self) -> ModelRunnerOutput:
        """The output rank's next message: the oldest submitted step's ModelRunnerOutput."""
        self._raise_if_failed()
        rank, message = self._receive()
        if rank != self.output_rank or not isinstance(message, ModelRunnerOutput):
            self._fail(f"worker rank {rank} sent an unexpected {type(message).__name__}")
        return message

    def _wait_ready(self) -> WorkerReady:
        """Every rank's WorkerReady (rank 0's returned); a failure raises (ValueError for a bad configuration)."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        ready: dict[int, WorkerReady] = {}
        while len(ready) < self.world_size:
            rank, message = self._receive(deadline)
            if not isinstance(message, WorkerReady):
                self._fail(f"worker rank {rank} sent an unexpected {type(message).__name__}")
            ready[rank] = message
        return ready[0]

    def _receive(self, deadline: float | None = None) -> tuple[int, Any]:
        """The next (rank, message) from any worker, waiting on every worker's sentinel too: raises at once when
        a worker dies or reports a failure (after stopping the others)."""
        sentinels = {proc.sentinel: r for r, proc in enumerate(self._procs)}
        pipes = {id(conn): r for r, conn in enumerate(self._from_workers)}
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait([*self._from_workers, *sentinels], timeout)
            if not ready:
                self._fail(f"the worker processes did not start within {_READY_TIMEOUT_S:.0f} s")
            for obj in ready:  # pipes first: a failing worker reports its error, then exits
                if not isinstance(obj, int) and (message := self._recv(obj)) is not None:
                    if isinstance(message, WorkerFailed):
                        self._fail_with(message, pipes[id(obj)])
                    return pipes[id(obj)], message
            for obj in ready:
                if isinstance(obj, int):
                    self._fail(self._death_message(sentinels[obj]))

    def _recv(self, conn: Any) -> Any:
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None  # the process is exiting; its sentinel reports it

    def _fail_with(self, message: WorkerFailed, rank: int) -> NoReturn:
        if message.error_type == "ValueError":  # a bad configuration, as the in-process worker would raise it
            self._failure = message.message
            self.shutdown()
            raise ValueError(message.message)
        # A rank whose peer died fails in its next collective or stage message (gloo: the connection closed; the
        # shared-memory all-reduce: PeerDiedError): the death is the cause to report. Either can come before the
        # dead peer is reapable, so wait for the others' sentinels a moment (longer where the error says a peer died).
        wait_s = _PEER_EXIT_WAIT_S if message.error_type == "PeerDiedError" else _FAILURE_GRACE_S
        others = {proc.sentinel: proc for r, proc in enumerate(self._procs) if r != rank}
        for sentinel in multiprocessing.connection.wait(list(others), wait_s):
            others[sentinel].join(1.0)  # its sentinel fires as its files close, a moment before it is reapable
        dead = [r for r, proc in enumerate(self._procs) if r != rank and not proc.is_alive()]
        if dead:
            self._fail(self._death_message(dead[0]))
        self._fail(f"worker rank {rank} failed: {message.error_type}: {message.message}")

    def _death_message(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(1.0)  # its exit code is known once it is reaped
        return f"worker rank {rank} (pid {proc.pid}) died (exit code {proc.exitcode})"


def _allow_children() -> None:
    """The serving engine core is a daemon process (it dies with the server) and Python refuses children to a
    daemon. Its workers are daemons of the core and read its pipe, so they never outlive it either way."""
    current = multiprocessing.current_process()
    if current.daemon:
        current.daemon = False


def _stop_workers(procs: list[Any], to_workers: list[Any], from_workers: list[Any]) -> None:
    for conn in to_workers:
        with contextlib.suppress(OSError):
            conn.send_bytes(b"")  # stop
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(_STOP_TIMEOUT_S)
    for conn in (*to_workers, *from_workers):
        conn.close()

"""One rank's worker process of the multiprocess executor: join the rank group, build the Worker, then run
every SchedulerOutput the engine core sends; one rank alone sends each step's ModelRunnerOutput back (rank 0, or
with pipeline parallelism the last stage's first rank, whose stage samples: folio/parallel/stages.py).

Two pipes per rank: pickled SchedulerOutputs in (an empty message means stop), messages out (ready, failed,
the output rank's ModelRunnerOutputs). The process ends when the core says so, when the core's end of the pipe
closes (EOF: the core is gone), or on an error, which it reports before exiting non-zero.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any

from folio.config import EngineConfig
from folio.model.spec import ModelSpec
from folio.parallel.stages import output_rank


@dataclass
class WorkerReady:
    rank: int
    model_spec: ModelSpec
    num_blocks: int  # the same on every rank (the ranks agree on the smallest)
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    disk_block_hashes: list[int] = field(default_factory=list)


@dataclass
class WorkerFailed:
    rank: int
    error_type: str  # the exception's class name; ValueError (bad configuration) is raised again as one
    message: str


def run_worker(
    config: EngineConfig,
    rank: int,
    world_size: int,
    port: int,
    sched_in: Any,
    results_out: Any,
    num_threads: int,
    surroundings: None,
) -> None:
    """Process entry (started by MultiProcExecutor); num_threads: this rank's share of the engine's CPU threads;
    surroundings: None once unpickled, which gave this process the engine's environment, stdout and stderr
    (folio/executor/rank_start.py)."""
    import signal

    import torch

    from folio.logger import init_logger

    signal.signal(signal.SIGINT, signal.default_int_handler)  # the fork server leaves Ctrl-C at the OS default
    init_logger()
    torch.set_num_threads(num_threads)
    try:
        worker = start_worker(config, rank, world_size, "127.0.0.1", port)
    except Exception as e:
        _report_failure(results_out, rank, e, str(e))
        os._exit(1)
    results_out.send(ready_message(config, rank, worker))
    sender = OutputSender(results_out) if is_output_rank(config, rank) else None
    try:
        _serve(worker, sched_in, sender)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        os._exit(0)  # the core went away: nothing left to serve
    except Exception as e:
        # its messages first, one writer on the pipe at a time; if they cannot go, the exit code alone tells the core
        if sender is None or sender.close():
            _report_failure(results_out, rank, e, traceback.format_exc())
        os._exit(1)
    if sender is not None:
        sender.close()


def start_worker(
    config: EngineConfig,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    gpu_index: int | None = None,
    cpu_allreduce: str | None = None,
) -> Any:
    """Joins the rank group whose rank 0 listens on host:port (and the pipeline's groups), then builds this rank's
    Worker. Shared by the worker processes here and the Ray actors (folio/executor/ray_executor.py); gpu_index:
    the CUDA device this rank uses (None: its rank, every GPU of the machine visible). cpu_allreduce: the CPU
    collectives ("shm" needs every rank on this machine); None: the configuration's."""
    from folio.parallel.group import RankGroup, init_rank_group
    from folio.parallel.pipeline_parallel import init_pipeline_ranks
    from folio.worker.device import resolve_device
    from folio.worker.worker import Worker

    parallel = config.parallel_config
    device_type = resolve_device(config.device).type
    allreduce = parallel.cpu_allreduce if cpu_allreduce is None else cpu_allreduce
    stage = None
    if parallel.pipeline_parallel_size > 1:
        tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        group, stage = init_pipeline_ranks(rank, tp_size, pp_size, port, device_type, host, allreduce)
    elif world_size > 1:
        group = init_rank_group(rank, world_size, port, device_type, allreduce, host)
    else:
        group = RankGroup(0, 1)
    return Worker(config, group, stage, gpu_index)


def ready_message(config: EngineConfig, rank: int, worker: Any) -> WorkerReady:
    """What the executor learns once a rank is built: the model and the KV cache's size (the ranks agreed on it)."""
    cache = config.cache_config
    return WorkerReady(
        rank, worker.spec, cache.num_blocks, cache.num_host_blocks, cache.num_disk_blocks, cache.disk_block_hashes
    )


def apply_ready(config: EngineConfig, ready: WorkerReady) -> None:
    """The executor's side of ready_message: the block counts the ranks resolved, for the engine core's scheduler."""
    cache = config.cache_config
    cache.num_blocks, cache.num_host_blocks = ready.num_blocks, ready.num_host_blocks
    cache.num_disk_blocks, cache.disk_block_hashes = ready.num_disk_blocks, ready.disk_block_hashes


def is_output_rank(config: EngineConfig, rank: int) -> bool:
    """Whether this rank's ModelRunnerOutputs go back to the engine core (folio/parallel/stages.py)."""
    parallel = config.parallel_config
    return rank == output_rank(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)


def _serve(worker: Any, sched_in: Any, sender: OutputSender | None) -> None:
    while True:
        payload = sched_in.recv_bytes()
        if not payload:
            return
        output = worker.execute_model(pickle.loads(payload))
        if sender is not None:
            sender.send(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL))


class OutputSender:
    """Writes the output rank's ModelRunnerOutputs to the core from a thread of its own, in order, so that the
    serving loop goes back to reading the next step while an output larger than the pipe's buffer waits for the core.
    Written from the loop, such an output and a next step larger than the buffer, coming down while the core keeps
    pipeline-parallel steps in flight, would each wait for the other to be read: a deadlock."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="folio-output-sender", daemon=True)
        self._thread.start()

    def send(self, data: bytes) -> None:
        """Queues one message; raises the error that ended an earlier write (BrokenPipeError: the core is gone)."""
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def close(self, timeout_s: float = 30.0) -> bool:
        """Writes what is queued (the core reads everything until it stops the workers), then ends the thread;
        False if that took longer than ``timeout_s`` (the thread may still be writing)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError as e:
                self._error = e
                return


def _report_failure(results_out: Any, rank: int, error: Exception, message: str) -> None:
    with contextlib.suppress(OSError):  # the core may be gone already
        results_out.send(WorkerFailed(rank, type(error).__name__, message))

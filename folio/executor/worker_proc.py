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


def run_worker(config: EngineConfig, rank: int, world_size: int, port: int, sched_in: Any, results_out: Any) -> None:
    """Process entry (spawned by MultiProcExecutor)."""
    import torch

    from folio.logger import init_logger
    from folio.parallel.group import RankGroup, init_rank_group
    from folio.parallel.pipeline_parallel import init_pipeline_ranks
    from folio.worker.worker import Worker, resolve_device

    init_logger()
    # The ranks share the machine's cores (CPU) unless OMP_NUM_THREADS says otherwise for each.
    torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    pp_size = config.parallel_config.pipeline_parallel_size
    try:
        device_type = resolve_device(config.device).type
        stage = None
        cpu_allreduce = config.parallel_config.cpu_allreduce
        if pp_size > 1:
            tp_size = config.parallel_config.tensor_parallel_size
            group, stage = init_pipeline_ranks(rank, tp_size, pp_size, port, device_type, cpu_allreduce)
        elif world_size > 1:
            group = init_rank_group(rank, world_size, port, device_type, cpu_allreduce)
        else:
            group = RankGroup(0, 1)
        worker = Worker(config, group, stage)
    except Exception as e:
        _report_failure(results_out, rank, e, str(e))
        os._exit(1)
    cache = config.cache_config
    results_out.send(
        WorkerReady(
            rank, worker.spec, cache.num_blocks, cache.num_host_blocks, cache.num_disk_blocks, cache.disk_block_hashes
        )
    )
    try:
        _serve(worker, rank == output_rank(config.parallel_config.tensor_parallel_size, pp_size), sched_in, results_out)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        os._exit(0)  # the core went away: nothing left to serve
    except Exception as e:
        _report_failure(results_out, rank, e, traceback.format_exc())
        os._exit(1)


def _serve(worker: Any, sends_output: bool, sched_in: Any, results_out: Any) -> None:
    while True:
        payload = sched_in.recv_bytes()
        if not payload:
            return
        output = worker.execute_model(pickle.loads(payload))
        if sends_output:
            results_out.send_bytes(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL))


def _report_failure(results_out: Any, rank: int, error: Exception, message: str) -> None:
    with contextlib.suppress(OSError):  # the core may be gone already
        results_out.send(WorkerFailed(rank, type(error).__name__, message))

"""What the executors with one worker per rank share, whatever carries their steps (pipes to worker processes:
multiproc.py; Ray actor tasks: ray_executor.py): the start-up checks and a base class with
the ranks, the output rank, the failure that ends every later call, and the Executor interface's plain parts."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

from folio.config import EngineConfig
from folio.core.sched_output import ModelRunnerOutput, SchedulerOutput
from folio.model.spec import ModelSpec
from folio.parallel.stages import PP_FLAG, check_pipeline_parallel, output_rank
from folio.step_timer import StepTimer

logger = logging.getLogger("folio")


class DistributedExecutor:
    """Subclasses start the ranks (then set ``_model_spec``, and ``_stop``: stops every rank, idempotent), send
    steps (submit) and read the output rank's answers (collect); once ``_failure`` is set, every later call raises
    it."""

    _stop: Callable[[], Any]

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel_config
        self.world_size = parallel.world_size
        self.pipeline_parallel_size = parallel.pipeline_parallel_size
        self.output_rank = output_rank(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self._failure: str | None = None
        self._model_spec: ModelSpec | None = None
        # the output rank's time in its tensor-parallel collectives (cumulative, as of the last step collected) and
        # the steps collected: `folio bench throughput` prints the difference over its run per step
        self.collective_seconds = 0.0
        self.steps_collected = 0

    @property
    def model_spec(self) -> ModelSpec:
        assert self._model_spec is not None, "the ranks have not started"
        return self._model_spec

    def set_step_timer(self, timer: StepTimer | None) -> None:
        """The step's phases run in the ranks' processes: no per-phase timings here."""

    @property
    def max_concurrent_batches(self) -> int:
        """Pipeline parallelism: one batch per stage in flight, so that every stage has work (vLLM's rule)."""
        return self.pipeline_parallel_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        raise NotImplementedError

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's ModelRunnerOutput (the output rank answers the steps in order)."""
        output = self._collect()
        self.steps_collected += 1
        if output.collective_seconds is not None:
            self.collective_seconds = output.collective_seconds
        return output

    def _collect(self) -> ModelRunnerOutput:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stops every rank (those that do not stop are killed). Idempotent."""
        if self._failure is None:
            self._failure = "the executor was shut down"
        self._stop()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)

    def _fail(self, message: str) -> NoReturn:
        """The engine's error: every rank stopped, this call and every later one raise RuntimeError(message)."""
        self._failure = message
        logger.error("%s: stopping the other ranks", message)
        self.shutdown()
        raise RuntimeError(message)


def check_parallel_start(config: EngineConfig, count_local_gpus: bool = True) -> None:
    """Bad parallel settings as a ValueError naming the flag and the limit, before any process starts. The Ray
    executor counts its cluster's devices instead of this machine's GPUs (count_local_gpus False)."""
    parallel = config.parallel_config
    if parallel.world_size == 1:
        return
    from folio.model.loader import read_model_spec
    from folio.parallel.tensor_parallel import check_tensor_parallel
    from folio.worker.device import resolve_device

    spec = read_model_spec(config.model_config.model)
    check_tensor_parallel(spec, parallel.tensor_parallel_size, parallel.tensor_parallel_uneven_heads)
    check_pipeline_parallel(spec.num_hidden_layers, parallel.pipeline_parallel_size)
    if count_local_gpus and resolve_device(config.device).type == "cuda":
        import torch

        check_num_devices(config, "GPU", torch.cuda.device_count(), "this machine")


def check_num_devices(config: EngineConfig, device: str, available: float, where: str) -> None:
    """One device per rank: a ValueError naming the flag(s) and what ``where`` has."""
    parallel = config.parallel_config
    world_size, tp, pp = parallel.world_size, parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if world_size > available:
        setting = f"tensor_parallel_size (--tensor-parallel-size) {tp}" if pp == 1 else f"{PP_FLAG} {pp}"
        if tp > 1 and pp > 1:
            setting = f"tensor_parallel_size x pipeline_parallel_size ({tp} x {pp} = {world_size} ranks)"
        raise ValueError(f"{setting} needs one {device} per rank; {where} has {available:g}")

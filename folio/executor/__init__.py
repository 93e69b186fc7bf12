"""Executors run the model for the engine core: the worker in the core's own process (uniproc), one worker
process per rank (multiproc) or one Ray actor per rank (ray_executor). One interface, so the engine core never
knows how many ranks there are."""

from __future__ import annotations

from typing import Protocol

from folio.config import EngineConfig
from folio.core.sched_output import ModelRunnerOutput, SchedulerOutput
from folio.model.spec import ModelSpec
from folio.step_timer import StepTimer


class Executor(Protocol):
    @property
    def model_spec(self) -> ModelSpec: ...

    def set_step_timer(self, timer: StepTimer | None) -> None: ...

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps may be in flight at once (pipeline parallelism: one per stage)."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Starts a step without waiting for it (folio/engine/batch_queue.py)."""
        ...

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted and not yet collected (waits for it)."""
        ...

    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig) -> Executor:
    """The executor config.parallel_config names; it resolves config.cache_config's block counts before returning."""
    if config.parallel_config.distributed_executor_backend == "mp":
        from folio.executor.multiproc import MultiProcExecutor

        return MultiProcExecutor(config)
    if config.parallel_config.distributed_executor_backend == "ray":
        from folio.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from folio.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config)

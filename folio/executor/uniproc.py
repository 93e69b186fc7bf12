"""UniProcExecutor: the worker lives in the engine core's process (one device, no parallelism)."""

from __future__ import annotations

from collections import deque

from folio.config import EngineConfig
from folio.core.sched_output import ModelRunnerOutput, SchedulerOutput
from folio.model.loader import ModelSpec
from folio.step_timer import StepTimer
from folio.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self._outputs: deque[ModelRunnerOutput] = deque()  # submitted, not yet collected

    @property
    def num_blocks(self) -> int:
        return self.worker.config.cache_config.num_blocks

    @property
    def model_spec(self) -> ModelSpec:
        return self.worker.spec

    def set_step_timer(self, timer: StepTimer | None) -> None:
        self.worker.model_runner.step_timer = timer

    @property
    def max_concurrent_batches(self) -> int:
        return 1

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """One rank in this process: the step runs now; collect() hands its output over."""
        self._outputs.append(self.worker.execute_model(scheduler_output))

    def collect(self) -> ModelRunnerOutput:
        return self._outputs.popleft()

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives and dies with this process."""

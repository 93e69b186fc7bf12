"""Optional per-step phase timings taken at the engine's real call sites (``folio bench latency --profile``).

One step of the offline engine is, in order: ``scheduler.schedule`` -> input preparation (the runner's request
states, copy-on-write, ids / positions / AttnMetadata) -> model forward and logits -> sampling ->
``scheduler.update_from_output`` -> output processing (detokenize, stop strings). Each call site ends its phase
with ``timer.lap(PHASE)``: a lap is the time since the previous one, so the phases tile the step with no gaps and
glue code (executor dispatch, entering inference mode) is charged to the phase it precedes.

Zero cost when off: every component holds ``step_timer = None`` unless a benchmark attaches one, and a call site is
``if self.step_timer is not None: self.step_timer.lap(...)`` -- one attribute load and compare per phase.

Two clocks per lap: wall time (``time.perf_counter``) and the calling thread's CPU time (``time.thread_time``).
The CPU clock is the one that answers "what does the engine cost": it ignores time the OS gave to other
processes. It does not see torch's intra-op worker threads, so for a real model's forward read the wall column.
On CUDA the forward only launches kernels; the wait for them lands in sampling (its ``.tolist()`` synchronizes).
Pure Python: ``folio.core`` components may hold one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SCHEDULE = "scheduler.schedule"
PREPARE_INPUTS = "input preparation"
FORWARD = "model forward"
SAMPLE = "sampling"
UPDATE_FROM_OUTPUT = "scheduler.update_from_output"
OUTPUT_PROCESSING = "output processing"
PHASES = (SCHEDULE, PREPARE_INPUTS, FORWARD, SAMPLE, UPDATE_FROM_OUTPUT, OUTPUT_PROCESSING)


@dataclass
class StepTiming:
    """One step: its batch (requests and tokens scheduled) and seconds per phase on both clocks."""

    num_reqs: int = 0
    num_tokens: int = 0
    wall_s: dict[str, float] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def is_pure_decode(self) -> bool:
        """Every scheduled request computes exactly one token (no prefill in the step)."""
        return self.num_reqs > 0 and self.num_tokens == self.num_reqs


class StepTimer:
    """Collects a ``StepTiming`` per engine step between ``begin()`` and ``end()``; laps outside a step are ignored
    (the engine core of ``folio serve`` never begins one)."""

    def __init__(self) -> None:
        self.steps: list[StepTiming] = []
        self._current: StepTiming | None = None
        self._last_wall = 0.0
        self._last_cpu = 0.0

    def begin(self) -> None:
        self._current = StepTiming()
        self._last_wall = time.perf_counter()
        self._last_cpu = time.thread_time()

    def lap(self, phase: str) -> None:
        """Charges the time since the previous lap (or ``begin``) to ``phase``; a repeated phase accumulates."""
        step = self._current
        if step is None:
            return
        wall, cpu = time.perf_counter(), time.thread_time()
        step.wall_s[phase] = step.wall_s.get(phase, 0.0) + wall - self._last_wall
        step.cpu_s[phase] = step.cpu_s.get(phase, 0.0) + cpu - self._last_cpu
        self._last_wall, self._last_cpu = wall, cpu

    def set_batch(self, num_reqs: int, num_tokens: int) -> None:
        """What the scheduler handed out this step, so a report can keep only the steps of a given shape."""
        if self._current is not None:
            self._current.num_reqs = num_reqs
            self._current.num_tokens = num_tokens

    def end(self) -> None:
        if self._current is not None:
            self.steps.append(self._current)
            self._current = None

    def clear(self) -> None:
        self.steps.clear()
        self._current = None

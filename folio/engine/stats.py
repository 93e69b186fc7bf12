"""Stats the frontend hands to stat loggers (Prometheus, the periodic log line) after each engine-core step.

``SchedulerStats`` is a snapshot from the core process; ``IterationStats`` is what the frontend measured for the
outputs of that step (it owns the request timings, the core does not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from folio.core.scheduler import SchedulerStats

__all__ = ["FinishedRequestStats", "IterationStats", "SchedulerStats", "StatLogger"]


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop", "length" or "abort"
    e2e_latency: float  # seconds, arrival -> last output
    queue_time: float  # seconds, arrival -> first scheduled
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0  # prompt tokens of requests whose first token came in this step
    num_generation_tokens: int = 0  # tokens generated in this step
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, one per request that started
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds between consecutive tokens
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    """``engine_index``: the engine core the step came from (0..N-1 with data parallelism; vLLM's engine_idx)."""

    def record(
        self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats, engine_index: int = 0
    ) -> None: ...


@dataclass
class _RequestTiming:
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    queue_time: float = 0.0


class IterationStatsCollector:
    """Turns each step's outputs into IterationStats; keeps one timing record per live user request."""

    def __init__(self) -> None:
        self._timings: dict[str, _RequestTiming] = {}

    def add_request(self, request_id: str, arrival_time: float, num_prompt_tokens: int) -> None:
        self._timings[request_id] = _RequestTiming(arrival_time, num_prompt_tokens)

    def record_tokens(
        self, stats: IterationStats, request_id: str, num_new_tokens: int, now: float, queue_time: float | None
    ) -> None:
        timing = self._timings.get(request_id)
        if timing is None or num_new_tokens == 0:
            return
        stats.num_generation_tokens += num_new_tokens
        if queue_time is not None:
            timing.queue_time = queue_time
        if timing.first_token_time is None:
            timing.first_token_time = now
            stats.num_prompt_tokens += timing.num_prompt_tokens
            stats.time_to_first_tokens.append(now - timing.arrival_time)
        elif timing.last_token_time is not None:
            stats.inter_token_latencies.append(now - timing.last_token_time)
        timing.last_token_time = now
        timing.num_generation_tokens += num_new_tokens

    def finish_request(self, stats: IterationStats, request_id: str, finish_reason: str, now: float) -> None:
        timing = self._timings.pop(request_id, None)
        if timing is None:
            return
        stats.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=now - timing.arrival_time,
                queue_time=timing.queue_time,
                num_prompt_tokens=timing.num_prompt_tokens,
                num_generation_tokens=timing.num_generation_tokens,
            )
        )

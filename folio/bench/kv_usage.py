"""How much of the allocated KV memory holds live tokens over a run, against what contiguous allocation would use.

Sampled after every engine step (``LLMEngine.stats_observer``) and summarized over the steps at the run's peak
concurrency, where the question matters: paged blocks waste at most block_size - 1 slots per request, while a
contiguous allocator reserves each sequence's maximum length up front.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.core.scheduler import SchedulerStats


@dataclass
class KVUsageSampler:
    samples: list[SchedulerStats] = field(default_factory=list)

    def __call__(self, stats: SchedulerStats) -> None:
        self.samples.append(stats)


@dataclass
class KVUsageReport:
    peak_running: int
    steps_at_peak: int
    paged: float  # live tokens / slots of the blocks in use, mean over the peak steps
    contiguous_max_model_len: float  # live tokens / (running x max_model_len)
    contiguous_request_max: float  # live tokens / (running x mean of prompt + max_tokens over the request set)

    def lines(self, max_model_len: int, mean_request_max: float) -> list[str]:
        return [
            f"KV cache usage at full concurrency ({self.peak_running} running, {self.steps_at_peak} steps): "
            f"live tokens fill {100 * self.paged:.1f}% of the allocated KV blocks (paged"
            + (", over 100%: requests share prefix blocks, each counts its own tokens)" if self.paged > 1 else ")"),
            f"  a contiguous allocation of max_model_len ({max_model_len}) per sequence would be "
            f"{100 * self.contiguous_max_model_len:.1f}% full; of each request's own maximum "
            f"(prompt + max_tokens, mean {mean_request_max:.0f}) {100 * self.contiguous_request_max:.1f}% full",
        ]


def summarize_kv_usage(
    samples: list[SchedulerStats], max_model_len: int, mean_request_max: float
) -> KVUsageReport | None:
    """None if no step had a running request."""
    peak = max((s.num_running for s in samples), default=0)
    at_peak = [s for s in samples if s.num_running == peak and s.num_kv_held_slots > 0]
    if peak == 0 or not at_peak:
        return None
    n = len(at_peak)
    return KVUsageReport(
        peak_running=peak,
        steps_at_peak=n,
        paged=sum(s.num_kv_live_tokens / s.num_kv_held_slots for s in at_peak) / n,
        contiguous_max_model_len=sum(s.num_kv_live_tokens / (peak * max_model_len) for s in at_peak) / n,
        contiguous_request_max=sum(s.num_kv_live_tokens / (peak * mean_request_max) for s in at_peak) / n,
    )

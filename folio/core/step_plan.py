"""The decisions of one ``Scheduler.schedule()`` call, collected before they become a SchedulerOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

from folio.core.kv_cache_manager import AllocationResult
from folio.request import Request


@dataclass
class StepPlan:
    """The decisions of one ``schedule()`` call so far; turned into a SchedulerOutput at the end, so that a request
    preempted after it was scheduled in the same step can be taken out again."""

    token_budget: int
    max_num_reqs: int | None = None  # at most this many requests in the step (None: no cap beyond max_num_seqs)
    scheduled: dict[str, Request] = field(default_factory=dict)  # in scheduling order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    allocations: dict[str, AllocationResult] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def is_full(self) -> bool:
        """No more requests fit the step (its max_num_reqs is reached)."""
        return self.max_num_reqs is not None and len(self.scheduled) >= self.max_num_reqs

    def add(self, request: Request, num_new_tokens: int, allocation: AllocationResult) -> None:
        """Schedule ``num_new_tokens`` of ``request`` out of the budget (after its blocks were allocated)."""
        self.scheduled[request.request_id] = request
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.allocations[request.request_id] = allocation
        self.token_budget -= num_new_tokens

    def remove(self, request_id: str) -> None:
        """Un-schedule a request preempted later in the same step: its tokens return to the budget and its
        allocation (with any copy plan) is dropped. No-op if it was not scheduled."""
        if request_id in self.scheduled:
            del self.scheduled[request_id]
            del self.allocations[request_id]
            self.token_budget += self.num_scheduled_tokens.pop(request_id)

"""The engine core's side of pipeline parallelism: the sampled tokens for the stages that do not sample, and up to
pp batches in flight so that the stages overlap (vLLM v1's batch_queue / max_concurrent_batches).

Why a request is never in two batches at once: schedule() advances num_computed_tokens when it schedules (the
scheduler's convention), so a decoding request whose token is not back yet has nothing left to schedule; a long
prompt's next chunk may go into the next batch, which every stage runs after this one (each stage takes its
batches in order, so K/V written by batch i is there when batch i + 1 reads it). To give each batch requests of its
own, a step schedules at most ceil(unfinished requests / pp) of them: with 8 decoding requests at pp=2, batches of
4 alternate, and stage 0 computes one while stage 1 computes the other.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from folio.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from folio.request import Request

if TYPE_CHECKING:
    from folio.engine.core import EngineCore


def attach_scheduled_token_ids(output: SchedulerOutput, requests: dict[str, Request]) -> None:
    """Fills ``scheduled_cached_reqs.new_token_ids``: each cached request's token ids at this step's positions
    [num_computed_tokens, + scheduled). The stages before the last take the outputs they lack from there."""
    cached = output.scheduled_cached_reqs
    cached.new_token_ids = []
    for req_id, start in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        request = requests[req_id]
        end = start + output.num_scheduled_tokens[req_id]
        num_prompt = request.num_prompt_tokens
        if end <= num_prompt:  # a prompt chunk: every stage has it
            cached.new_token_ids.append([])
        else:
            cached.new_token_ids.append(request.output_token_ids[max(0, start - num_prompt) : end - num_prompt])


@dataclass
class _InFlight:
    scheduler_output: SchedulerOutput
    # requests preempted by a batch scheduled after this one: their tokens in this batch's output are stale (the
    # request may be running again from an earlier position by the time the output is read)
    stale_req_ids: set[str] = field(default_factory=set)


class BatchQueue:
    """Up to ``max_batches`` SchedulerOutputs submitted to the executor and not yet answered, oldest first."""

    def __init__(self, max_batches: int) -> None:
        self.max_batches = max_batches
        self.in_flight: deque[_InFlight] = deque()
        self.peak_in_flight = 0  # the most batches ever in flight at once (max_batches once the stages overlapped)

    def __len__(self) -> int:
        return len(self.in_flight)

    def step(self, core: EngineCore) -> list[EngineCoreOutput]:
        """Schedules and submits one more batch while fewer than max_batches are in flight and the scheduler found
        work (returns [] without waiting); otherwise waits for the oldest batch's output and updates from it."""
        scheduler, executor = core.scheduler, core.executor
        if len(self.in_flight) < self.max_batches and scheduler.has_unfinished_requests():
            cap = -(-scheduler.get_num_unfinished_requests() // self.max_batches)
            output = scheduler.schedule(max_num_reqs=cap)
            core.structured_output_manager.fill_bitmask(scheduler.requests, output)
            attach_scheduled_token_ids(output, scheduler.requests)
            for batch in self.in_flight:
                batch.stale_req_ids |= output.preempted_req_ids
            if output.total_num_scheduled_tokens > 0 or output.finished_req_ids or output.preempted_req_ids:
                executor.submit(output)  # finished / preempted ids must reach the workers even in an empty batch
                self.in_flight.append(_InFlight(output))
                self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
                if output.total_num_scheduled_tokens > 0 and len(self.in_flight) < self.max_batches:
                    return []
        if not self.in_flight:
            return []
        batch = self.in_flight.popleft()
        runner_output = executor.collect()
        _drop_stale(runner_output, batch.stale_req_ids)
        return core.finish_step(batch.scheduler_output, runner_output)


def _drop_stale(output: ModelRunnerOutput, req_ids: set[str]) -> None:
    """Forgets what ``output`` holds for ``req_ids`` (as if they had not been in the batch)."""
    if not req_ids:
        return
    for row, req_id in enumerate(output.req_ids):
        if req_id in req_ids:
            output.sampled_token_ids[row] = []
            if row < len(output.logprobs):
                output.logprobs[row] = None
    for req_id in req_ids:
        output.prompt_logprobs.pop(req_id, None)
        output.draft_token_ids.pop(req_id, None)

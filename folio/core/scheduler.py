"""The scheduler: which tokens of which requests to compute each step, under DESIGN.md's one accounting rule.

Each step every request gets num_new_tokens = min(num_tokens - num_computed_tokens, remaining token budget,
long_prefill_token_threshold if > 0, max_model_len - num_computed_tokens): running requests first (in admission
order), then waiting ones in policy order while fewer than max_num_seqs run. A prompt larger than the budget is
simply computed over several steps (chunked prefill); a decode is the case num_new_tokens = 1.

num_computed_tokens convention (as vLLM V1): ``schedule()`` advances each scheduled request's num_computed_tokens
by its scheduled count before returning, i.e. it counts the tokens the worker is about to compute. Values sent
to the worker (``NewRequestData.num_computed_tokens``, ``CachedRequestData.num_computed_tokens``) are the values
BEFORE this step's tokens: where the step's first position starts.

n > 1: siblings (``fork_of`` set) wait aside until their parent's prompt is fully scheduled, then share the
parent's prompt blocks (``KVCacheManager.fork``) with num_computed_tokens = prompt_len - 1; recomputing that last
prompt token for their own logits writes into the shared last block, which copy-on-write makes private. They
join ``running`` at the end of that ``schedule()`` and reach the worker as NewRequestData in the next step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from folio.config import SchedulerConfig
from folio.core.block_hash import update_request_block_hashes
from folio.core.fork_waitlist import ForkWaitlist
from folio.core.kv_cache_manager import AllocationResult, KVCacheManager
from folio.core.preemption import PreemptionStrategy
from folio.core.request_queue import create_request_queue
from folio.core.request_update import apply_sampled_tokens
from folio.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from folio.core.sched_stats import SchedulerStats
from folio.core.spec_decode import SpecDecodingStats, keep_drafts, roll_back_rejected, take_scheduled_drafts
from folio.core.step_plan import StepPlan
from folio.request import Request, RequestStatus

__all__ = ["Scheduler", "SchedulerStats"]


def _remove_by_identity(requests: list[Request], request: Request) -> None:
    """list.remove without dataclass field-by-field equality."""
    for index, candidate in enumerate(requests):
        if candidate is request:
            del requests[index]
            return
    raise ValueError(f"request {request.request_id} not found")


class Scheduler:
    """Owns the Request objects from add_request until they finish; talks to the worker only through
    SchedulerOutput (down) and ModelRunnerOutput (up)."""

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.scheduler_config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []  # holds blocks; never longer than max_num_seqs
        self.fork_waitlist = ForkWaitlist()  # n > 1 siblings waiting for their parent's prompt
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the worker to drop
        self._worker_req_ids: set[str] = set()  # requests the worker holds (sent as NewRequestData, not dropped)
        self.num_preemptions_total = 0
        self.preemption = PreemptionStrategy(scheduler_config.preemption_mode, kv_cache_manager)
        self.spec_decoding_stats = SpecDecodingStats()  # totals since start

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        """Accept a request: into the waiting queue, or aside until its parent's prompt is scheduled (fork)."""
        self.check_new_request(request)
        self.requests[request.request_id] = request
        if self.kv_cache_manager.enable_prefix_caching:
            update_request_block_hashes(request, self.block_size)
        parent = self.requests.get(request.fork_of) if request.fork_of is not None else None
        if parent is not None and ForkWaitlist.can_wait_for(parent, request):
            self.fork_waitlist.add(parent.request_id, request)
        else:
            self.waiting.add(request)

    def check_new_request(self, request: Request) -> None:
        """add_request's checks, for a request that waits elsewhere first (its grammar compiling)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not 0 < request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(f"prompt has {request.num_prompt_tokens} tokens; must be 1..{self.max_model_len}")

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, or a stop string found by the output processor), wherever they are:
        waiting, running or waiting for a fork. Frees their blocks now. Unknown or finished ids are ignored."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._remove_from_queues(request)
            request.status = status
            self._release(request)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _remove_from_queues(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            _remove_by_identity(self.running, request)
            return
        if not self.fork_waitlist.remove(request):
            self.waiting.remove(request)

    def _release(self, request: Request) -> None:
        """Forget a finished request (already out of every queue): free its blocks, tell the worker, and let
        siblings still waiting for its prompt fall back to normal scheduling."""
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self._worker_req_ids.discard(request.request_id)
        del self.requests[request.request_id]
        for sibling in self.fork_waitlist.pop_children(request.request_id):
            self.waiting.add(sibling)

    # ---------------------------------------------------------------- schedule

    def schedule(self, max_num_reqs: int | None = None) -> SchedulerOutput:
        """Decide this step's tokens; see the module docstring for the rule and the num_computed_tokens convention.

        When a running request cannot get blocks, running requests are preempted (policy's victim) until it can,
        and no waiting request is admitted in that step (blocks are short). ``max_num_reqs`` caps the requests in
        this step (the pipeline-parallel batch queue spreads the requests over its batches in flight).
        """
        plan = StepPlan(token_budget=self.scheduler_config.max_num_batched_tokens, max_num_reqs=max_num_reqs)
        self._schedule_running(plan)
        # No request is taken out of the step from here on: the blocks it completes become prefix hits now, for
        # the waiting requests admitted below (each of which caches its own in turn).
        for req_id, request in plan.scheduled.items():
            self.kv_cache_manager.cache_scheduled_blocks(request, plan.num_scheduled_tokens[req_id])
        if not plan.preempted_req_ids:
            self._schedule_waiting(plan)
        output = self._build_output(plan)
        self._fork_ready_siblings(plan)
        return output

    def _num_tokens_to_schedule(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        """Drafts (``spec_token_ids``) count as tokens to compute; the caps below may cut them short."""
        num_new_tokens = request.num_tokens + len(request.spec_token_ids) - num_computed_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold
        if threshold > 0:
            num_new_tokens = min(num_new_tokens, threshold)
        return max(0, min(num_new_tokens, token_budget, self.max_model_len - num_computed_tokens))

    def _schedule_running(self, plan: StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.token_budget > 0 and not plan.is_full:
            request = self.running[index]
            num_new_tokens = self._num_tokens_to_schedule(request, request.num_computed_tokens, plan.token_budget)
            if num_new_tokens == 0:
                index += 1
                continue
            num_preempted = len(plan.preempted_req_ids)
            allocation = self._allocate_or_preempt(request, num_new_tokens, plan)
            if allocation is None:
                continue  # the request itself was preempted: running[index] is already the next one
            plan.add(request, num_new_tokens, allocation)
            # Victims before it in running shift it left.
            index = index + 1 if len(plan.preempted_req_ids) == num_preempted else self.running.index(request) + 1

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, plan: StepPlan) -> AllocationResult | None:
        """Allocate, preempting the policy's victim until it works; None if ``request`` itself was the victim."""
        while True:
            allocation = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if allocation is not None:
                return allocation
            victim = self.waiting.select_victim(self.running)
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        """Preempt: swap the blocks out or free them (``PreemptionStrategy``), keep the outputs, wait again.

        It resumes as a NewRequestData carrying its output tokens so far, and continues exactly where it stopped.
        """
        plan.remove(request.request_id)
        self.preemption.release_blocks(request)
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        plan.preempted_req_ids.add(request.request_id)
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        """Out of running and of the worker's requests, drafts dropped, first in line to be scheduled again."""
        _remove_by_identity(self.running, request)
        request.status = RequestStatus.PREEMPTED
        request.spec_token_ids = []
        self._worker_req_ids.discard(request.request_id)
        self.waiting.prepend(request)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in policy order; the first that cannot get blocks stops admission (no skipping,
        so a large request is not starved by smaller ones behind it). It preempts nothing, so each admitted
        request's blocks are cached at once: the next one may hit them."""
        while (
            len(self.waiting) > 0
            and plan.token_budget > 0
            and len(self.running) < self.scheduler_config.max_num_seqs
            and not plan.is_full
        ):
            request = self.waiting.peek()
            # num_hit_tokens: prefix hits (both tiers), or a swapped-out request's kept num_computed_tokens.
            computed_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = self._num_tokens_to_schedule(request, num_hit_tokens, plan.token_budget)
            num_new_hits = num_hit_tokens - request.num_computed_tokens
            allocation = self.kv_cache_manager.allocate_slots(request, num_new_tokens, computed_blocks, num_new_hits)
            if allocation is None:
                break
            self.waiting.pop()
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.add(request, num_new_tokens, allocation)
            self.kv_cache_manager.cache_scheduled_blocks(request, num_new_tokens)

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        """Full data for requests new to the worker, diffs for the others; then advance num_computed_tokens."""
        new_reqs: list[NewRequestData] = []
        cached_reqs = CachedRequestData()
        block_copies: list[tuple[int, int]] = []
        spec_decode_tokens: dict[str, list[int]] = {}
        for req_id, request in plan.scheduled.items():
            drafts = take_scheduled_drafts(request, plan.num_scheduled_tokens[req_id])
            if drafts:
                spec_decode_tokens[req_id] = drafts
            allocation = plan.allocations[req_id]
            block_copies.extend(allocation.block_copies)
            if req_id in self._worker_req_ids:
                cached_reqs.add(req_id, request.num_computed_tokens, allocation)
            else:
                # The block list already has the copy-on-write replacements; the copies are in block_copies.
                new_reqs.append(
                    NewRequestData(
                        req_id=req_id,
                        prompt_token_ids=list(request.prompt_token_ids),
                        output_token_ids=list(request.output_token_ids),
                        sampling_params=request.sampling_params,
                        block_ids=self.kv_cache_manager.get_block_ids(req_id),
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
                self._worker_req_ids.add(req_id)
            request.num_computed_tokens += plan.num_scheduled_tokens[req_id]
        kv_stores, kv_loads = self.kv_cache_manager.take_kv_plans()
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=dict(plan.num_scheduled_tokens),
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=set(plan.preempted_req_ids),
            block_copies=block_copies,
            kv_stores=kv_stores,
            kv_loads=kv_loads,
            kv_disk=self.kv_cache_manager.take_disk_plans(),
            kv_remote_loads=self.kv_cache_manager.take_remote_loads(),
            scheduled_spec_decode_tokens=spec_decode_tokens,
        )
        self.finished_req_ids = set()
        return output

    def _fork_ready_siblings(self, plan: StepPlan) -> None:
        """Fork the waiting siblings of every parent whose prompt is now fully scheduled. Siblings that would push
        running past max_num_seqs are queued normally instead (the worker holds at most max_num_seqs requests).
        A parent whose disk or remote loads have not answered yet waits a step: a failed load would leave the
        shared blocks unwritten under siblings the worker does not know to drop."""
        for req_id, parent in plan.scheduled.items():
            if not self.fork_waitlist.has_children(req_id) or parent.num_computed_tokens < parent.num_prompt_tokens:
                continue
            if self.kv_cache_manager.has_loads_in_doubt(req_id):
                continue
            for sibling in self.fork_waitlist.pop_children(req_id):
                if len(self.running) >= self.scheduler_config.max_num_seqs:
                    self.waiting.add(sibling)
                    continue
                self.kv_cache_manager.fork(req_id, sibling)
                sibling.num_computed_tokens = sibling.num_prompt_tokens - 1
                sibling.num_cached_tokens = sibling.num_computed_tokens
                sibling.first_scheduled_time = time.monotonic()
                sibling.status = RequestStatus.RUNNING
                self.running.append(sibling)

    # ---------------------------------------------------------------- results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, decide token-level stops, cache the blocks just computed, free finished requests.

        One EngineCoreOutput per request that got tokens, prompt logprobs, or finished. Requests aborted since
        the step was scheduled are skipped.
        """
        self._recompute_failed_loads(model_runner_output)
        row_of = {req_id: row for row, req_id in enumerate(model_runner_output.req_ids)}
        # where each request's step started (only needed to place prompt-logprob rows)
        step_starts = scheduler_output.step_starts() if model_runner_output.prompt_logprobs else {}
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            row = row_of.get(req_id)
            sampled = model_runner_output.sampled_token_ids[row] if row is not None else []
            logprobs = (
                model_runner_output.logprobs[row]
                if row is not None and row < len(model_runner_output.logprobs)
                else None
            )
            num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            roll_back_rejected(request, num_drafts, len(sampled), self.spec_decoding_stats, self.kv_cache_manager)
            update = apply_sampled_tokens(
                request,
                sampled,
                logprobs,
                model_runner_output.prompt_logprobs.get(req_id),
                self.kv_cache_manager,
                self.max_model_len,
                step_starts.get(req_id, 0) + scheduler_output.num_scheduled_tokens[req_id],
            )
            if update.stopped:
                self._release(request)  # dropped from running below
            output = update.output
            if request.status == RequestStatus.RUNNING:
                keep_drafts(request, model_runner_output.draft_token_ids.get(req_id))
            if output is not None:
                outputs.append(output)
                any_finished = any_finished or output.finished
        if any_finished:
            self.running = [request for request in self.running if request.status == RequestStatus.RUNNING]
        return outputs

    def _recompute_failed_loads(self, model_runner_output: ModelRunnerOutput) -> None:
        """Failed disk or remote loads (the worker left those requests out and dropped them): the blocks before the
        first failed one are cached, the rest recomputed as after a recompute preemption; the disk tier forgets its
        hashes."""
        self.kv_cache_manager.forget_disk_blocks(model_runner_output.failed_disk_hashes)
        # Last first: each goes back to the front of the queue, so they wait again in the order they were admitted.
        for req_id, num_valid_tokens in reversed(model_runner_output.kv_load_failures.items()):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = num_valid_tokens
            request.num_cached_tokens = min(request.num_cached_tokens, num_valid_tokens)
            self.kv_cache_manager.cache_computed_blocks(request)
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            self._requeue(request)

    # ---------------------------------------------------------------- state for the engine and metrics

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting to be admitted, including siblings waiting for their parent's prompt."""
        return len(self.waiting) + len(self.fork_waitlist)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats.snapshot(
            self.kv_cache_manager,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_preemptions_total=self.num_preemptions_total,
            num_swapped_preemptions_total=self.preemption.num_swapped_preemptions_total,
            num_kv_live_tokens=sum(request.num_computed_tokens for request in self.running),
            spec_decoding=self.spec_decoding_stats,
        )

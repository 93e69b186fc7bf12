"""Property tests of the real Scheduler + KVCacheManager + BlockPool + waiting queues (hypothesis, stateful).

Random configurations (block counts and sizes, budgets, max_num_seqs, long-prefill chunking, prefix caching, policy,
a host KV tier with or without a disk tier under it, and preemption mode) are driven through random sequences of:
add requests (shared prefixes, n > 1 families, EOS / stop tokens, min_tokens, prompt logprobs, priorities), steps
(schedule -> FakeWorker -> update_from_output, sometimes with an abort landing between schedule and update), aborts,
stop-string finishes from outside, prefix-cache resets and disk files lost behind the engine's back. Few blocks make
the scheduler preempt by itself (there is no public preemption API).
After every rule, ``kv_invariants.check_scheduler`` checks the whole state (ref counts = holders, free + used =
total, free queue sound, ...), and after every step that each block either prefix cache can hand out holds, in the
FakeWorker's cache, the tokens its hash names. At the end everything is aborted or run to completion (liveness:
within a bound), then every block must be free, the worker must hold nothing, and every request that finished by
itself must have produced exactly its scripted tokens up to its stop (no token lost or repeated across preemption).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from folio.core.kv_cache_manager import cdiv
from folio.core.scheduler import Scheduler
from folio.request import FinishReason, RequestStatus
from tests.core.kv_invariants import (
    check_block_pool,
    check_cached_blocks_hold_their_tokens,
    check_scheduler,
    check_scheduler_output,
    record_block_tokens,
)
from tests.helpers import EOS, FakeWorker, make_request, make_scheduler, make_worker

STOP_TOKEN = 3  # every request's stop_token_ids; scripts use 10.. otherwise
PREFIXES = [list(range(100 + 50 * k, 148 + 50 * k)) for k in range(3)]  # shared prompt heads
MAX_LIVE_REQUESTS = 10
MAX_DRAIN_STEPS = 3000


@dataclass
class Expected:
    """What a request must produce: its script up to the first stop condition (mirrors check_stop)."""

    script: list[int]
    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int
    stop_ids: set[int]
    emitted: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    ended_from_outside: bool = False

    def output(self, max_model_len: int) -> tuple[list[int], FinishReason]:
        for index, token_id in enumerate(self.script):
            num_output = index + 1
            if num_output >= self.min_tokens and token_id in self.stop_ids:
                return self.script[:num_output], FinishReason.STOP
            if num_output >= self.max_tokens or self.num_prompt_tokens + num_output >= max_model_len:
                return self.script[:num_output], FinishReason.LENGTH
        raise AssertionError("script shorter than max_tokens")


@dataclass(frozen=True)
class RequestSpec:
    """A user request before it is fitted to the configuration (lengths are capped by max_model_len)."""

    prefix: int  # which of PREFIXES the prompt starts with (equal heads -> prefix-cache hits)
    prefix_len: int
    suffix_len: int  # tokens unique to this request after the head
    max_tokens: int
    min_tokens: int
    stop: str  # which stop token (if any) the script samples at stop_at
    stop_at: int
    ignore_eos: bool
    script_seed: int  # equal seeds and prompts -> equal outputs (hits on generated blocks too)
    n: int
    priority: int
    prompt_logprobs: int | None  # set: the request skips the prefix cache


REQUEST_SPECS = st.builds(
    RequestSpec,
    prefix=st.integers(0, len(PREFIXES) - 1),
    prefix_len=st.integers(0, 40),
    suffix_len=st.integers(0, 12),
    max_tokens=st.integers(1, 40),
    min_tokens=st.integers(0, 4),
    stop=st.sampled_from(["none", "eos", "stop_token"]),
    stop_at=st.integers(0, 20),
    ignore_eos=st.booleans(),
    script_seed=st.integers(0, 2),
    n=st.sampled_from([1, 1, 2, 3]),
    priority=st.integers(0, 3),
    prompt_logprobs=st.sampled_from([None, None, None, 1]),
)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Scheduler | None = None
        self.worker: FakeWorker | None = None
        self.expected: dict[str, Expected] = {}
        self.num_added = 0
        self.end_by_abort = False
        self.num_steps = 0
        self.max_ref_count = 0
        self.tokens_of: dict[int, list[int]] = {}  # block hash -> the tokens of that block (kv_invariants)

    @property
    def sched(self) -> Scheduler:
        assert self.scheduler is not None
        return self.scheduler

    @initialize(
        block_size=st.integers(1, 8),
        max_model_len=st.integers(2, 40),
        extra_blocks=st.integers(0, 6),
        max_num_seqs=st.integers(1, 6),
        max_num_batched_tokens=st.integers(1, 48),
        long_prefill_token_threshold=st.sampled_from([0, 0, 1, 3, 8]),
        policy=st.sampled_from(["fcfs", "priority"]),
        enable_prefix_caching=st.booleans(),
        num_host_blocks=st.sampled_from([0, 0, 1, 3, 8]),
        num_disk_blocks=st.sampled_from([0, 1, 4, 16]),
        preemption_mode=st.sampled_from([None, None, "recompute"]),
        end_by_abort=st.booleans(),
        initial_requests=st.lists(REQUEST_SPECS, min_size=1, max_size=6),
    )
    def configure(
        self,
        block_size: int,
        max_model_len: int,
        extra_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int,
        policy: str,
        enable_prefix_caching: bool,
        num_host_blocks: int,
        num_disk_blocks: int,
        preemption_mode: str | None,
        end_by_abort: bool,
        initial_requests: list[RequestSpec],
    ) -> None:
        """The configuration, and a first burst of requests (so that no run is empty, whichever rules it uses)."""
        # EngineCore requires num_blocks * block_size >= max_model_len: one request alone always fits.
        self.scheduler = make_scheduler(
            num_blocks=cdiv(max_model_len, block_size) + extra_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            policy=policy,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_prefix_caching=enable_prefix_caching,
            num_host_blocks=num_host_blocks,
            preemption_mode=preemption_mode,
            num_disk_blocks=num_disk_blocks if num_host_blocks > 0 else 0,  # the disk tier needs a host tier
        )
        self.worker = make_worker(self.scheduler)
        self.end_by_abort = end_by_abort
        for spec in initial_requests:
            self.add_request(spec)

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.sched.requests) < MAX_LIVE_REQUESTS)
    @rule(spec=REQUEST_SPECS)
    def add_request(self, spec: RequestSpec) -> None:
        """One user request as the InputProcessor makes it: prompt < max_model_len, max_tokens within the room,
        n > 1 fanned out into siblings that fork from the first."""
        max_model_len = self.sched.max_model_len
        prefix_len = min(spec.prefix_len, max_model_len - 1)
        suffix_len = max(min(spec.suffix_len, max_model_len - 1 - prefix_len), 1 if prefix_len == 0 else 0)
        prompt = PREFIXES[spec.prefix][:prefix_len] + [1000 + 16 * self.num_added + i for i in range(suffix_len)]
        max_tokens = min(spec.max_tokens, max_model_len - len(prompt))
        min_tokens = min(spec.min_tokens, max_tokens)
        parent_id = f"r{self.num_added}"
        self.num_added += 1
        assert self.worker is not None
        for index in range(spec.n):
            req_id = parent_id if index == 0 else f"{index}_{parent_id}"
            script = [10 + (13 * (spec.script_seed + index) + 5 * i) % 37 for i in range(max_tokens)]
            if spec.stop != "none" and spec.stop_at < max_tokens:
                script[spec.stop_at] = EOS if spec.stop == "eos" else STOP_TOKEN
            stop_ids = {STOP_TOKEN} | ({EOS} if not spec.ignore_eos else set())
            self.expected[req_id] = Expected(script, len(prompt), max_tokens, min_tokens, stop_ids)
            self.worker.script[req_id] = script
            request = make_request(
                req_id,
                prompt,
                max_tokens,
                priority=spec.priority,
                arrival_time=float(self.num_added),
                fork_of=parent_id if index > 0 else None,
                eos=True,
                min_tokens=min_tokens,
                stop_token_ids=[STOP_TOKEN],
                ignore_eos=spec.ignore_eos,
                prompt_logprobs=spec.prompt_logprobs,
            )
            self.sched.add_request(request)

    @rule(num_steps=st.integers(1, 12), abort_mid_step=st.none() | st.integers(0, 20))
    def step(self, num_steps: int, abort_mid_step: int | None) -> None:
        """Engine steps: schedule -> (maybe an abort arrives) -> FakeWorker -> update_from_output, checked after
        schedule and after update. Several per rule, so that runs get far enough to preempt and hit the cache."""
        for index in range(num_steps):
            self._step(abort_mid_step if index == 0 else None)
            check_scheduler(self.sched)

    @rule(index=st.integers(0, 20))
    def abort(self, index: int) -> None:
        if self.sched.requests:
            self._end_from_outside(index, RequestStatus.FINISHED_ABORTED)

    @rule(index=st.integers(0, 20))
    def stop_string_found(self, index: int) -> None:
        """The output processor found a stop string in some output: it finishes the request from outside."""
        candidates = sorted(req_id for req_id, r in self.sched.requests.items() if r.output_token_ids)
        if candidates:
            self._end_from_outside(index, RequestStatus.FINISHED_STOPPED, candidates)

    @rule(index=st.integers(0, 50))
    def abort_unknown_or_finished(self, index: int) -> None:
        """Aborting an id the core no longer (or never) knew changes nothing."""
        gone = sorted(set(self.expected) - set(self.sched.requests)) + ["never-added"]
        before = [block.ref_count for block in self.sched.kv_cache_manager.block_pool.blocks]
        num_free = self.sched.kv_cache_manager.get_num_free_blocks()
        self.sched.abort_requests(gone[index % len(gone)])
        assert [block.ref_count for block in self.sched.kv_cache_manager.block_pool.blocks] == before
        assert self.sched.kv_cache_manager.get_num_free_blocks() == num_free

    @rule(index=st.integers(0, 50))
    def lose_disk_file(self, index: int) -> None:
        """A file of the disk tier disappears: its next load fails, and the request recomputes those tokens."""
        assert self.worker is not None
        if self.worker.disk:
            del self.worker.disk[sorted(self.worker.disk)[index % len(self.worker.disk)]]

    @rule()
    def reset_prefix_cache(self) -> None:
        manager = self.sched.kv_cache_manager
        all_free = manager.num_used_blocks == 0 and (manager.host_tier is None or manager.host_tier.usage == 0)
        assert manager.reset_prefix_cache() == all_free
        if all_free:
            assert not manager.block_pool.cached_block_hash_to_block
            assert all(block.block_hash is None for block in manager.block_pool.blocks)

    # ------------------------------------------------------------------ checks

    @invariant()
    def state_is_consistent(self) -> None:
        if self.scheduler is None:
            return
        check_scheduler(self.scheduler)
        for req_id, request in self.scheduler.requests.items():
            assert self.expected[req_id].emitted == request.output_token_ids, req_id

    def teardown(self) -> None:
        """End every request (abort them all, or run them to completion), then nothing may be left anywhere."""
        if self.scheduler is None or sys.exc_info()[0] is not None:
            return  # a rule failed (hypothesis tears down in a ``finally``): let that failure be the report
        scheduler = self.scheduler
        if self.end_by_abort:
            for req_id in sorted(scheduler.requests):
                self._end_from_outside(0, RequestStatus.FINISHED_ABORTED, [req_id])
        for _ in range(MAX_DRAIN_STEPS):
            if not scheduler.has_unfinished_requests():
                break
            self._step(None)
            check_scheduler(scheduler)
        else:
            raise AssertionError(f"not finished after {MAX_DRAIN_STEPS} steps: {sorted(scheduler.requests)}")
        assert not scheduler.running and len(scheduler.waiting) == 0 and scheduler.num_waiting == 0
        scheduler.kv_cache_manager.assert_no_leaks()  # every block free (cached ones too), every ref_count 0
        check_block_pool(scheduler.kv_cache_manager.block_pool)
        assert self.worker is not None
        last = scheduler.schedule()  # tells the worker which requests ended since the last step
        assert last.total_num_scheduled_tokens == 0
        self.worker.execute(last)
        assert not self.worker.requests, f"the worker still holds {sorted(self.worker.requests)}"
        if currently_in_test_context():  # not when a found case replays as a plain test
            self._record_coverage()
        max_model_len = scheduler.max_model_len
        for req_id, expected in self.expected.items():
            tokens, reason = expected.output(max_model_len)
            if expected.ended_from_outside:
                assert expected.emitted == tokens[: len(expected.emitted)], req_id
            else:
                assert (expected.emitted, expected.finish_reason) == (tokens, reason), req_id

    # ------------------------------------------------------------------ helpers

    def _step(self, abort_mid_step: int | None) -> None:
        scheduler, worker = self.sched, self.worker
        assert worker is not None
        had_requests = scheduler.has_unfinished_requests()
        record_block_tokens(scheduler, self.tokens_of)
        output = scheduler.schedule()
        self.num_steps += 1
        blocks = scheduler.kv_cache_manager.block_pool.blocks
        self.max_ref_count = max(self.max_ref_count, *(block.ref_count for block in blocks))
        check_scheduler_output(scheduler, output)
        assert output.total_num_scheduled_tokens > 0 or not had_requests, "a step with work scheduled nothing"
        check_scheduler(scheduler)
        if abort_mid_step is not None and scheduler.requests:
            self._end_from_outside(abort_mid_step, RequestStatus.FINISHED_ABORTED)
        for core_output in scheduler.update_from_output(output, worker.execute(output)):
            expected = self.expected[core_output.request_id]
            assert expected.finish_reason is None and not expected.ended_from_outside, core_output.request_id
            expected.emitted.extend(core_output.new_token_ids)
            if core_output.finished:
                expected.finish_reason = core_output.finish_reason
                assert core_output.request_id not in scheduler.requests
        check_cached_blocks_hold_their_tokens(scheduler, worker, self.tokens_of)
        for request in scheduler.running:  # the worker's copy, kept from diffs only, matches the core's
            state = worker.requests.get(request.request_id)
            if state is not None:
                assert state.block_ids == scheduler.kv_cache_manager.get_block_ids(request.request_id)
                assert state.num_computed_tokens == request.num_computed_tokens

    def _record_coverage(self) -> None:
        """Events for ``--hypothesis-show-statistics``: how many runs reach the paths that matter."""
        manager = self.sched.kv_cache_manager
        low = self.num_steps // 20 * 20
        event(f"steps: {'100+' if low >= 100 else f'{low}-{low + 19}'}")
        num_preemptions = self.sched.num_preemptions_total
        event(f"preemptions: {num_preemptions if num_preemptions < 3 else '3+'}")
        event(f"copy-on-write copies: {manager.num_cow_copies > 0}")
        event(f"prefix-cache hits: {manager.prefix_cache_hits > 0}")
        event(f"swapped preemptions: {self.sched.preemption.num_swapped_preemptions_total > 0}")
        host = manager.host_tier
        event(f"host tier loads: {host is not None and host.num_blocks_to_device_total > 0}")
        disk = manager.disk_tier
        event(f"disk tier loads: {disk is not None and disk.num_blocks_from_disk_total > 0}")
        event(f"disk tier failed loads: {disk is not None and disk.num_failed_loads_total > 0}")
        event(f"max ref_count: {self.max_ref_count if self.max_ref_count < 3 else '3+'}")
        for reason in sorted({str(expected.finish_reason) for expected in self.expected.values()}):
            event(f"finish reason seen: {reason}")

    def _end_from_outside(self, index: int, status: RequestStatus, candidates: list[str] | None = None) -> None:
        candidates = sorted(self.sched.requests) if candidates is None else candidates
        req_id = candidates[index % len(candidates)]
        self.sched.finish_requests(req_id, status)
        self.expected[req_id].ended_from_outside = True
        assert req_id not in self.sched.requests


TestSchedulerProperties = SchedulerMachine.TestCase
TestSchedulerProperties.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI is deterministic
    database=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)

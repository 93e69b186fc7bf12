"""The engine core's batch queue (pipeline parallelism: up to pp steps in flight) on the real scheduler and the
FakeWorker (tests/helpers.py), which reads every request's context back from its fake KV cache before it
"samples". The FakeWorker runs a batch when it is submitted, as the stages do (each takes its batches in order), and
its output reaches the scheduler only when collected. Asserted: the same tokens as one step at a time, even through
preemptions of requests whose batch is still in flight; no request is scheduled while a batch that samples for it
is in flight; the requests spread over the batches; no KV block leaks. Plus the stage split's arithmetic, the
tokens the stages before the last receive, and the start-up checks of pipeline_parallel_size."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest

from folio.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from folio.core.scheduler import Scheduler
from folio.engine.batch_queue import BatchQueue, attach_scheduled_token_ids
from folio.parallel.stages import check_pipeline_parallel, output_rank, stage_layer_range
from folio.worker.request_state import RequestStates
from tests.helpers import FakeWorker, make_request, make_scheduler, make_worker, run_to_completion

_PROMPT_LENS = [5, 23, 9, 14, 31, 6, 17, 11]


class _NoGrammars:
    def fill_bitmask(self, requests: Any, output: SchedulerOutput) -> None:
        """No constrained requests in these tests."""


@dataclass
class _PipelinedExecutor:
    """submit runs the batch on the FakeWorker at once (in submission order, as every stage does); collect hands
    the oldest output over. Records what was in flight at each submission."""

    worker: FakeWorker
    outputs: deque[ModelRunnerOutput] = field(default_factory=deque)
    batch_sizes: list[int] = field(default_factory=list)
    peak_in_flight: int = 0

    def submit(self, output: SchedulerOutput) -> None:
        sampling_in_flight = {
            r for out in self.outputs for r, t in zip(out.req_ids, out.sampled_token_ids, strict=True) if t
        }
        # only a request preempted since (sent again in full, its in-flight token dropped as stale) may come back
        resumed = {new.req_id for new in output.scheduled_new_reqs}
        assert not (sampling_in_flight & set(output.num_scheduled_tokens)) - resumed, "a request in two batches"
        self.outputs.append(self.worker.execute(output))
        self.batch_sizes.append(len(output.num_scheduled_tokens))
        self.peak_in_flight = max(self.peak_in_flight, len(self.outputs))

    def collect(self) -> ModelRunnerOutput:
        return self.outputs.popleft()


@dataclass
class _Core:
    """What BatchQueue.step reads of the EngineCore."""

    scheduler: Scheduler
    executor: _PipelinedExecutor
    structured_output_manager: _NoGrammars = field(default_factory=_NoGrammars)

    def finish_step(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        return self.scheduler.update_from_output(output, runner_output)


def _add_requests(scheduler: Scheduler) -> None:
    for i, prompt_len in enumerate(_PROMPT_LENS):
        scheduler.add_request(make_request(f"r{i}", prompt_len, max_tokens=12))


def _run_pipelined(scheduler: Scheduler, max_batches: int) -> tuple[dict[str, list[int]], _PipelinedExecutor]:
    core = _Core(scheduler, _PipelinedExecutor(make_worker(scheduler)))
    queue = BatchQueue(max_batches)
    tokens: dict[str, list[int]] = {}
    for _ in range(2000):
        if not scheduler.has_unfinished_requests() and not len(queue):
            break
        for out in queue.step(core):  # type: ignore[arg-type]
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    else:
        raise AssertionError("not finished")
    scheduler.kv_cache_manager.assert_no_leaks()
    return tokens, core.executor


def _one_step_at_a_time_tokens() -> Any:
    """The reference: the same 8 requests run one step at a time, with room for all of them."""
    reference = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_model_len=64)
    _add_requests(reference)
    return run_to_completion(reference, make_worker(reference)).outputs


@pytest.mark.parametrize("max_batches", [2, 3])
def test_batches_in_flight_give_the_tokens_of_one_step_at_a_time(max_batches: int) -> None:
    expected = _one_step_at_a_time_tokens()
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=32, max_model_len=64)
    _add_requests(scheduler)
    tokens, executor = _run_pipelined(scheduler, max_batches)
    assert tokens == expected
    assert executor.peak_in_flight == max_batches
    # 8 requests over max_batches batches: at most ceil(8 / max_batches) each while all 8 run
    assert max(executor.batch_sizes) == -(-8 // max_batches)


@pytest.mark.parametrize("max_batches", [2, 3, 4])
def test_preempting_requests_whose_batch_is_in_flight_changes_no_token(max_batches: int) -> None:
    """12 blocks of 4 tokens for 8 requests of up to 43 tokens: preemptions (recompute) hit requests that sit in a
    batch still in flight; with 3 or 4 batches in flight such a request is admitted again before that batch's
    output is read: the output's token for it is stale (dropped), it resumes from the scheduler's own copy."""
    expected = _one_step_at_a_time_tokens()
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=32, max_model_len=64)
    _add_requests(scheduler)
    tokens, _ = _run_pipelined(scheduler, max_batches)
    assert scheduler.num_preemptions_total > 0
    assert tokens == expected


def test_stages_that_do_not_sample_get_the_tokens_at_the_step_positions() -> None:
    """The engine core attaches each cached request's tokens at this step's positions; a stage that lacks the
    last sampled output appends it, one that has it (the last stage) appends nothing, a prompt chunk nothing."""
    scheduler = make_scheduler(num_blocks=16, max_num_batched_tokens=6)
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 8))
    worker = make_worker(scheduler)
    sampling_stage, other_stage = RequestStates(), RequestStates()
    for step in range(3):
        output = scheduler.schedule()
        attach_scheduled_token_ids(output, scheduler.requests)
        for states in (sampling_stage, other_stage):
            states.remove(output.finished_req_ids | output.preempted_req_ids)
            states.add_new(output.scheduled_new_reqs)
            states.apply_diffs(output.scheduled_cached_reqs)
        runner_output = worker.execute(output)
        for req_id, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
            sampling_stage[req_id].output_token_ids.extend(sampled)  # the last stage samples
        scheduler.update_from_output(output, runner_output)
        if step == 1:  # a decodes (its sampled token), b's second prompt chunk
            cached = output.scheduled_cached_reqs
            assert cached.req_ids == ["a", "b"]
            assert cached.new_token_ids == [scheduler.requests["a"].output_token_ids[:1], []]
    for req_id in ("a", "b"):
        # after the third step both stages hold every output but the one sampled in it
        assert sampling_stage[req_id].output_token_ids[:-1] == other_stage[req_id].output_token_ids
        assert other_stage[req_id].output_token_ids == scheduler.requests[req_id].output_token_ids[:-1]


@pytest.mark.parametrize(
    ("num_layers", "pp", "ranges"),
    [
        (30, 2, [(0, 15), (15, 30)]),
        (30, 4, [(0, 7), (7, 15), (15, 23), (23, 30)]),  # vLLM's split: the spare layers before the last stage
        (3, 2, [(0, 2), (2, 3)]),
        (2, 2, [(0, 1), (1, 2)]),
        (30, 1, [(0, 30)]),
    ],
)
def test_stage_layer_ranges(num_layers: int, pp: int, ranges: list[tuple[int, int]]) -> None:
    assert [stage_layer_range(num_layers, r, pp) for r in range(pp)] == ranges


@pytest.mark.parametrize(
    ("pp", "message"),
    [
        (31, r"pipeline_parallel_size \(--pipeline-parallel-size\) 31 exceeds the model's number of layers 30"),
        (0, r"pipeline_parallel_size \(--pipeline-parallel-size\) must be >= 1, got 0"),
        (-2, r"pipeline_parallel_size \(--pipeline-parallel-size\) must be >= 1, got -2"),
    ],
)
def test_check_pipeline_parallel(pp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_pipeline_parallel(30, pp)
    check_pipeline_parallel(30, 30)


def test_the_output_rank_is_the_last_stage_first_rank() -> None:
    assert [output_rank(1, 1), output_rank(1, 2), output_rank(1, 4), output_rank(2, 3)] == [0, 1, 3, 4]


@pytest.mark.parametrize("max_batches", [2, 3, 4])
def test_swapping_requests_whose_batch_is_in_flight_changes_no_token(max_batches: int) -> None:
    """As above with a host tier (swap preemption): a request swapped out while its batch is in flight has its
    next token pending there, and that token is dropped as stale; its position is computed again after the swap
    (num_computed_tokens one back), or the request would resume without that token."""
    expected = _one_step_at_a_time_tokens()
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=32, max_model_len=64, num_host_blocks=64)
    _add_requests(scheduler)
    tokens, _ = _run_pipelined(scheduler, max_batches)
    stats = scheduler.get_stats()
    assert 0 < stats.num_swapped_preemptions_total == stats.num_preemptions_total, stats
    assert scheduler.preemption.num_swaps_with_a_pending_token > 0
    assert tokens == expected

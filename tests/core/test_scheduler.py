"""Scheduler: the one accounting rule step by step (schedule -> fake output -> update_from_output), exactly.

Block size 4 throughout; prompts of ``make_request(id, n)`` are n distinct tokens 1000.. (so equal lengths share
prefixes: use explicit token lists where requests must not share).
"""

import pytest

from folio.core.sched_output import CachedRequestData, LogprobsLists, ModelRunnerOutput, SchedulerOutput
from folio.request import RequestStatus
from tests.helpers import make_request, make_scheduler, make_worker, run_to_completion, step


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def cached(so: SchedulerOutput) -> CachedRequestData:
    return so.scheduled_cached_reqs


def test_chunked_prefill_splits_by_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    worker = make_worker(scheduler)
    request = make_request("a", 20, max_tokens=2)
    scheduler.add_request(request)

    so, outputs = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"a": 8}
    (new,) = so.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens, new.output_token_ids) == ([0, 1], 0, [])
    assert request.num_computed_tokens == 8
    assert outputs == []  # partial prefill: nothing sampled, nothing to report

    so, outputs = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"a": 8}
    assert (cached(so).req_ids, cached(so).new_block_ids, cached(so).num_computed_tokens) == (["a"], [[2, 3]], [8])
    assert request.num_computed_tokens == 16
    assert outputs == []

    so, outputs = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"a": 4}
    assert (cached(so).new_block_ids, cached(so).num_computed_tokens) == ([[4]], [16])
    assert request.num_computed_tokens == 20
    assert [out.new_token_ids for out in outputs] == [request.output_token_ids]
    assert request.num_tokens == 21

    so, outputs = step(scheduler, worker)  # decode: position 20 starts block 5
    assert so.num_scheduled_tokens == {"a": 1}
    assert (cached(so).new_block_ids, cached(so).num_computed_tokens) == ([[5]], [20])
    assert outputs[0].finished and request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    scheduler.kv_cache_manager.assert_no_leaks()
    assert scheduler.schedule().finished_req_ids == {"a"}


def test_long_prefill_threshold_caps_each_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=6)
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", tokens(0, 10), max_tokens=1))
    scheduler.add_request(make_request("b", tokens(100, 10), max_tokens=1))
    assert step(scheduler, worker)[0].num_scheduled_tokens == {"a": 6, "b": 6}
    assert step(scheduler, worker)[0].num_scheduled_tokens == {"a": 4, "b": 4}
    assert not scheduler.has_unfinished_requests()
    scheduler.kv_cache_manager.assert_no_leaks()


def test_running_first_then_waiting_in_fcfs_order_under_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", tokens(0, 4), max_tokens=3))
    step(scheduler, worker)
    for request_id, start in (("b", 100), ("c", 200), ("d", 300)):
        scheduler.add_request(make_request(request_id, tokens(start, 4), max_tokens=3))
    so, _ = step(scheduler, worker)
    # a decodes first (1), then b (4), c (4), and d gets the last token of the budget as a prefill chunk.
    assert so.num_scheduled_tokens == {"a": 1, "b": 4, "c": 4, "d": 1}
    assert [new.req_id for new in so.scheduled_new_reqs] == ["b", "c", "d"]
    assert cached(so).req_ids == ["a"]
    assert so.total_num_scheduled_tokens == 10
    run_to_completion(scheduler, worker)


def test_max_num_seqs_caps_admission() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    worker = make_worker(scheduler)
    for request_id, start, max_tokens in (("a", 0, 1), ("b", 100, 3), ("c", 200, 1)):
        scheduler.add_request(make_request(request_id, tokens(start, 4), max_tokens=max_tokens))
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"a": 4, "b": 4}
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)  # a finished after one token
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"b": 1, "c": 4}
    assert so.finished_req_ids == {"a"}
    run_to_completion(scheduler, worker)


def test_priority_policy_lower_value_first_then_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    worker = make_worker(scheduler)
    specs = (("late-low", 5, 1.0), ("high", 1, 2.0), ("mid-b", 3, 4.0), ("mid-a", 3, 3.0))
    for request_id, priority, arrival in specs:
        scheduler.add_request(make_request(request_id, 4, max_tokens=1, priority=priority, arrival_time=arrival))
    order = [next(iter(so.num_scheduled_tokens)) for so in run_to_completion(scheduler, worker).steps]
    assert order == ["high", "mid-a", "mid-b", "late-low"]


def test_fcfs_policy_arrival_order() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    worker = make_worker(scheduler)
    for request_id in ("x", "a", "m"):
        scheduler.add_request(make_request(request_id, 4, max_tokens=1, priority=-int(request_id == "m")))
    order = [next(iter(so.num_scheduled_tokens)) for so in run_to_completion(scheduler, worker).steps]
    assert order == ["x", "a", "m"]  # priority is ignored under fcfs


def test_waiting_request_that_cannot_get_blocks_blocks_the_queue() -> None:
    scheduler = make_scheduler(num_blocks=4)
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", tokens(0, 8), max_tokens=2))  # 2 blocks, then 3 for position 8
    scheduler.add_request(make_request("big", tokens(100, 12), max_tokens=1))  # 3 blocks: does not fit
    scheduler.add_request(make_request("small", tokens(200, 5), max_tokens=1))  # 2 blocks: fits, but is behind
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"a": 8}
    assert scheduler.num_waiting == 2
    result = run_to_completion(scheduler, worker)
    assert [list(so.num_scheduled_tokens) for so in result.steps] == [["a"], ["big"], ["small"]]


def test_preempt_last_running_and_resume_with_outputs() -> None:
    scheduler = make_scheduler(num_blocks=6)
    worker = make_worker(scheduler)
    a = make_request("a", tokens(0, 8), max_tokens=12)
    b = make_request("b", tokens(100, 8), max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(5):  # prefill, then positions 8..11: a holds blocks [0, 1, 4], b [2, 3, 5]
        so, _ = step(scheduler, worker)
    assert (scheduler.kv_cache_manager.get_block_ids("a"), scheduler.kv_cache_manager.get_block_ids("b")) == (
        [0, 1, 4],
        [2, 3, 5],
    )
    b_outputs = list(b.output_token_ids)
    assert len(b_outputs) == 5

    so, _ = step(scheduler, worker)  # a needs a 4th block: b (last in running) is preempted
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    assert cached(so).new_block_ids == [[5]]  # b's blocks were freed tail first: [5, 3, 2]
    assert (b.status, b.num_computed_tokens, b.num_preemptions, scheduler.num_preemptions_total) == (
        RequestStatus.PREEMPTED,
        0,
        1,
        1,
    )
    assert b.output_token_ids == b_outputs  # outputs are kept

    result = run_to_completion(scheduler, worker)
    resumed = [(i, new) for i, so in enumerate(result.steps) for new in so.scheduled_new_reqs]
    ((resume_step, new),) = resumed
    # b's block 2 (its first block, freed last) survived as a cached hit; 3 was reused by a, 5 by a.
    assert (new.req_id, new.output_token_ids, new.num_computed_tokens) == ("b", b_outputs, 4)
    assert new.block_ids == [2, 3, 5, 4]
    assert result.steps[resume_step].num_scheduled_tokens == {"b": 9}
    assert result.steps[resume_step].finished_req_ids == {"a"}

    reference = make_scheduler(num_blocks=64)
    for request_id, start in (("a", 0), ("b", 100)):
        reference.add_request(make_request(request_id, tokens(start, 8), max_tokens=12))
    expected = run_to_completion(reference, make_worker(reference)).outputs
    assert a.output_token_ids == expected["a"]
    assert b.output_token_ids == expected["b"]
    assert b_outputs + result.outputs["b"] == expected["b"]


def test_priority_preemption_can_take_back_a_request_scheduled_this_step() -> None:
    scheduler = make_scheduler(num_blocks=4, policy="priority")
    worker = make_worker(scheduler)
    x = make_request("x", tokens(0, 4), max_tokens=8, priority=5, arrival_time=1.0)
    y = make_request("y", tokens(100, 7), max_tokens=8, priority=0, arrival_time=2.0)
    scheduler.add_request(x)
    step(scheduler, worker)  # x: block 0
    scheduler.add_request(y)
    step(scheduler, worker)  # x: block 1 for position 4; y: blocks 2, 3
    step(scheduler, worker)
    so, _ = step(scheduler, worker)  # x (scheduled first) decodes; y's position 8 needs a block: x is the victim
    assert so.preempted_req_ids == {"x"}
    assert so.num_scheduled_tokens == {"y": 1}
    assert so.total_num_scheduled_tokens == 1
    assert (cached(so).req_ids, cached(so).new_block_ids) == (["y"], [[1]])  # x's blocks freed as [1, 0]
    assert x.num_computed_tokens == 0 and x.status == RequestStatus.PREEMPTED
    result = run_to_completion(scheduler, worker)
    assert len(x.output_token_ids) == len(y.output_token_ids) == 8
    assert result.finish_reasons == {"y": y.get_finish_reason(), "x": x.get_finish_reason()}


def test_prefix_hit_across_requests_and_revived_free_blocks() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    first = make_request("first", tokens(0, 10), max_tokens=1)
    scheduler.add_request(first)
    run_to_completion(scheduler, worker)  # blocks 0, 1 cached; free queue [3, ..., 15, 2, 1, 0]
    second = make_request("second", tokens(0, 9) + [77], max_tokens=1)
    scheduler.add_request(second)
    so, outputs = step(scheduler, worker)
    (new,) = so.scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids) == (8, [0, 1, 3])  # 3: the free-queue head
    assert so.num_scheduled_tokens == {"second": 2}
    assert second.num_cached_tokens == 8
    assert outputs[0].num_cached_tokens == 8
    stats = scheduler.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    scheduler.kv_cache_manager.assert_no_leaks()


def test_requests_admitted_in_one_step_hit_the_prefix_the_first_one_computes() -> None:
    """A burst sharing a prompt head computes it once: the blocks the first request's step completes are cached when
    it is admitted, so the next ones in the same step hit them (the FakeWorker writes the whole step's K/V before
    anyone attends, as every backend does, and reads each context back)."""
    scheduler = make_scheduler(num_blocks=16)
    worker = make_worker(scheduler)
    head = tokens(0, 8)
    for request_id, start in (("a", 100), ("b", 200), ("c", 300)):
        scheduler.add_request(make_request(request_id, head + tokens(start, 3), max_tokens=4))
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"a": 11, "b": 3, "c": 3}
    assert [(new.req_id, new.num_computed_tokens, new.block_ids) for new in so.scheduled_new_reqs] == [
        ("a", 0, [0, 1, 2]),
        ("b", 8, [0, 1, 3]),
        ("c", 8, [0, 1, 4]),
    ]
    stats = scheduler.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (33, 16)
    outputs = run_to_completion(scheduler, worker).outputs

    separate = make_scheduler(num_blocks=16, enable_prefix_caching=False)
    for request_id, start in (("a", 100), ("b", 200), ("c", 300)):
        separate.add_request(make_request(request_id, head + tokens(start, 3), max_tokens=4))
    expected = run_to_completion(separate, make_worker(separate)).outputs
    assert {rid: out[1:] for rid, out in expected.items()} == outputs  # first tokens came in step 1


def test_blocks_of_a_request_taken_back_from_its_step_are_not_cached() -> None:
    """x (priority 5) is scheduled first for a chunk completing its blocks 4 and 5; y (priority 0) then needs a
    block, none is free, and x is taken back out of the step. Nothing writes x's positions 16-23, so neither block
    may be cached: y takes block 5's slot (x's last, freed first), but block 4 would stay findable."""
    scheduler = make_scheduler(num_blocks=7, policy="priority", long_prefill_token_threshold=8)
    worker = make_worker(scheduler)
    x = make_request("x", tokens(0, 24), max_tokens=4, priority=5, arrival_time=1.0)
    y = make_request("y", tokens(100, 4), max_tokens=4, priority=0, arrival_time=2.0)
    scheduler.add_request(x)
    step(scheduler, worker)  # x: positions 0-7
    scheduler.add_request(y)
    step(scheduler, worker)  # x: 8-15; y: its prompt, then a first token at position 4 (a new block next step)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 2
    so = scheduler.schedule()
    assert so.preempted_req_ids == {"x"} and so.num_scheduled_tokens == {"y": 1}
    cached_hashes = set(pool.cached_block_hash_to_block)
    assert set(x.block_hashes[:4]) <= cached_hashes  # computed in steps 1 and 2
    assert not set(x.block_hashes[4:]) & cached_hashes
    scheduler.update_from_output(so, worker.execute(so))
    result = run_to_completion(scheduler, worker)
    assert len(x.output_token_ids) == len(y.output_token_ids) == 4
    assert set(result.finish_reasons) == {"x", "y"}
    scheduler.kv_cache_manager.assert_no_leaks()


def test_shared_prefix_while_both_running_has_ref_count_two() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", tokens(0, 8) + [50], max_tokens=4))
    step(scheduler, worker)
    scheduler.add_request(make_request("b", tokens(0, 8) + [60], max_tokens=4))
    so, _ = step(scheduler, worker)
    assert so.scheduled_new_reqs[0].block_ids == [0, 1, 3]
    assert [block.ref_count for block in scheduler.kv_cache_manager.block_pool.blocks[:4]] == [2, 2, 1, 1]
    # a: 9 prompt + 1 decode computed; b: 8 cached + 1 computed -> 19 live tokens in 4 blocks of 4 slots
    stats = scheduler.get_stats()
    assert (stats.num_kv_live_tokens, stats.num_kv_held_slots) == (19, 16)
    run_to_completion(scheduler, worker)
    stats = scheduler.get_stats()
    assert (stats.num_kv_live_tokens, stats.num_kv_held_slots) == (0, 0)


@pytest.mark.parametrize(
    ("kwargs", "script", "expected_outputs", "status", "stop_reason"),
    [
        ({"eos": True}, [5, 2, 7], [5, 2], RequestStatus.FINISHED_STOPPED, None),
        ({"eos": True, "min_tokens": 3}, [2, 2, 5, 2, 9], [2, 2, 5, 2], RequestStatus.FINISHED_STOPPED, None),
        ({"stop_token_ids": [7]}, [5, 7, 8], [5, 7], RequestStatus.FINISHED_STOPPED, 7),
        ({"eos": True, "ignore_eos": True}, [2, 2, 2, 2], [2, 2, 2, 2], RequestStatus.FINISHED_LENGTH_CAPPED, None),
        ({"eos": True, "ignore_eos": True, "stop_token_ids": [7]}, [2, 7], [2, 7], RequestStatus.FINISHED_STOPPED, 7),
        ({}, [5, 6, 7, 8, 9], [5, 6, 7, 8], RequestStatus.FINISHED_LENGTH_CAPPED, None),
        ({"eos": True}, [5, 6, 7, 2], [5, 6, 7, 2], RequestStatus.FINISHED_STOPPED, None),  # stop beats length
    ],
)
def test_token_level_stops(
    kwargs: dict[str, object],
    script: list[int],
    expected_outputs: list[int],
    status: RequestStatus,
    stop_reason: int | None,
) -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler, script={"r": script})
    request = make_request("r", 4, max_tokens=4, **kwargs)  # type: ignore[arg-type]
    scheduler.add_request(request)
    result = run_to_completion(scheduler, worker)
    assert result.outputs["r"] == request.output_token_ids == expected_outputs
    assert request.status == status
    assert result.finish_reasons["r"] == request.get_finish_reason()
    assert result.stop_reasons["r"] == stop_reason


def test_max_model_len_caps_scheduled_and_generated_tokens() -> None:
    scheduler = make_scheduler(max_model_len=10)
    worker = make_worker(scheduler)
    request = make_request("r", 8, max_tokens=16)
    scheduler.add_request(request)
    result = run_to_completion(scheduler, worker)
    assert [so.num_scheduled_tokens["r"] for so in result.steps] == [8, 1]  # positions 0..8 < 10
    assert len(result.outputs["r"]) == 2
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    full = make_request("full", 10, max_tokens=16)
    scheduler.add_request(full)
    assert len(run_to_completion(scheduler, worker).outputs["full"]) == 1
    with pytest.raises(ValueError, match="prompt has 11 tokens"):
        scheduler.add_request(make_request("long", 11))


def test_abort_waiting_and_running_requests() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    worker = make_worker(scheduler)
    running = make_request("running", tokens(0, 6), max_tokens=8)
    waiting = make_request("waiting", tokens(100, 6), max_tokens=8)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler, worker)
    assert scheduler.kv_cache_manager.get_block_ids("running") == [0, 1]
    scheduler.abort_requests(["waiting", "running", "unknown"])
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert running.get_finish_reason() is not None and str(running.get_finish_reason()) == "abort"
    assert not scheduler.has_unfinished_requests()
    scheduler.kv_cache_manager.assert_no_leaks()
    so = scheduler.schedule()
    assert so.finished_req_ids == {"running", "waiting"}
    assert so.num_scheduled_tokens == {}
    assert scheduler.schedule().finished_req_ids == set()  # reported once


def test_abort_between_schedule_and_update_drops_the_result() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("r", 4))
    so = scheduler.schedule()
    runner_output = worker.execute(so)
    scheduler.abort_requests("r")
    assert scheduler.update_from_output(so, runner_output) == []
    scheduler.kv_cache_manager.assert_no_leaks()


def test_finish_requests_rejects_unfinished_status_and_duplicates_rejected() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4))
    with pytest.raises(ValueError):
        scheduler.finish_requests("r", RequestStatus.RUNNING)
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("r", 4))
    scheduler.finish_requests("r", RequestStatus.FINISHED_STOPPED)  # e.g. a stop string
    assert scheduler.get_num_unfinished_requests() == 0


def test_stats_for_metrics() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", tokens(0, 8), max_tokens=2))
    scheduler.add_request(make_request("b", tokens(100, 4), max_tokens=2))
    step(scheduler, worker)
    stats = scheduler.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions_total) == (1, 1, 0)
    assert stats.kv_cache_usage == pytest.approx(2 / 8)  # a holds 2 blocks for its 8 prompt tokens
    run_to_completion(scheduler, worker)
    assert scheduler.kv_cache_usage == 0.0


@pytest.mark.parametrize(("policy", "expected_waiting"), [("fcfs", ["b", "c"]), ("priority", ["c", "b"])])
def test_preempted_request_returns_to_front_or_priority_order(policy: str, expected_waiting: list[str]) -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=2, policy=policy)
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("a", tokens(0, 4), max_tokens=8, priority=1, arrival_time=1.0))
    scheduler.add_request(make_request("b", tokens(100, 4), max_tokens=8, priority=1, arrival_time=2.0))
    step(scheduler, worker)
    scheduler.add_request(make_request("c", tokens(200, 4), max_tokens=8, priority=0, arrival_time=3.0))
    for _ in range(5):  # positions 4..8: a's position 8 finds no free block
        so, _ = step(scheduler, worker)
    assert so.preempted_req_ids == {"b"}
    assert [request.request_id for request in scheduler.waiting] == expected_waiting
    run_to_completion(scheduler, worker)


def test_prompt_logprobs_delivered_before_a_preemption_are_not_delivered_again() -> None:
    """The worker scores every prompt position it computes; after a preemption mid-prefill the recompute from
    position 0 scores positions 0..3 again, and update_from_output must deliver each position exactly once.

    2 blocks of 4 tokens, 4 tokens a step: step 1 a[0:3] + b[0:1], step 2 a[3] + b[1:4] (b delivered positions
    0..3), step 3 a's position 4 needs a second block: b is preempted. a runs to its end (positions 0..7 fill both
    blocks), then b from position 0 again: [0:4) (all 4 rows already delivered), [4:8) (positions 4..6 and b's
    token).
    """
    scheduler = make_scheduler(num_blocks=2, max_num_batched_tokens=4)
    a = make_request("a", tokens(0, 3), max_tokens=6)
    b = make_request("b", tokens(100, 8), max_tokens=1, prompt_logprobs=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    b_chunks: list[tuple[int, int]] = []
    delivered: list[int] = []  # the prompt positions of b's delivered rows, in order
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        prompt_rows: dict[str, LogprobsLists] = {}
        for req_id, num_new in so.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            start, end = request.num_computed_tokens - num_new, request.num_computed_tokens
            req_ids.append(req_id)
            sampled.append([7] if end >= request.num_tokens else [])
            # As the worker does: position p scores prompt token p + 1; the logprob encodes the position.
            positions = range(start, min(end, request.num_prompt_tokens - 1))
            if req_id == "b":
                b_chunks.append((start, end))
                if not request.output_token_ids and positions:
                    ids = [[request.prompt_token_ids[p + 1], 5] for p in positions]
                    values = [[-float(p), -9.0] for p in positions]
                    prompt_rows[req_id] = LogprobsLists(ids, values, [1] * len(positions))
        runner_output = ModelRunnerOutput(req_ids, sampled, [None] * len(req_ids), prompt_rows)
        outputs = scheduler.update_from_output(so, runner_output)
        for out in outputs:
            if out.new_prompt_logprobs is not None:
                assert out.request_id == "b"
                delivered += [int(-row[0]) for row in out.new_prompt_logprobs.logprobs]
                assert [row[0] for row in out.new_prompt_logprobs.token_ids] == [
                    b.prompt_token_ids[int(-row[0]) + 1] for row in out.new_prompt_logprobs.logprobs
                ]
    assert b_chunks == [(0, 1), (1, 4), (0, 4), (4, 8)]
    assert (b.num_preemptions, a.output_token_ids, b.output_token_ids) == (1, [7] * 6, [7])
    assert delivered == list(range(7))  # positions 0..6 score prompt tokens 1..7, each once
    assert b.num_prompt_logprobs_delivered == 7
    scheduler.kv_cache_manager.assert_no_leaks()


def test_logprobs_pass_through_and_prompt_logprobs_of_partial_prefill() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("r", tokens(0, 6), max_tokens=3, stop_token_ids=[7]))
    prompt_chunk = LogprobsLists([[1, 9]] * 4, [[-0.1, -2.0]] * 4, [1] * 4)
    so = scheduler.schedule()
    (out,) = scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[]], [None], {"r": prompt_chunk}))
    assert (out.new_token_ids, out.new_prompt_logprobs, out.finished) == ([], prompt_chunk, False)

    so = scheduler.schedule()
    sampled = LogprobsLists([[5, 6]], [[-0.5, -1.0]], [1])
    (out,) = scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[5]], [sampled]))
    assert (out.new_token_ids, out.new_logprobs, out.new_prompt_logprobs) == ([5], sampled, None)

    # Two tokens at once (as speculative decoding would give): the stop token ends it, the token after is dropped.
    so = scheduler.schedule()
    two = LogprobsLists([[7, 1], [8, 1]], [[-0.2, -3.0], [-0.3, -3.0]], [1, 1])
    (out,) = scheduler.update_from_output(so, ModelRunnerOutput(["r"], [[7, 8]], [two]))
    assert (out.new_token_ids, out.stop_reason, str(out.finish_reason)) == ([7], 7, "stop")
    assert out.new_logprobs == LogprobsLists([[7, 1]], [[-0.2, -3.0]], [1])
    scheduler.kv_cache_manager.assert_no_leaks()

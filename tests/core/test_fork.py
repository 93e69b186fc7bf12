"""n > 1 siblings: fork from the parent's prompt, copy-on-write through SchedulerOutput, and the fallbacks.

The FakeWorker reads every context back through the block table, so a missed or wrong copy fails the run.
"""

from folio.core.scheduler import Scheduler
from folio.request import Request, RequestStatus
from tests.helpers import make_request, make_scheduler, make_worker, run_to_completion, step

PROMPT = list(range(6))  # block size 4: block 0 full, block 1 holds positions 4, 5


def add_family(scheduler: Scheduler, prompt: list[int], n: int = 3, max_tokens: int = 4) -> list[Request]:
    parent = make_request("p", prompt, max_tokens=max_tokens)
    children = [make_request(f"p#{i}", prompt, max_tokens=max_tokens, fork_of="p") for i in range(1, n)]
    for request in (parent, *children):
        scheduler.add_request(request)
    return [parent, *children]


def ref_counts(scheduler: Scheduler, num: int) -> list[int]:
    return [block.ref_count for block in scheduler.kv_cache_manager.block_pool.blocks[:num]]


def reference_outputs(prompt: list[int], n: int = 3, max_tokens: int = 4) -> dict[str, list[int]]:
    """The same requests without forking: each computes its own prompt."""
    scheduler = make_scheduler(num_blocks=64, enable_prefix_caching=False)
    scheduler.add_request(make_request("p", prompt, max_tokens=max_tokens))
    for i in range(1, n):
        scheduler.add_request(make_request(f"p#{i}", prompt, max_tokens=max_tokens))
    return run_to_completion(scheduler, make_worker(scheduler)).outputs


def test_siblings_fork_after_parent_prompt_and_copy_on_write() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    parent, child1, child2 = add_family(scheduler, PROMPT)
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 3)

    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"p": 6}
    assert [new.req_id for new in so.scheduled_new_reqs] == ["p"]
    # Forked at the end of schedule(): share blocks 0 and 1, recompute position 5 next step.
    assert scheduler.kv_cache_manager.get_block_ids("p#1") == [0, 1]
    assert ref_counts(scheduler, 3) == [3, 3, 0]
    assert (child1.status, child1.num_computed_tokens, child1.num_cached_tokens) == (RequestStatus.RUNNING, 5, 5)
    assert (scheduler.num_running, scheduler.num_waiting) == (3, 0)

    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"p": 1, "p#1": 1, "p#2": 1}
    # p writes position 6 into shared block 1 -> copy to 2; p#1 writes position 5 -> copy to 3; p#2 is then the
    # last holder of block 1 and writes in place.
    assert so.block_copies == [(1, 2), (1, 3)]
    cached = so.scheduled_cached_reqs
    assert (cached.req_ids, cached.replaced_block_ids, cached.new_block_ids) == (["p"], [[(1, 2)]], [[]])
    assert cached.num_computed_tokens == [6]
    new1, new2 = so.scheduled_new_reqs
    assert (new1.req_id, new1.block_ids, new1.num_computed_tokens, new1.output_token_ids) == ("p#1", [0, 3], 5, [])
    assert (new2.req_id, new2.block_ids, new2.num_computed_tokens) == ("p#2", [0, 1], 5)
    assert ref_counts(scheduler, 4) == [3, 1, 1, 1]

    result = run_to_completion(scheduler, worker)
    outputs = {request.request_id: request.output_token_ids for request in (parent, child1, child2)}
    assert outputs == reference_outputs(PROMPT)
    assert all(not so.block_copies for so in result.steps)


def test_fork_of_block_aligned_prompt_copies_full_last_block() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    prompt = list(range(8))
    family = add_family(scheduler, prompt)
    step(scheduler, worker)
    so, _ = step(scheduler, worker)
    # p's position 8 starts a new block 2 (no copy); both children rewrite position 7 in full block 1 while p
    # still holds it: two copies.
    assert so.scheduled_cached_reqs.new_block_ids == [[2]]
    assert so.block_copies == [(1, 3), (1, 4)]
    assert [new.block_ids for new in so.scheduled_new_reqs] == [[0, 3], [0, 4]]
    assert ref_counts(scheduler, 5) == [3, 1, 1, 1, 1]
    run_to_completion(scheduler, worker)
    assert {request.request_id: request.output_token_ids for request in family} == reference_outputs(prompt)


def test_siblings_wait_for_final_prompt_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    worker = make_worker(scheduler)
    add_family(scheduler, PROMPT, n=2)
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"p": 4}
    assert scheduler.num_waiting == 1 and "p#1" not in scheduler.kv_cache_manager.req_to_blocks
    so, _ = step(scheduler, worker)
    assert so.num_scheduled_tokens == {"p": 2}
    assert scheduler.kv_cache_manager.get_block_ids("p#1") == [0, 1]
    run_to_completion(scheduler, worker)


def test_parent_aborted_before_prompt_siblings_schedule_normally() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    add_family(scheduler, PROMPT)
    scheduler.abort_requests("p")
    so, _ = step(scheduler, worker)
    # p#2 hits the full block p#1 computes in the same step (cached when p#1 was admitted).
    assert so.num_scheduled_tokens == {"p#1": 6, "p#2": 2}
    assert [(new.num_computed_tokens, new.block_ids) for new in so.scheduled_new_reqs] == [(0, [0, 1]), (4, [0, 2])]
    assert so.block_copies == []
    result = run_to_completion(scheduler, worker)
    expected = reference_outputs(PROMPT)
    assert result.outputs == {rid: expected[rid][1:] for rid in ("p#1", "p#2")}  # first tokens came in step 1


def test_abort_fork_waiting_sibling() -> None:
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    parent, child1, child2 = add_family(scheduler, PROMPT)
    scheduler.abort_requests("p#1")
    assert child1.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.num_waiting == 2
    so, _ = step(scheduler, worker)
    assert so.finished_req_ids == {"p#1"}
    assert scheduler.kv_cache_manager.get_block_ids("p#2") == [0, 1]
    assert ref_counts(scheduler, 2) == [2, 2]
    scheduler.abort_requests(["p#2"])  # abort a forked sibling before it ever reached the worker
    assert ref_counts(scheduler, 2) == [1, 1]
    result = run_to_completion(scheduler, worker)
    assert result.steps[0].finished_req_ids == {"p#2"}  # p#1 was reported by the first step
    assert parent.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_fork_respects_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    worker = make_worker(scheduler)
    add_family(scheduler, PROMPT)
    step(scheduler, worker)
    assert [request.request_id for request in scheduler.running] == ["p", "p#1"]
    assert [request.request_id for request in scheduler.waiting] == ["p#2"]  # queued normally, no fork
    result = run_to_completion(scheduler, worker)
    assert sorted(result.outputs) == ["p", "p#1", "p#2"]


def test_forked_sibling_preempted_recomputes_normally() -> None:
    scheduler = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    worker = make_worker(scheduler)
    parent, child = add_family(scheduler, PROMPT, n=2, max_tokens=6)
    step(scheduler, worker)  # p: blocks 0, 1; p#1 forks
    so, _ = step(scheduler, worker)  # copies: p -> block 2
    assert so.block_copies == [(1, 2)]
    assert scheduler.kv_cache_manager.get_block_ids("p#1") == [0, 1]
    for _ in range(3):
        so, _ = step(scheduler, worker)
    # Step 4: p's position 8 takes the last free block (3); step 5: p#1's position 8 needs one more, and p#1,
    # last in running, is preempted.
    assert so.preempted_req_ids == {"p#1"}
    assert child.num_preemptions == 1
    result = run_to_completion(scheduler, worker)
    (resume,) = [new for so in result.steps for new in so.scheduled_new_reqs]
    assert (resume.req_id, resume.num_computed_tokens, len(resume.output_token_ids)) == ("p#1", 0, 3)
    assert {"p": parent.output_token_ids, "p#1": child.output_token_ids} == reference_outputs(PROMPT, 2, 6)

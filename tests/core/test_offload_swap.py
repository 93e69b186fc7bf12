"""Swap preemption (core/preemption.py + core/offload.py): exact block ids in both pools and exact plans.

The scenario (block_size 4, 4 device blocks): A (7-token prompt, 3 tokens) and B (5-token prompt, 6 tokens) fill
the device pool; in step 3 A's 9th token needs a block and B, the last admitted, is preempted with 6 computed
tokens: one full block (device 2) and a partial one (device 3). The FakeWorker executes the plans on its own fake
host blocks and reads every context back, so B's resumed decode checks that the stored K/V came back.
"""

from __future__ import annotations

from folio.core.scheduler import Scheduler
from folio.request import RequestStatus
from tests.helpers import FakeWorker, make_request, make_scheduler, make_worker, run_to_completion, step

B_PROMPT = list(range(2000, 2005))


def _start(num_host_blocks: int, preemption_mode: str | None = None) -> tuple[Scheduler, FakeWorker]:
    scheduler = make_scheduler(
        num_blocks=4, block_size=4, max_model_len=16, num_host_blocks=num_host_blocks, preemption_mode=preemption_mode
    )
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("A", 7, max_tokens=3))
    scheduler.add_request(make_request("B", B_PROMPT, max_tokens=6))
    step(scheduler, worker)
    step(scheduler, worker)
    return scheduler, worker


def _host_ref_counts(scheduler: Scheduler) -> list[int]:
    host = scheduler.kv_cache_manager.host_tier
    assert host is not None
    return [block.ref_count for block in host.pool.blocks]


def _reference_outputs() -> dict[str, list[int]]:
    """The same requests with a device pool large enough for no preemption and no host tier."""
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_model_len=16)
    scheduler.add_request(make_request("A", 7, max_tokens=3))
    scheduler.add_request(make_request("B", B_PROMPT, max_tokens=6))
    result = run_to_completion(scheduler, make_worker(scheduler))
    assert all(not so.preempted_req_ids for so in result.steps)
    return result.outputs


def test_swap_out_and_in_with_exact_blocks_and_plans() -> None:
    scheduler, worker = _start(num_host_blocks=4)
    manager = scheduler.kv_cache_manager
    b = scheduler.requests["B"]
    so, _ = step(scheduler, worker)  # step 3
    assert so.preempted_req_ids == {"B"}
    assert so.num_scheduled_tokens == {"A": 1}
    assert so.kv_stores == [(2, 0), (3, 1)]  # B's full block and its partial last block
    assert so.kv_loads == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 6  # kept
    # A's 9th token goes into B's partial block 3 (stored first), and A finishes.
    assert (so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.new_block_ids) == (["A"], [[3]])
    assert manager.req_to_blocks == {}
    assert _host_ref_counts(scheduler) == [1, 1, 0, 0]
    stats = scheduler.get_stats()
    assert (stats.num_preemptions_total, stats.num_swapped_preemptions_total) == (1, 1)
    assert stats.kv_offload_cpu_usage == 0.5

    so, _ = step(scheduler, worker)  # step 4: A finished in step 3, B resumes
    (new,) = so.scheduled_new_reqs
    assert new.req_id == "B"
    assert (new.block_ids, new.num_computed_tokens) == ([2, 3], 6)
    assert new.output_token_ids == b.output_token_ids[:2]
    assert so.num_scheduled_tokens == {"B": 1}  # no prompt token recomputed
    assert so.kv_loads == [(0, 2), (1, 3)]
    assert so.kv_stores == []  # device 2 still cached B's block 0, whose hash the host tier holds
    assert _host_ref_counts(scheduler) == [0, 0, 0, 0]
    result = run_to_completion(scheduler, worker)
    assert b.output_token_ids == _reference_outputs()["B"]
    assert all(not so.preempted_req_ids for so in result.steps)
    stats = scheduler.get_stats()
    assert (stats.kv_offload_blocks_to_cpu_total, stats.kv_offload_blocks_to_device_total) == (3, 2)
    manager.assert_no_leaks()


def test_outputs_identical_under_swap_recompute_and_no_preemption() -> None:
    reference = _reference_outputs()
    for num_host_blocks, mode, num_swapped in ((4, None, 1), (4, "recompute", 0), (0, "swap", 0), (1, None, 0)):
        scheduler = make_scheduler(
            num_blocks=4, block_size=4, max_model_len=16, num_host_blocks=num_host_blocks, preemption_mode=mode
        )
        scheduler.add_request(make_request("A", 7, max_tokens=3))
        scheduler.add_request(make_request("B", B_PROMPT, max_tokens=6))
        result = run_to_completion(scheduler, make_worker(scheduler))
        assert result.outputs == reference, (num_host_blocks, mode)
        stats = scheduler.get_stats()
        assert (stats.num_preemptions_total, stats.num_swapped_preemptions_total) == (1, num_swapped)


def test_host_tier_too_small_falls_back_to_recompute() -> None:
    scheduler, worker = _start(num_host_blocks=1)  # B needs 2 host blocks
    b = scheduler.requests["B"]
    so, _ = step(scheduler, worker)
    assert so.preempted_req_ids == {"B"}
    assert (so.kv_stores, so.kv_loads) == ([], [])
    assert b.num_computed_tokens == 0
    assert _host_ref_counts(scheduler) == [0]
    so, _ = step(scheduler, worker)
    (new,) = so.scheduled_new_reqs
    # Recompute: B's full block is a device prefix hit (4 tokens), the rest of its 7 tokens is computed again.
    assert (new.block_ids, new.num_computed_tokens, so.num_scheduled_tokens) == ([2, 3], 4, {"B": 3})
    assert so.kv_loads == []
    run_to_completion(scheduler, worker)
    stats = scheduler.get_stats()
    assert (stats.num_preemptions_total, stats.num_swapped_preemptions_total) == (1, 0)


def test_recompute_mode_with_a_host_tier_does_not_swap() -> None:
    scheduler, worker = _start(num_host_blocks=4, preemption_mode="recompute")
    so, _ = step(scheduler, worker)
    assert so.preempted_req_ids == {"B"}
    assert so.kv_stores == [] and scheduler.requests["B"].num_computed_tokens == 0


def test_abort_of_a_swapped_request_frees_its_host_blocks() -> None:
    scheduler, worker = _start(num_host_blocks=4)
    step(scheduler, worker)
    assert _host_ref_counts(scheduler) == [1, 1, 0, 0]
    scheduler.abort_requests("B")
    host = scheduler.kv_cache_manager.host_tier
    assert host is not None and host.swapped == {}
    assert _host_ref_counts(scheduler) == [0, 0, 0, 0]
    # The full block stays findable by its hash (a prefix cache), the partial one is plain free.
    assert [block.block_hash is not None for block in host.pool.blocks] == [True, False, False, False]
    assert [block.block_id for block in host.pool.free_block_queue.get_all_free_blocks()] == [2, 3, 0, 1]
    so, _ = step(scheduler, worker)
    assert "B" in so.finished_req_ids
    run_to_completion(scheduler, worker)  # asserts no leak in either pool


def test_prompt_logprobs_and_forked_requests_are_recomputed() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, num_host_blocks=4)
    assert scheduler.preemption.can_swap(make_request("X", 5))
    assert not scheduler.preemption.can_swap(make_request("X", 5, prompt_logprobs=1))
    assert not scheduler.preemption.can_swap(make_request("X", 5, fork_of="A"))
    without_tier = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, preemption_mode="swap")
    assert not without_tier.preemption.can_swap(make_request("X", 5))

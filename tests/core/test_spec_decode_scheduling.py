"""Speculative decoding in the scheduler, exactly: drafts scheduled under the one accounting rule, KV slots for them,
num_computed_tokens rolled back on rejection before blocks are cached, drafts cut by max_tokens and the budget.

Block size 4; each step is schedule -> a hand-written ModelRunnerOutput -> update_from_output.
"""

from __future__ import annotations

from folio.core.sched_output import ModelRunnerOutput
from folio.core.scheduler import Scheduler
from folio.request import RequestStatus
from tests.helpers import make_request, make_scheduler


def update(scheduler: Scheduler, so: object, sampled: list[int], drafts: list[int]) -> None:
    output = ModelRunnerOutput(["a"], [sampled], [None], draft_token_ids={"a": drafts} if drafts else {})
    scheduler.update_from_output(so, output)  # type: ignore[arg-type]


def test_drafts_scheduled_verified_and_rolled_back() -> None:
    scheduler = make_scheduler()
    manager = scheduler.kv_cache_manager
    request = make_request("a", [10, 11, 12, 13, 14, 15], max_tokens=10)
    scheduler.add_request(request)

    so = scheduler.schedule()  # the prompt; the worker samples 20 and proposes [21, 22, 23]
    assert so.num_scheduled_tokens == {"a": 6} and so.scheduled_spec_decode_tokens == {}
    update(scheduler, so, [20], [21, 22, 23])
    assert (request.num_computed_tokens, request.spec_token_ids) == (6, [21, 22, 23])

    so = scheduler.schedule()  # token 20 at position 6 plus the 3 drafts at 7, 8, 9: KV slots up to 10 tokens
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_spec_decode_tokens == {"a": [21, 22, 23]}
    assert (so.scheduled_cached_reqs.num_computed_tokens, so.scheduled_cached_reqs.new_block_ids) == ([6], [[2]])
    assert (request.num_computed_tokens, request.spec_token_ids) == (10, [])
    # The target accepted 21, rejected 22 and gave 30 instead: positions 8, 9 are rolled back.
    update(scheduler, so, [21, 30], [31])
    assert request.output_token_ids == [20, 21, 30]
    assert request.num_computed_tokens == 8  # = num_tokens - 1: tokens 10..15, 20, 21
    # Only blocks of computed, accepted tokens are cached: [10..13] and [14, 15, 20, 21]; block 2 (22's slot) not.
    assert [block.block_hash is not None for block in manager.block_pool.blocks[:3]] == [True, True, False]
    assert manager.get_block_ids("a") == [0, 1, 2]  # kept for the next step's positions (as vLLM)
    stats = scheduler.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0]

    so = scheduler.schedule()  # token 30 at position 8 and draft 31 at 9: no new block
    assert (so.num_scheduled_tokens, so.scheduled_spec_decode_tokens) == ({"a": 2}, {"a": [31]})
    assert so.scheduled_cached_reqs.new_block_ids == [[]]
    # All accepted: 31 and the bonus 32; the worker proposes 7 drafts, cut to max_tokens: 10 - 5 outputs - 1 = 4.
    update(scheduler, so, [31, 32], [40, 41, 42, 43, 44, 45, 46])
    assert (request.num_computed_tokens, request.spec_token_ids) == (10, [40, 41, 42, 43])

    so = scheduler.schedule()
    assert (so.num_scheduled_tokens, so.scheduled_spec_decode_tokens) == ({"a": 5}, {"a": [40, 41, 42, 43]})
    update(scheduler, so, [40, 41, 42, 43, 44], [])  # 5 more: exactly max_tokens
    assert request.output_token_ids == [20, 21, 30, 31, 32, 40, 41, 42, 43, 44]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 6)
    assert stats.num_accepted_tokens_per_pos == [3, 1, 1, 1]
    assert stats.mean_acceptance_length == 3.0
    manager.assert_no_leaks()


def test_a_stop_inside_the_accepted_run_drops_the_rest() -> None:
    scheduler = make_scheduler()
    request = make_request("a", [10, 11, 12], max_tokens=10, eos=True)
    scheduler.add_request(request)
    so = scheduler.schedule()
    update(scheduler, so, [20], [21, 2, 23])
    so = scheduler.schedule()
    update(scheduler, so, [21, 2, 23, 24], [])  # EOS (2) accepted as the second draft
    assert request.output_token_ids == [20, 21, 2]
    assert request.status == RequestStatus.FINISHED_STOPPED
    scheduler.kv_cache_manager.assert_no_leaks()


def test_token_budget_cuts_drafts() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=3)
    request = make_request("a", [10, 11, 12], max_tokens=10)
    scheduler.add_request(request)
    so = scheduler.schedule()
    update(scheduler, so, [20], [21, 22, 23, 24])
    so = scheduler.schedule()
    assert (so.num_scheduled_tokens, so.scheduled_spec_decode_tokens) == ({"a": 3}, {"a": [21, 22]})
    assert request.spec_token_ids == []  # used once: the next step proposes afresh
    update(scheduler, so, [21, 22, 25], [])
    assert request.num_computed_tokens == 6 and request.num_tokens == 7


def test_blocks_holding_only_rejected_drafts_are_freed_and_the_worker_told() -> None:
    """5 blocks. a: 6 prompt tokens (blocks 0, 1), then token 20 at position 6 and drafts at 7..12 (blocks 2, 3).
    All drafts rejected: num_computed_tokens 7, a's next token goes to position 7 (block 1), so blocks 2 and 3 are
    free again, and b (8 tokens, 2 blocks) fits beside a in the next step, which it would not with them held."""
    scheduler = make_scheduler(num_blocks=5)
    manager = scheduler.kv_cache_manager
    a = make_request("a", [10, 11, 12, 13, 14, 15], max_tokens=20)
    scheduler.add_request(a)
    so = scheduler.schedule()
    update(scheduler, so, [20], [21, 22, 23, 24, 25, 26])
    so = scheduler.schedule()
    assert so.scheduled_cached_reqs.new_block_ids == [[2, 3]] and so.scheduled_cached_reqs.num_kept_block_ids == {}
    assert manager.get_num_free_blocks() == 1

    update(scheduler, so, [30], [31])  # the first draft rejected: a + 1 = 1 token
    assert (a.num_computed_tokens, a.output_token_ids) == (7, [20, 30])
    assert manager.get_block_ids("a") == [0, 1]
    assert manager.get_num_free_blocks() == 3
    assert [block.block_hash is not None for block in manager.block_pool.blocks[:4]] == [True, False, False, False]

    scheduler.add_request(make_request("b", [50, 51, 52, 53, 54, 55, 56, 57]))
    so = scheduler.schedule()  # a: token 30 at 7 and draft 31 at 8 -> one block; b: its 2 blocks
    assert so.num_scheduled_tokens == {"a": 2, "b": 8}
    cached = so.scheduled_cached_reqs
    # The worker cuts a's table to 2 blocks, then appends: its table follows the manager's (the free queue's head
    # holds the never-used block 4, then the freed 3 and 2, last one first).
    assert (cached.req_ids, cached.num_kept_block_ids, cached.new_block_ids) == (["a"], {"a": 2}, [[4]])
    assert manager.get_block_ids("a") == [0, 1, 4]
    assert manager.get_block_ids("b") == [3, 2]
    assert manager.get_num_free_blocks() == 0

    output = ModelRunnerOutput(["a", "b"], [[31, 32], [60]], [None, None])  # a: draft accepted + bonus
    scheduler.update_from_output(so, output)
    assert a.num_computed_tokens == 9 and manager.get_block_ids("a") == [0, 1, 4]  # position 9 is in block 2
    so = scheduler.schedule()
    assert so.scheduled_cached_reqs.num_kept_block_ids == {}  # sent once
    scheduler.abort_requests(["a", "b"])
    manager.assert_no_leaks()

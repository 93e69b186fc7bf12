"""The draft-model method's KV slots past the scheduled tokens (``Lookahead``): allocated with every scheduled
chunk, kept by the roll-back of rejected drafts, capped at max_model_len; none for n-gram or no speculation.

Block size 4, k = 3 lookahead slots: after a step the draft model writes the K/V of the request's new token and of
its k - 1 = 2 drafts after it, up to k positions past the scheduled ones.
"""

from __future__ import annotations

from folio.config import SchedulerConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.sched_output import ModelRunnerOutput
from folio.core.scheduler import Scheduler
from folio.core.spec_decode import NO_LOOKAHEAD, Lookahead
from folio.spec_decode.config import SpeculativeConfig
from tests.helpers import make_request


def _scheduler(num_blocks: int = 16, max_model_len: int = 64) -> Scheduler:
    manager = KVCacheManager(num_blocks, 4, lookahead=Lookahead(3, max_model_len))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=max_model_len), manager)


def _update(scheduler: Scheduler, so: object, sampled: list[int], drafts: list[int]) -> None:
    output = ModelRunnerOutput(["a"], [sampled], [None], draft_token_ids={"a": drafts} if drafts else {})
    scheduler.update_from_output(so, output)  # type: ignore[arg-type]


def test_the_rule() -> None:
    lookahead = Lookahead(4, 64)
    assert lookahead.num_slots(6, 4) == 14  # 10 tokens + 4 slots
    assert lookahead.num_slots(58, 4) == 64  # capped at max_model_len
    assert lookahead.num_slots(63, 1) == 64
    assert lookahead.num_slots(6, 0) == 6  # nothing scheduled: nothing written
    assert Lookahead(4).num_slots(100, 1) == 105  # no cap given
    assert NO_LOOKAHEAD.num_slots(6, 4) == 10
    draft = SpeculativeConfig("draft_model", 5, model="d.gguf")
    assert Lookahead.for_config(draft, 128) == Lookahead(5, 128)
    assert Lookahead.for_config(SpeculativeConfig("ngram", 5), 128) is NO_LOOKAHEAD
    assert Lookahead.for_config(None, 128) is NO_LOOKAHEAD


def test_slots_allocated_and_kept_through_the_roll_back() -> None:
    scheduler = _scheduler()
    manager = scheduler.kv_cache_manager
    request = make_request("a", [10, 11, 12, 13, 14, 15], max_tokens=20)
    scheduler.add_request(request)

    so = scheduler.schedule()  # the prompt (positions 0..5) + 3 slots: 9 -> blocks 0, 1, 2 (without: 0, 1)
    assert so.scheduled_new_reqs[0].block_ids == [0, 1, 2]
    _update(scheduler, so, [20], [21, 22, 23])  # the draft wrote 20 at 6, drafts 21, 22 at 7, 8

    so = scheduler.schedule()  # 20 at 6 + drafts at 7, 8, 9 = 10 tokens + 3 slots: 13 -> block 3
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_cached_reqs.new_block_ids == [[3]]
    # Every draft rejected: the target's 30 is at position 7, 7 computed; the draft model wrote 30 at 7 and its
    # drafts at 8, 9: block 2 is kept (the n-gram rule, without lookahead, would free it), block 3 freed.
    _update(scheduler, so, [30], [31, 32, 33])
    assert request.num_computed_tokens == 7
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.get_num_free_blocks() == 13

    so = scheduler.schedule()  # 30 at 7 + drafts at 8..10 = 11 tokens + 3 slots: 14 -> one block again
    assert so.scheduled_cached_reqs.num_kept_block_ids == {"a": 3}
    assert so.scheduled_cached_reqs.new_block_ids == [[4]]  # the free queue's head (3 went to its tail)
    scheduler.abort_requests(["a"])
    manager.assert_no_leaks()


def test_slots_stop_at_max_model_len() -> None:
    """max_model_len 12 = 3 blocks: a 10-token prompt takes them all, not a 4th for slots past the last position."""
    scheduler = _scheduler(num_blocks=3, max_model_len=12)
    request = make_request("a", list(range(100, 110)), max_tokens=3)
    scheduler.add_request(request)
    so = scheduler.schedule()
    assert so.scheduled_new_reqs[0].block_ids == [0, 1, 2]
    _update(scheduler, so, [20], [21])
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 2} and so.scheduled_cached_reqs.new_block_ids == [[]]
    _update(scheduler, so, [21, 22], [])  # 12 tokens: max_model_len stops it before the bonus token
    assert request.output_token_ids == [20, 21] and request.is_finished()
    scheduler.kv_cache_manager.assert_no_leaks()

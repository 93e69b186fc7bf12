"""KVCacheManager: allocation, prefix hits, eviction order, fork and copy-on-write, with exact ids and ref counts.

Requests here are driven by hand (num_computed_tokens set as the scheduler would) to pin down each rule alone.
"""

import pytest

from folio.core.block_hash import update_request_block_hashes
from folio.core.kv_cache_manager import AllocationResult, KVCacheManager
from folio.request import Request
from tests.helpers import make_request


def new_request(request_id: str, prompt: int | list[int], block_size: int = 4) -> Request:
    request = make_request(request_id, prompt)
    update_request_block_hashes(request, block_size)
    return request


def compute(manager: KVCacheManager, request: Request, num_tokens: int) -> AllocationResult:
    """Allocate for num_tokens, pretend the forward ran, cache what is now computed (as the scheduler does)."""
    result = manager.allocate_slots(request, num_tokens)
    assert result is not None
    request.num_computed_tokens += num_tokens
    manager.cache_computed_blocks(request)
    return result


def ref_counts(manager: KVCacheManager) -> list[int]:
    return [block.ref_count for block in manager.block_pool.blocks]


def free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def test_allocate_grows_block_list_only_at_block_boundaries() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = new_request("a", 10)
    assert compute(manager, request, 10) == AllocationResult(new_block_ids=[0, 1, 2])
    assert compute(manager, request, 1) == AllocationResult(new_block_ids=[])  # position 10 fits block 2
    assert compute(manager, request, 1) == AllocationResult(new_block_ids=[])  # position 11 too
    assert compute(manager, request, 1) == AllocationResult(new_block_ids=[3])  # position 12: a new block
    assert manager.get_block_ids("a") == [0, 1, 2, 3]
    assert manager.get_num_free_blocks() == 4
    assert manager.usage == pytest.approx(0.5)
    manager.free(request)
    manager.assert_no_leaks()


def test_allocate_returns_none_and_changes_nothing_when_short() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    compute(manager, new_request("a", 12), 12)
    b = new_request("b", [7] * 8)
    assert manager.allocate_slots(b, 8) is None
    assert manager.get_num_free_blocks() == 1
    assert "b" not in manager.req_to_blocks
    assert manager.allocate_slots(b, 4) == AllocationResult(new_block_ids=[3])


def test_free_reverses_order_so_sequence_tails_are_evicted_first() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=4)
    a, b = new_request("a", 12), new_request("b", [5] * 8)
    compute(manager, a, 12)  # blocks 0, 1, 2
    compute(manager, b, 8)  # blocks 3, 4
    manager.free(a)
    manager.free(b)
    assert free_ids(manager) == [5, 2, 1, 0, 4, 3]
    c = new_request("c", [9] * 16)
    assert compute(manager, c, 16).new_block_ids == [5, 2, 1, 0]  # a's tail first, its head block 0 last
    assert manager.block_pool.get_cached_block(a.block_hashes[0]) is None  # block 0 reused: evicted
    assert manager.block_pool.get_cached_block(b.block_hashes[0]) is manager.block_pool.blocks[3]


def test_prefix_hit_shares_blocks_across_requests() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a = new_request("a", list(range(10)))
    compute(manager, a, 10)  # blocks 0, 1 full and cached; block 2 partial
    b = new_request("b", list(range(8)) + [50, 51, 52])
    blocks, num_hit_tokens = manager.get_computed_blocks(b)
    assert [block.block_id for block in blocks] == [0, 1]
    assert num_hit_tokens == 8
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (11, 8)
    result = manager.allocate_slots(b, 3, blocks, num_hit_tokens)
    assert result == AllocationResult(new_block_ids=[0, 1, 3])
    assert ref_counts(manager)[:4] == [2, 2, 1, 1]
    manager.free(a)
    assert ref_counts(manager)[:4] == [1, 1, 0, 1]
    assert free_ids(manager) == [4, 5, 6, 7, 2]  # only a's private block is free
    manager.free(b)
    manager.assert_no_leaks()


def test_hit_capped_to_recompute_last_token() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    compute(manager, new_request("a", list(range(9))), 9)
    same_8 = new_request("b", list(range(8)))  # both its blocks are cached, but the last token is recomputed
    blocks, num_hit_tokens = manager.get_computed_blocks(same_8)
    assert [block.block_id for block in blocks] == [0]
    assert num_hit_tokens == 4


def test_only_computed_full_blocks_are_cached() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    a = new_request("a", list(range(10)))
    compute(manager, a, 6)  # chunk 1: positions 0..5, block 0 full
    assert [b.block_hash is not None for b in manager.req_to_blocks["a"]] == [True, False]
    b = new_request("b", list(range(10)))
    assert manager.get_computed_blocks(b)[1] == 4  # block 1 (positions 4..7) is not computed yet
    compute(manager, a, 4)
    assert manager.get_computed_blocks(b)[1] == 8


def test_freed_cached_blocks_are_revived_and_count_against_free_blocks() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=4)
    a = new_request("a", list(range(8)))
    compute(manager, a, 8)
    manager.free(a)
    assert free_ids(manager) == [2, 1, 0]
    c = new_request("c", [9] * 4)
    compute(manager, c, 4)  # takes block 2
    b = new_request("b", list(range(12)))
    blocks, num_hit_tokens = manager.get_computed_blocks(b)
    assert ([block.block_id for block in blocks], num_hit_tokens) == ([0, 1], 8)
    # 2 free blocks, but both are the hit blocks themselves: nothing left for the 3rd block.
    assert manager.allocate_slots(b, 4, blocks, num_hit_tokens) is None
    assert free_ids(manager) == [1, 0]
    manager.free(c)  # block 2 free again
    result = manager.allocate_slots(b, 4, blocks, num_hit_tokens)
    assert result == AllocationResult(new_block_ids=[0, 1, 2])
    assert ref_counts(manager) == [1, 1, 1]
    assert free_ids(manager) == []


def test_fork_shares_prompt_blocks_and_copy_on_write_on_first_write() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4)
    parent = new_request("p", list(range(6)))
    compute(manager, parent, 6)  # blocks 0 (full), 1 (positions 4, 5)
    child = new_request("c", list(range(6)))
    manager.fork("p", child)
    assert manager.get_block_ids("c") == [0, 1]
    assert ref_counts(manager)[:3] == [2, 2, 0]
    child.num_computed_tokens = 5  # the child recomputes position 5 for its own logits: a write into block 1
    result = manager.allocate_slots(child, 1)
    assert result == AllocationResult(new_block_ids=[], replaced_block_ids=[(1, 2)], block_copies=[(1, 2)])
    assert manager.get_block_ids("c") == [0, 2]
    assert ref_counts(manager)[:3] == [2, 1, 1]
    assert manager.allocate_slots(parent, 1) == AllocationResult()  # block 1 is the parent's alone now: no copy
    manager.free(parent)
    manager.free(child)
    manager.assert_no_leaks()


def test_copy_on_write_needs_a_free_block() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=4)
    parent = new_request("p", list(range(6)))
    compute(manager, parent, 6)
    child = new_request("c", list(range(6)))
    manager.fork("p", child)
    child.num_computed_tokens = 5
    assert manager.allocate_slots(child, 1) is None
    assert manager.get_block_ids("c") == [0, 1]
    assert ref_counts(manager) == [2, 2]


def test_fork_requires_the_parent_prompt_blocks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    parent = new_request("p", list(range(6)))
    compute(manager, parent, 4)  # prompt not fully scheduled: 1 block
    with pytest.raises(ValueError):
        manager.fork("p", new_request("c", list(range(6))))


def test_leak_check_names_the_leak() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    compute(manager, new_request("a", 4), 4)
    assert manager.find_leaks() == [
        "requests still hold blocks: ['a']",
        "3 of 4 blocks free",
        "(block id, ref_count) not 0: [(0, 1)]",
    ]
    with pytest.raises(AssertionError, match="KV block leak"):
        manager.assert_no_leaks()


def test_prefix_caching_disabled() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = new_request("a", list(range(8)))
    compute(manager, a, 8)
    assert manager.get_computed_blocks(new_request("b", list(range(9)))) == ([], 0)
    assert manager.prefix_cache_queries == 0
    assert all(block.block_hash is None for block in manager.block_pool.blocks)

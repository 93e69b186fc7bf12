"""The data-parallel router (folio/engine/dp_router.py): the rule as a table of exact choices, the approximate prefix
record (leading matches, LRU eviction of a prefix's tail first), and the per-engine load of requests in flight."""

from __future__ import annotations

import pytest

from folio.core.block_hash import extend_block_hashes
from folio.engine.dp_router import DPRouter, PrefixRecord, RoutingPolicy, choose_engine

BLOCK = 4


@pytest.mark.parametrize(
    ("matched", "loads", "expected", "why"),
    [
        ([0, 0], [0, 0], 0, "nothing cached, equal loads: the lowest index"),
        ([0, 0], [2, 1], 1, "nothing cached: the least loaded"),
        ([6, 0], [3, 1], 0, "6 blocks cached there; 2 more requests is within the gap"),
        ([6, 0], [17, 1], 0, "a gap of exactly 16 is allowed"),
        ([6, 0], [18, 1], 1, "a gap of 17 > 16: the load wins"),
        ([1, 0], [1, 0], 1, "a 1-block match is short: the load wins"),
        ([2, 0], [1, 0], 0, "2 blocks more than the least-loaded engine holds: the prefix wins"),
        ([5, 4], [1, 0], 1, "the least-loaded engine holds almost as much"),
        ([0, 3], [0, 0], 1, "equal loads: the longer match"),
        ([3, 3, 0], [2, 1, 0], 1, "equal matches: the lower load among them"),
        ([8, 0], [100, 80], 0, "at load 80 the allowed gap is 25% = 20"),
        ([8, 0], [101, 80], 1, "gap 21 > 20"),
        ([0, 9, 9], [0, 17, 2], 2, "engine 1 is past the gap, engine 2 within it"),
    ],
)
def test_choose_engine(matched: list[int], loads: list[int], expected: int, why: str) -> None:
    assert choose_engine(matched, loads) == expected, why


def test_policy_thresholds() -> None:
    strict = RoutingPolicy(min_prefix_blocks=4, max_load_gap=0, max_load_ratio=0.0)
    assert choose_engine([3, 0], [0, 0], strict) == 0  # equal loads: the longer match by the tie rule
    assert choose_engine([3, 0], [1, 0], strict) == 1  # 3 < 4 blocks
    assert choose_engine([4, 0], [1, 0], strict) == 1  # no gap allowed at all
    with pytest.raises(ValueError, match="min_prefix_blocks"):
        RoutingPolicy(min_prefix_blocks=0)


def test_prefix_record_matches_leading_blocks_and_evicts_tails_first() -> None:
    record = PrefixRecord(capacity=5)
    record.record([10, 11, 12])
    assert [record.matched_blocks(h) for h in ([10, 11, 12, 13], [10, 11, 99], [99, 11], [])] == [3, 2, 0, 0]
    record.record([20, 21, 22])  # 6 hashes > 5: the oldest goes, which is the first prompt's last block
    assert len(record) == 5
    assert record.matched_blocks([10, 11, 12]) == 2
    assert record.matched_blocks([20, 21, 22]) == 3
    record.record([10])  # touching a head keeps it
    record.record([30])
    assert record.matched_blocks([10, 11]) == 1  # 11 was the oldest left
    assert record.matched_blocks([20, 21, 22]) == 3


def test_router_follows_the_prefix_and_counts_load() -> None:
    router = DPRouter([100, 100], block_size=BLOCK)
    shared = list(range(1, 13))  # 3 full blocks
    assert router.route(["a-0"], shared + [50]) == 0  # nothing anywhere: the lowest index
    assert router.route(["b-0"], [90, 91, 92, 93, 94]) == 1  # unrelated: the idle engine
    assert router.route(["c-0", "c-1"], shared + [60, 61]) == 0  # 3 blocks cached on 0, loads 1 and 1
    assert router.loads == [3, 1]
    assert router.engine_of("c-1") == 0
    assert router.release(["c-0", "b-0", "zz"]) == {0: ["c-0"], 1: ["b-0"]}  # unknown ids are nobody's
    assert router.loads == [2, 0] and router.engine_of("b-0") is None
    # The block hashes are the KV cache manager's: the record holds exactly the prompt's full blocks.
    expected: list[int] = []
    extend_block_hashes(expected, shared + [60, 61], BLOCK)
    assert router.records[0].matched_blocks(expected) == 3 and len(router.records[0]) == 3


def test_router_without_prefix_caching_goes_by_load_only() -> None:
    router = DPRouter([100, 100], block_size=BLOCK, prefix_caching=False)
    shared = list(range(1, 13))
    assert router.route(["a-0"], shared) == 0
    assert router.route(["b-0"], shared) == 1  # the same prompt: no cache to follow
    assert [len(r) for r in router.records] == [0, 0]


def test_one_engine_routes_everything_to_it_without_hashing() -> None:
    router = DPRouter([100], block_size=BLOCK)
    assert router.route(["a-0"], list(range(40))) == 0
    assert router.loads == [1] and len(router.records[0]) == 0


def test_round_robin_and_load_routings_ignore_the_prefix() -> None:
    shared = list(range(1, 13))
    round_robin = DPRouter([100, 100], block_size=BLOCK, routing="round_robin")
    assert [round_robin.route([f"r{i}"], shared) for i in range(4)] == [0, 1, 0, 1]  # loads 0 and 0 after the 1st
    load = DPRouter([100, 100], block_size=BLOCK, routing="load")
    assert load.route(["a"], shared) == 0 and load.route(["b"], shared) == 1  # the prefix on 0 does not count
    load.release(["b"])
    assert load.route(["c"], shared) == 1
    with pytest.raises(ValueError, match="data_parallel_routing must be one of"):
        DPRouter([1, 1], block_size=BLOCK, routing="random")

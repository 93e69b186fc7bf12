"""The host KV tier (folio/core/offload.py): host block ids, LRU, stores on device eviction, loads on lookup.

Exact outcomes (DESIGN.md convention 10). The scheduler-level tests run the FakeWorker, which executes the
kv_stores / kv_loads on its own fake host blocks and then reads every request's context back through its block
table: a wrong or missing plan reads back the wrong tokens.
"""

from __future__ import annotations

import pytest

from folio.core.block_hash import update_request_block_hashes
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.offload import HostKVTier
from tests.helpers import make_request, make_scheduler, make_worker, run_to_completion, step


def _free_ids(tier: HostKVTier) -> list[int]:
    return [block.block_id for block in tier.pool.free_block_queue.get_all_free_blocks()]


def test_host_block_ids_lru_eviction_and_pins() -> None:
    tier = HostKVTier(3)
    assert _free_ids(tier) == [0, 1, 2]
    tier.store_evicted(10, 0xA)
    tier.store_evicted(11, 0xB)
    tier.store_evicted(12, 0xC)
    tier.store_evicted(13, 0xA)  # already here: no store
    assert _free_ids(tier) == [0, 1, 2]  # stored blocks are free but cached, LRU first
    tier.store_evicted(14, 0xD)  # full: the LRU block 0 (hash A) is dropped and reused
    assert tier.find_chain([0xA]) == []
    assert [block.block_id for block in tier.find_chain([0xB, 0xC, 0xD, 0xA])] == [1, 2, 0]
    assert _free_ids(tier) == [1, 2, 0]

    (hit,) = tier.find_chain([0xB])
    tier.pin([hit])
    tier.load_hits([hit], [7])
    assert hit.ref_count == 1 and tier.pool.get_num_free_blocks() == 2 and tier.usage == pytest.approx(1 / 3)
    tier.store_evicted(15, 0xE)  # block 1 is pinned by this step's load: block 2 (hash C) is reused instead
    assert tier.find_chain([0xC]) == []
    assert tier.pool.get_cached_block(0xE).block_id == 2  # type: ignore[union-attr]

    stores, loads = tier.take_plans()
    assert stores == [(10, 0), (11, 1), (12, 2), (14, 0), (15, 2)]
    assert loads == [(1, 7)]
    assert _free_ids(tier) == [0, 2, 1]  # the loaded block is unpinned to the tail: most recently used
    assert tier.usage == 0.0
    assert (tier.num_blocks_to_cpu_total, tier.num_blocks_to_device_total) == (5, 1)
    assert tier.take_plans() == ([], [])
    assert tier.find_leaks() == []


def test_evicted_prefix_is_stored_then_loaded_on_lookup() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, num_host_blocks=4)
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("A", 9, max_tokens=1))
    so, _ = step(scheduler, worker)  # A: blocks [0, 1, 2]; full blocks 0, 1 cached; freed tail first
    assert (so.kv_stores, so.kv_loads) == ([], [])

    scheduler.add_request(make_request("B", list(range(2000, 2013)), max_tokens=1))
    so, _ = step(scheduler, worker)  # B takes 3, 2, 1, 0: evicting A's cached 1 (hash 1) then 0 (hash 0)
    assert so.scheduled_new_reqs[0].block_ids == [3, 2, 1, 0]
    assert so.kv_stores == [(1, 0), (0, 1)]
    assert so.kv_loads == []

    # A's prompt again: no device hit, both blocks in the host tier (8 tokens, the 9th recomputed).
    scheduler.add_request(make_request("C", 9, max_tokens=1))
    so, _ = step(scheduler, worker)
    (new,) = so.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens, so.num_scheduled_tokens) == ([0, 1, 2], 8, {"C": 1})
    assert so.kv_loads == [(1, 0), (0, 1)]  # host 1 holds hash 0, host 0 hash 1
    assert so.kv_stores == [(1, 2), (2, 3)]  # B's cached blocks evicted by C go to the free host blocks 2, 3
    stats = scheduler.get_stats()
    assert (stats.kv_offload_blocks_to_cpu_total, stats.kv_offload_blocks_to_device_total) == (4, 2)
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (9 + 13 + 9, 8)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (31, 0)
    assert stats.kv_offload_cpu_usage == 0.0
    host = scheduler.kv_cache_manager.host_tier
    assert host is not None and _free_ids(host) == [2, 3, 1, 0]
    scheduler.kv_cache_manager.assert_no_leaks()


def test_host_hits_are_pinned_before_the_device_evictions_of_the_same_step() -> None:
    """Host tier of 2, both blocks C's hits: B's evicted blocks find no free host block, so they are not stored
    (were the hits not pinned first, the stores would overwrite them before the loads read them)."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, num_host_blocks=2)
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("A", 9, max_tokens=1))
    step(scheduler, worker)
    scheduler.add_request(make_request("B", list(range(2000, 2013)), max_tokens=1))
    so, _ = step(scheduler, worker)
    assert so.kv_stores == [(1, 0), (0, 1)]
    scheduler.add_request(make_request("C", 9, max_tokens=1))
    so, outputs = step(scheduler, worker)  # the FakeWorker checks C's context read back through [0, 1, 2]
    assert (so.kv_stores, so.kv_loads) == ([], [(1, 0), (0, 1)])
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert [out.finished for out in outputs] == [True]
    scheduler.kv_cache_manager.assert_no_leaks()


def test_chain_continues_from_device_to_host_then_recomputes_after_a_dropped_block() -> None:
    """Device holds blocks 0-1 of P's chain, the host blocks 2-3; block 4 was dropped from the host (LRU)."""
    manager = KVCacheManager(10, 4, num_host_blocks=2)
    host = manager.host_tier
    assert host is not None
    prompt = list(range(100, 120))  # 5 full blocks
    p = make_request("P", prompt)
    update_request_block_hashes(p, 4)
    assert manager.allocate_slots(p, 20) is not None
    p.num_computed_tokens = 20
    manager.cache_computed_blocks(p)
    manager.free(p)  # free queue: [5, 6, 7, 8, 9, 4, 3, 2, 1, 0]
    filler = make_request("X", 32)
    assert manager.allocate_slots(filler, 32) is not None  # evicts P's 4, 3, 2 in that order
    assert manager.get_block_ids("X") == [5, 6, 7, 8, 9, 4, 3, 2]
    assert manager.take_kv_plans() == ([(4, 0), (3, 1), (2, 0)], [])  # hash 4 dropped when block 2 came
    manager.free(filler)

    q = make_request("Q", [*prompt, 7, 7, 7, 7])  # 24 tokens: P's 5 blocks and one of its own
    update_request_block_hashes(q, 4)
    computed, num_tokens = manager.get_computed_blocks(q)
    assert [block.block_id for block in computed] == [0, 1]
    assert num_tokens == 16  # 2 device blocks + 2 host blocks; block 4 recomputed
    allocation = manager.allocate_slots(q, 24 - num_tokens, computed, num_tokens)
    assert allocation is not None
    assert allocation.new_block_ids == [0, 1, 2, 3, 4, 9]
    assert [block.ref_count for block in host.pool.blocks] == [1, 1]  # pinned until the plans are taken
    assert manager.take_kv_plans() == ([], [(0, 2), (1, 3)])
    assert [block.ref_count for block in host.pool.blocks] == [0, 0]
    assert (manager.prefix_cache_hits, host.external_prefix_cache_queries, host.external_prefix_cache_hits) == (
        8,
        16,
        8,
    )
    manager.free(q)
    manager.assert_no_leaks()


def test_no_host_tier_changes_nothing() -> None:
    """num_host_blocks 0: no host tier, no plans, the counters stay 0."""
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    assert scheduler.kv_cache_manager.host_tier is None
    worker = make_worker(scheduler)
    for req_id, prompt in (("A", 9), ("B", list(range(2000, 2013))), ("C", 9)):
        scheduler.add_request(make_request(req_id, prompt, max_tokens=1))
    result = run_to_completion(scheduler, worker)
    assert all(so.kv_stores == [] and so.kv_loads == [] for so in result.steps)
    stats = scheduler.get_stats()
    assert (stats.kv_offload_blocks_to_cpu_total, stats.external_prefix_cache_queries) == (0, 0)

"""The disk KV tier (folio/core/disk_tier.py): LRU at capacity, pins, consistent plans within a step, host drops
stored to disk, the chain device -> host -> disk -> recompute, a restart from a listing, and a lost file recomputed.

Exact outcomes (DESIGN.md convention 10). The scheduler-level tests run the FakeWorker, which executes the disk plans on
a fake disk in the real worker's order and reads every request's context back through its block table: a wrong source,
a missing store or a wrong load reads back the wrong tokens.
"""

from __future__ import annotations

from folio.core.block_hash import hash_block_tokens
from folio.core.disk_tier import DiskKVTier
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.sched_output import DiskStore, SchedulerOutput
from folio.core.scheduler import Scheduler
from tests.helpers import FakeWorker, make_request, make_scheduler, make_worker, run_to_completion, step

BLOCK = 4
PROMPT_A = list(range(1000, 1009))  # make_request("X", 9)'s tokens: 2 full blocks and one token
PROMPT_B = list(range(2000, 2013))
PROMPT_C = list(range(3000, 3009))


def _chain(tokens: list[int]) -> list[int]:
    hashes: list[int] = []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[start : start + BLOCK]))
    return hashes


A0, A1 = _chain(PROMPT_A)
B0, B1, B2 = _chain(PROMPT_B)


def test_lru_at_capacity_pins_and_consistent_plans() -> None:
    tier = DiskKVTier(3, block_hashes=[0xA, 0xB, 0xC, 0xD])  # a listing, oldest first: one file too many
    assert (tier.hashes(), tier.num_warm_blocks) == ([0xB, 0xC, 0xD], 3)
    tier.store(0xE, 5)  # at capacity: B, the least recently used, is dropped
    tier.store(0xC, 6)  # held already: only becomes the most recent
    assert tier.hashes() == [0xD, 0xE, 0xC]
    tier.pin([0xD])
    tier.load_hits([0xD], [9])
    tier.store(0xF, 7, from_device=True)  # D is pinned: E is dropped, and E was stored this step: never written
    tier.store(0xB, 8)  # C dropped (its file deleted); B's file, deleted this step, is kept instead of rewritten
    assert tier.hashes() == [0xD, 0xF, 0xB]
    plans = tier.take_plans()
    assert plans.stores == [DiskStore(0xF, 7, True)]
    assert plans.loads == [(0xD, 9)]
    assert plans.deletes == [0xA, 0xC]
    assert (tier.num_blocks_to_disk_total, tier.num_blocks_from_disk_total, tier.usage) == (1, 1, 1.0)
    assert tier.find_leaks() == [] and not tier.take_plans()

    tier.forget([0xF])  # a load that failed: the hash goes, with its file
    assert (tier.hashes(), tier.take_plans().deletes, tier.num_failed_loads_total) == ([0xD, 0xB], [0xF], 1)

    full = DiskKVTier(1, block_hashes=[0x1])
    full.pin([0x1])
    full.store(0x2, 0)  # every hash pinned: nothing is stored
    assert (full.hashes(), full.take_plans().stores) == ([0x1], [])


def _run_a_b(scheduler: Scheduler, worker: FakeWorker) -> None:
    """A (9 tokens) cached in device blocks 0, 1; B (13 tokens) takes every block: A's go to host blocks 0, 1."""
    scheduler.add_request(make_request("A", PROMPT_A, max_tokens=1))
    step(scheduler, worker)
    scheduler.add_request(make_request("B", PROMPT_B, max_tokens=1))
    so, _ = step(scheduler, worker)
    assert (so.kv_stores, so.kv_disk.stores) == ([(1, 0), (0, 1)], [])


def test_host_drops_are_stored_to_disk_and_disk_hits_load_into_device_blocks() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=BLOCK, max_model_len=16, num_host_blocks=2, num_disk_blocks=3)
    worker = make_worker(scheduler)
    _run_a_b(scheduler, worker)
    # C evicts B's cached blocks 1 (B2) and 2 (B1) into the host tier, which drops A1 then A0 to disk first.
    scheduler.add_request(make_request("C", PROMPT_C, max_tokens=1))
    so, _ = step(scheduler, worker)
    assert so.kv_stores == [(1, 0), (2, 1)]
    assert so.kv_disk.stores == [DiskStore(A1, 0), DiskStore(A0, 1)]  # read before the host stores overwrite them

    # A's prompt again: neither on the device nor in the host tier; both blocks on disk, loaded into fresh blocks.
    # Its fresh blocks evict B0 and C1 into the host tier, which drops B2 and B1: B2 is stored, then dropped again
    # (disk capacity 3, A0 and A1 pinned), so only B1 is written.
    scheduler.add_request(make_request("D", PROMPT_A, max_tokens=1))
    so, outputs = step(scheduler, worker)  # the FakeWorker reads D's context back through [3, 2, 1]
    (new,) = so.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens, so.num_scheduled_tokens) == ([3, 2, 1], 8, {"D": 1})
    assert (so.kv_stores, so.kv_loads) == ([(3, 0), (1, 1)], [])
    assert so.kv_disk.loads == [(A0, 3), (A1, 2)]
    assert so.kv_disk.stores == [DiskStore(B1, 1)] and so.kv_disk.deletes == []
    assert [out.finished for out in outputs] == [True]
    disk = scheduler.kv_cache_manager.disk_tier
    assert disk is not None and disk.hashes() == [A0, A1, B1] and sorted(worker.disk) == sorted(disk.hashes())
    stats = scheduler.get_stats()
    assert (stats.kv_offload_blocks_to_disk_total, stats.kv_offload_blocks_from_disk_total) == (3, 2)
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (9 + 13 + 9 + 9, 8)
    assert stats.kv_offload_disk_usage == 1.0
    scheduler.kv_cache_manager.assert_no_leaks()


def test_host_block_stored_and_dropped_in_one_step_is_written_from_its_device_block() -> None:
    """A one-block host tier: B's eviction of A1 stores it to host block 0, and the eviction of A0 drops it again in
    the same step, before host block 0 holds it: the disk store reads device block 1. The chain of A's prompt then
    continues in the host tier (A0) and on disk (A1)."""
    scheduler = make_scheduler(num_blocks=4, block_size=BLOCK, max_model_len=16, num_host_blocks=1, num_disk_blocks=4)
    worker = make_worker(scheduler)
    scheduler.add_request(make_request("A", PROMPT_A, max_tokens=1))
    step(scheduler, worker)
    scheduler.add_request(make_request("B", PROMPT_B, max_tokens=1))
    so, _ = step(scheduler, worker)
    assert so.kv_stores == [(1, 0), (0, 0)]
    assert so.kv_disk.stores == [DiskStore(A1, 1, from_device=True)]
    scheduler.add_request(make_request("C", PROMPT_A, max_tokens=1))
    so, outputs = step(scheduler, worker)
    (new,) = so.scheduled_new_reqs
    assert (new.block_ids, new.num_computed_tokens) == ([0, 1, 2], 8)
    assert (so.kv_loads, so.kv_disk.loads) == ([(0, 0)], [(A1, 1)])
    assert [out.finished for out in outputs] == [True]
    scheduler.kv_cache_manager.assert_no_leaks()


def test_chain_continues_device_then_host_then_disk_then_recomputes() -> None:
    """P's 5 blocks: a filler's evictions leave P0 on the device, P1 in the one-block host tier, P2 and P3 on disk;
    P4 was stored to disk and dropped again in the same step (capacity 2). Q = P + 4 tokens hits 4 blocks."""
    manager = KVCacheManager(10, BLOCK, num_host_blocks=1, num_disk_blocks=2)
    prompt = list(range(100, 120))
    p0, p1, p2, p3, p4 = _chain(prompt)
    p = make_request("P", prompt)
    p.block_hashes = [p0, p1, p2, p3, p4]
    assert manager.allocate_slots(p, 20) is not None
    p.num_computed_tokens = 20
    manager.cache_computed_blocks(p)
    manager.free(p)  # free queue: [5, 6, 7, 8, 9, 4, 3, 2, 1, 0]
    filler = make_request("X", 36)
    assert manager.allocate_slots(filler, 36) is not None  # evicts P4, P3, P2, P1 in that order
    assert manager.take_kv_plans() == ([(4, 0), (3, 0), (2, 0), (1, 0)], [])
    plans = manager.take_disk_plans()
    assert plans.stores == [DiskStore(p3, 3, True), DiskStore(p2, 2, True)] and plans.deletes == []
    manager.free(filler)

    q = make_request("Q", [*prompt, 7, 7, 7, 7])
    q.block_hashes = [p0, p1, p2, p3, p4, hash_block_tokens(p4, [7, 7, 7, 7])]
    computed, num_tokens = manager.get_computed_blocks(q)
    assert ([block.block_id for block in computed], num_tokens) == ([0], 16)  # P4 is recomputed
    allocation = manager.allocate_slots(q, 24 - num_tokens, computed, num_tokens)
    assert allocation is not None and allocation.new_block_ids == [0, 1, 2, 3, 4, 9]
    assert manager.take_kv_plans() == ([], [(0, 1)])
    assert manager.take_disk_plans().loads == [(p2, 2), (p3, 3)]
    assert manager.host_tier is not None and manager.host_tier.external_prefix_cache_hits == 3 * BLOCK
    manager.free(q)
    manager.assert_no_leaks()


def _restarted(worker: FakeWorker, num_disk_blocks: int = 8, num_blocks: int = 4) -> tuple[Scheduler, FakeWorker]:
    """A new core and worker on the same disk: the core's index comes from the listing (oldest first)."""
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_model_len=16,
        num_host_blocks=2,
        num_disk_blocks=num_disk_blocks,
        disk_block_hashes=list(worker.disk),
    )
    return scheduler, make_worker(scheduler, disk=worker.disk)


def _flush(scheduler: Scheduler, worker: FakeWorker) -> SchedulerOutput:
    """What EngineCore.shutdown does: an output with no tokens whose disk plans keep every cached block."""
    scheduler.kv_cache_manager.plan_disk_flush()
    output = SchedulerOutput.make_empty()
    output.kv_disk = scheduler.kv_cache_manager.take_disk_plans()
    worker.execute(output)
    return output


def _flushed_a_b() -> FakeWorker:
    """A worker whose disk holds A's and B's blocks, flushed by a core that ran them."""
    scheduler = make_scheduler(num_blocks=4, block_size=BLOCK, max_model_len=16, num_host_blocks=2, num_disk_blocks=8)
    worker = make_worker(scheduler)
    _run_a_b(scheduler, worker)
    _flush(scheduler, worker)
    return worker


def test_a_restarted_core_finds_the_flushed_blocks_warm() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=BLOCK, max_model_len=16, num_host_blocks=2, num_disk_blocks=8)
    worker = make_worker(scheduler)
    _run_a_b(scheduler, worker)
    flushed = _flush(scheduler, worker)  # the host tier's blocks (LRU first), then the device's cached blocks
    assert flushed.kv_disk.stores == [
        DiskStore(A1, 0),
        DiskStore(A0, 1),
        DiskStore(B2, 1, True),
        DiskStore(B1, 2, True),
        DiskStore(B0, 3, True),
    ]
    restarted, new_worker = _restarted(worker)
    disk = restarted.kv_cache_manager.disk_tier
    assert disk is not None and disk.num_warm_blocks == 5
    restarted.add_request(make_request("A2", PROMPT_A, max_tokens=1))
    so, outputs = step(restarted, new_worker)  # the FakeWorker reads A2's context back from the loaded blocks
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.kv_disk.loads == [(A0, 0), (A1, 1)]
    assert [out.finished for out in outputs] == [True]
    assert restarted.get_stats().external_prefix_cache_hits == 8
    restarted.kv_cache_manager.assert_no_leaks()

    smaller, _ = _restarted(worker, num_disk_blocks=2)  # restarted with less room: the oldest files go
    assert smaller.kv_cache_manager.disk_tier is not None
    assert smaller.kv_cache_manager.take_disk_plans().deletes == [A1, A0, B2]


def test_a_lost_file_is_recomputed_and_forgotten() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=BLOCK, max_model_len=16, num_host_blocks=2, num_disk_blocks=8)
    worker = make_worker(scheduler)
    _run_a_b(scheduler, worker)
    _flush(scheduler, worker)
    restarted, new_worker = _restarted(worker)
    del new_worker.disk[A1]  # lost behind the engine's back
    restarted.add_request(make_request("A2", PROMPT_A, max_tokens=3))
    so, outputs = step(restarted, new_worker)
    assert so.kv_disk.loads == [(A0, 0), (A1, 1)] and outputs == []  # left out of the step: A1 failed
    assert [request.request_id for request in restarted.waiting] == ["A2"]
    so, outputs = step(restarted, new_worker)  # A0's block is a device hit now; A1 is not on disk: recomputed
    assert (so.scheduled_new_reqs[0].num_computed_tokens, so.num_scheduled_tokens) == (4, {"A2": 5})
    assert so.kv_disk.deletes == [A1] and so.kv_disk.loads == []
    tokens = [token for out in outputs for token in out.new_token_ids]
    tokens += run_to_completion(restarted, new_worker).outputs["A2"]
    plain = make_scheduler(num_blocks=4, block_size=BLOCK, max_model_len=16)
    plain.add_request(make_request("A2", PROMPT_A, max_tokens=3))
    assert tokens == run_to_completion(plain, make_worker(plain)).outputs["A2"]  # FakeWorker: same context, tokens
    stats = restarted.get_stats()
    assert (stats.kv_offload_disk_failed_loads_total, stats.kv_offload_blocks_from_disk_total) == (1, 2)
    restarted.kv_cache_manager.assert_no_leaks()


def test_abort_with_disk_loads_planned_or_after_a_failure_frees_every_tier() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=BLOCK, max_model_len=16, num_host_blocks=2, num_disk_blocks=8)
    worker = make_worker(scheduler)
    _run_a_b(scheduler, worker)
    _flush(scheduler, worker)
    restarted, new_worker = _restarted(worker)
    restarted.add_request(make_request("X", PROMPT_A, max_tokens=4))
    so = restarted.schedule()
    assert so.kv_disk.loads == [(A0, 0), (A1, 1)]
    restarted.abort_requests("X")  # lands between schedule and update
    restarted.update_from_output(so, new_worker.execute(so))
    restarted.kv_cache_manager.assert_no_leaks()

    del new_worker.disk[A0]
    restarted.add_request(make_request("Y", PROMPT_A, max_tokens=4))
    so, _ = step(restarted, new_worker)  # Y's load of A0 fails: Y waits again, holding nothing
    assert restarted.kv_cache_manager.req_to_blocks == {} and so.kv_disk.loads
    restarted.abort_requests("Y")
    restarted.kv_cache_manager.assert_no_leaks()
    last = restarted.schedule()
    new_worker.execute(last)
    assert not new_worker.requests and last.kv_disk.deletes == [A0]


def test_blocks_loaded_from_disk_are_hits_only_once_their_step_answered() -> None:
    """A disk load may fail (a lost file), leaving its device block unwritten: the blocks of a request with disk loads
    are cached only after its step answered, so a request admitted beside it loads its own copies. A file lost after
    the listing fails only the requests that loaded it; the one after them hits the device."""
    scheduler, worker = _restarted(_flushed_a_b(), num_blocks=12)
    for request_id in ("A2", "A3"):
        scheduler.add_request(make_request(request_id, PROMPT_A, max_tokens=2))
    so, _ = step(scheduler, worker)
    assert [(new.num_computed_tokens, new.block_ids) for new in so.scheduled_new_reqs] == [
        (8, [0, 1, 2]),
        (8, [3, 4, 5]),
    ]
    assert so.kv_disk.loads == [(A0, 0), (A1, 1), (A0, 3), (A1, 4)]
    scheduler.add_request(make_request("A4", PROMPT_A, max_tokens=2))
    so, _ = step(scheduler, worker)
    (new,) = so.scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids[:2], so.kv_disk.loads) == (8, [0, 1], [])
    run_to_completion(scheduler, worker)
    scheduler.kv_cache_manager.assert_no_leaks()

    lost, lost_worker = _restarted(_flushed_a_b(), num_blocks=12)
    del lost_worker.disk[A1]
    for request_id in ("A2", "A3"):
        lost.add_request(make_request(request_id, PROMPT_A, max_tokens=2))
    so, outputs = step(lost, lost_worker)  # both loaded A1 themselves: both fail, neither reads the other's block
    assert outputs == [] and [request.request_id for request in lost.waiting] == ["A2", "A3"]  # admission order
    result = run_to_completion(lost, lost_worker)
    plain = make_scheduler(num_blocks=12, block_size=BLOCK, max_model_len=16)
    for request_id in ("A2", "A3"):
        plain.add_request(make_request(request_id, PROMPT_A, max_tokens=2))
    assert result.outputs == run_to_completion(plain, make_worker(plain)).outputs
    lost.kv_cache_manager.assert_no_leaks()

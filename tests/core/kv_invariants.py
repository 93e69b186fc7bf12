"""Whole-state invariants of folio/core, checked by the property tests after every step.

Who holds a block, by the design (block_pool.py's docstring): every request whose block list contains it, once per
request. The prefix-cache map holds no reference: a cached block may be free (ref_count 0, in the free queue) and
stays findable until ``get_new_blocks`` reuses it. So ref_count == number of holding requests, exactly, and "free"
means "in the free queue" whether or not the block still carries a hash.

The host tier (core/offload.py) is a second BlockPool with the same invariants; between steps its holders are
exactly the swapped-out requests (one reference per block each; the pins of a step's loads end with schedule()).
The disk tier (core/disk_tier.py) holds at most its capacity, and no pin or store / load plan between steps.
"""

from __future__ import annotations

from collections import Counter

from folio.core.block_pool import BlockPool
from folio.core.kv_cache_manager import KVCacheManager, cdiv
from folio.core.sched_output import SchedulerOutput
from folio.core.scheduler import Scheduler
from folio.request import RequestStatus
from tests.helpers import FakeWorker


def check_block_pool(pool: BlockPool) -> None:
    """Free queue well linked, no duplicates, exactly the blocks with ref_count 0; the hash map a bijection."""
    assert [block.block_id for block in pool.blocks] == list(range(pool.num_blocks))
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = [block.block_id for block in free]
    assert len(free_ids) == len(set(free_ids)), f"block id twice in the free queue: {free_ids}"
    assert len(free) == pool.free_block_queue.num_free_blocks == pool.get_num_free_blocks()
    for index, block in enumerate(free):
        assert block is pool.blocks[block.block_id], f"free queue holds a foreign block {block.block_id}"
        assert block.prev_free_block is (free[index - 1] if index > 0 else None), f"bad prev link {block.block_id}"
    free_set = set(free_ids)
    for block in pool.blocks:
        assert block.ref_count >= 0, f"block {block.block_id} ref_count {block.ref_count}"
        if block.block_id in free_set:
            assert block.ref_count == 0, f"block {block.block_id} is free but held ({block.ref_count} refs)"
        else:
            assert block.ref_count >= 1, f"block {block.block_id} is neither free nor held"
            assert block.prev_free_block is None and block.next_free_block is None, f"{block.block_id} linked"
    num_used = sum(1 for block in pool.blocks if block.ref_count > 0)
    assert num_used + pool.get_num_free_blocks() == pool.num_blocks
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash, f"map entry {block_hash} -> block {block.block_id} has another hash"
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool.cached_block_hash_to_block.get(block.block_hash) is block, f"{block.block_id} hash unmapped"
    if not pool.enable_caching:
        assert not pool.cached_block_hash_to_block


def check_ref_counts(manager: KVCacheManager) -> None:
    """Each block's ref_count is the number of requests whose block list holds it; no list holds a block twice."""
    pool = manager.block_pool
    holders: Counter[int] = Counter()
    for req_id, blocks in manager.req_to_blocks.items():
        ids = [block.block_id for block in blocks]
        assert len(ids) == len(set(ids)), f"{req_id} holds a block twice: {ids}"
        for block in blocks:
            assert block is pool.blocks[block.block_id], f"{req_id} holds a foreign block {block.block_id}"
            holders[block.block_id] += 1
    for block in pool.blocks:
        assert block.ref_count == holders[block.block_id], (
            f"block {block.block_id}: ref_count {block.ref_count}, {holders[block.block_id]} holders"
        )


def check_host_tier(scheduler: Scheduler) -> None:
    """Host pool sound; ref_count = number of swapped requests holding the block; no pin or plan left between
    steps; each swapped request is waiting, holds cdiv(num_computed_tokens, block_size) host blocks, and a hashed
    host block at index i carries the request's hash i."""
    manager = scheduler.kv_cache_manager
    host = manager.host_tier
    if host is None:
        return
    check_block_pool(host.pool)
    assert host.take_plans() == ([], []), "plans left between steps"
    holders: Counter[int] = Counter()
    for req_id, blocks in host.swapped.items():
        request = scheduler.requests[req_id]
        assert request.status == RequestStatus.PREEMPTED and req_id not in manager.req_to_blocks, req_id
        assert len(blocks) == cdiv(request.num_computed_tokens, manager.block_size) > 0, req_id
        for index, block in enumerate(blocks):
            assert block is host.pool.blocks[block.block_id], f"{req_id} holds a foreign host block"
            holders[block.block_id] += 1
            if block.block_hash is not None:
                assert block.block_hash == request.block_hashes[index], f"{req_id} host block {index} hash"
    for block in host.pool.blocks:
        assert block.ref_count == holders[block.block_id], f"host block {block.block_id}: {block.ref_count} refs"


def check_disk_tier(scheduler: Scheduler) -> None:
    """Within capacity; no pin or store / load plan left between steps (deletes may wait for the next step)."""
    disk = scheduler.kv_cache_manager.disk_tier
    if disk is None:
        return
    assert len(disk) <= disk.num_blocks and len(set(disk.hashes())) == len(disk)
    assert disk.find_leaks() == [], disk.find_leaks()


def check_scheduler(scheduler: Scheduler) -> None:
    """Queues, statuses, token counts and block lists of every unfinished request agree with each other."""
    manager = scheduler.kv_cache_manager
    check_block_pool(manager.block_pool)
    check_ref_counts(manager)
    check_host_tier(scheduler)
    check_disk_tier(scheduler)
    config = scheduler.scheduler_config
    block_size = manager.block_size
    running_ids = [request.request_id for request in scheduler.running]
    waiting_ids = [request.request_id for request in scheduler.waiting]
    assert len(running_ids) == len(set(running_ids)), f"running twice: {running_ids}"
    assert len(waiting_ids) == len(set(waiting_ids)), f"waiting twice: {waiting_ids}"
    assert not set(running_ids) & set(waiting_ids), "both running and waiting"
    assert len(running_ids) <= config.max_num_seqs
    fork_waiting = set(scheduler.requests) - set(running_ids) - set(waiting_ids)
    assert len(fork_waiting) == len(scheduler.fork_waitlist), "a request in no queue, or a finished one in one"
    assert set(running_ids) | set(waiting_ids) <= set(scheduler.requests), "a queue holds a forgotten request"
    assert set(manager.req_to_blocks) == set(running_ids), "exactly the running requests hold blocks"
    for request in scheduler.requests.values():
        req_id = request.request_id
        assert scheduler.requests[req_id] is request
        assert not request.is_finished(), f"{req_id} finished but still known"
        assert 0 <= request.num_computed_tokens <= request.num_tokens <= config.max_model_len, (
            f"{req_id}: computed {request.num_computed_tokens}, tokens {request.num_tokens}"
        )
        assert request.num_output_tokens <= request.max_tokens
        if req_id in running_ids:
            assert request.status == RequestStatus.RUNNING
            num_blocks = len(manager.req_to_blocks[req_id])
            expected = cdiv(request.num_computed_tokens, block_size)
            # A forked sibling not scheduled yet shares the whole prompt but recomputes its last token.
            forked = request.fork_of is not None and request.num_computed_tokens == request.num_prompt_tokens - 1
            assert num_blocks == expected or (forked and num_blocks == cdiv(request.num_prompt_tokens, block_size)), (
                f"{req_id}: {num_blocks} blocks for {request.num_computed_tokens} computed tokens"
            )
            _check_hashes_of_held_blocks(scheduler, req_id)
        else:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), f"{req_id} {request.status}"
            swapped = manager.is_swapped_out(req_id)
            assert (request.num_computed_tokens > 0) == swapped, f"waiting {req_id} has computed tokens"
        if req_id in fork_waiting:
            assert request.fork_of is not None and request.status == RequestStatus.WAITING


def _check_hashes_of_held_blocks(scheduler: Scheduler, req_id: str) -> None:
    """A cached block held at index i holds the K/V of the request's block i: its hash is the request's hash i."""
    request = scheduler.requests[req_id]
    for index, block in enumerate(scheduler.kv_cache_manager.req_to_blocks[req_id]):
        if block.block_hash is not None:
            assert index < len(request.block_hashes) and block.block_hash == request.block_hashes[index], (
                f"{req_id} block {index} (id {block.block_id}) carries another prefix's hash"
            )


def check_scheduler_output(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """One step's output is within the budgets and names only running requests, each with its blocks."""
    config = scheduler.scheduler_config
    counts = output.num_scheduled_tokens
    assert output.total_num_scheduled_tokens == sum(counts.values()) <= config.max_num_batched_tokens
    assert len(counts) <= config.max_num_seqs
    assert all(num > 0 for num in counts.values()), counts
    if config.long_prefill_token_threshold > 0:
        assert max(counts.values(), default=0) <= config.long_prefill_token_threshold
    running_ids = {request.request_id for request in scheduler.running}
    assert set(counts) <= running_ids, "scheduled a request that is not running"
    assert not set(counts) & output.preempted_req_ids, "scheduled and preempted in the same step"
    assert not set(counts) & output.finished_req_ids, "scheduled a finished request"
    new_ids = [new.req_id for new in output.scheduled_new_reqs]
    assert sorted(new_ids + output.scheduled_cached_reqs.req_ids) == sorted(counts)
    for new in output.scheduled_new_reqs:
        assert new.block_ids == scheduler.kv_cache_manager.get_block_ids(new.req_id)
    for req_id in counts:
        assert scheduler.requests[req_id].num_computed_tokens <= config.max_model_len


def record_block_tokens(scheduler: Scheduler, tokens_of: dict[int, list[int]]) -> None:
    """Before a schedule(): the tokens of every full block each live request has a hash for (hash -> tokens)."""
    block_size = scheduler.kv_cache_manager.block_size
    for request in scheduler.requests.values():
        tokens = request.all_token_ids
        for index, block_hash in enumerate(request.block_hashes):
            tokens_of[block_hash] = list(tokens[index * block_size : (index + 1) * block_size])


def check_cached_blocks_hold_their_tokens(
    scheduler: Scheduler, worker: FakeWorker, tokens_of: dict[int, list[int]]
) -> None:
    """After a step ran: every block the prefix caches (device and host) can hand out holds, in the FakeWorker's
    cache, the tokens its hash names. Blocks are cached when their step is planned, so a block cached for tokens no
    step wrote (its owner taken out of the step, or a load that failed) fails here even before anyone hits it."""
    manager = scheduler.kv_cache_manager
    pools = [(manager.block_pool, worker.kv, "device")]
    if manager.host_tier is not None:
        pools.append((manager.host_tier.pool, worker.host_kv, "host"))
    for pool, kv, name in pools:
        for block_hash, block in pool.cached_block_hash_to_block.items():
            expected = tokens_of.get(block_hash)
            assert expected is not None, f"{name} block {block.block_id} cached under a hash no request had"
            assert kv[block.block_id] == expected, (
                f"{name} block {block.block_id} cached for {expected} but holds {kv[block.block_id]}"
            )

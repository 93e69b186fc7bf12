"""Received KV blocks as a prefix-cache tier (folio/core/remote_kv.py, the KV cache manager's remote hits) and the
engine core's send plans (folio/kv_transfer/connector.py): exact block ids, hashes and outcomes.

The scheduler-level tests run the FakeWorker (tests/helpers.py): it copies a received block's tokens into the device
block the plan names and reads every request's context back through its block table, so a load into the wrong
block, a hit on a block that never arrived or an off-by-one in the hit length reads back the wrong tokens.
"""

from __future__ import annotations

from folio.config import SchedulerConfig
from folio.core.block_hash import hash_block_tokens, update_request_block_hashes
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.remote_kv import RemoteBlock, RemoteKVStore
from folio.core.sched_output import KVSend, RemoteLoad
from folio.core.scheduler import Scheduler
from folio.kv_transfer.config import KVTransferConfig
from folio.kv_transfer.connector import CoreKVConnector
from tests.helpers import FAKE_FINGERPRINT, FakeWorker, fake_payload, make_request, run_to_completion, step

BLOCK = 4
PROMPT = list(range(1000, 1013))  # 3 full blocks and one token
FP = FAKE_FINGERPRINT


def _chain(tokens: list[int]) -> list[int]:
    hashes: list[int] = []
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[start : start + BLOCK]))
    return hashes


H0, H1, H2 = _chain(PROMPT)


def _received(tokens: list[int], indices: list[int], fingerprint: bytes = FP) -> list[RemoteBlock]:
    """Blocks ``indices`` of ``tokens`` as a producer would send them."""
    hashes = _chain(tokens)
    return [RemoteBlock(hashes[i], fingerprint, fake_payload(tokens[i * BLOCK : (i + 1) * BLOCK])) for i in indices]


def _scheduler(store: RemoteKVStore | None, num_blocks: int = 16, max_num_batched_tokens: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens, max_model_len=64)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK, remote_kv_store=store))


def test_store_is_an_lru_bounded_in_bytes() -> None:
    store = RemoteKVStore(capacity_bytes=24)
    a, b, c, d = (RemoteBlock(h, FP, bytearray(8)) for h in (1, 2, 3, 4))
    assert store.put([a, b, c]) == 3 and store.hashes() == [1, 2, 3] and store.nbytes == 24
    assert store.get(1) is a and store.hashes() == [2, 3, 1]  # a lookup makes it the most recent
    assert store.put([d]) == 1 and store.hashes() == [3, 1, 4]  # full: 2, the least recently used, goes
    assert store.put([RemoteBlock(3, FP, bytearray(8))]) == 1 and store.hashes() == [1, 4, 3]  # replaced
    assert store.put([RemoteBlock(9, FP, bytearray(25))]) == 0 and store.hashes() == [1, 4, 3]  # larger than all
    assert store.pop(1) is a and store.pop(1) is None and (store.nbytes, store.usage) == (16, 16 / 24)
    assert (store.num_received_blocks_total, store.num_received_bytes_total, store.num_evicted_blocks_total) == (
        6,
        8 * 5 + 25,
        1,
    )


def test_remote_hits_continue_the_device_chain_into_fresh_blocks() -> None:
    store = RemoteKVStore(1 << 20)
    manager = KVCacheManager(8, BLOCK, remote_kv_store=store)
    first = make_request("first", PROMPT[:5])  # holds block 0 of PROMPT: a device hit for the next one
    update_request_block_hashes(first, BLOCK)
    assert manager.allocate_slots(first, 5) is not None
    first.num_computed_tokens = 5
    manager.cache_computed_blocks(first)
    assert manager.get_block_ids("first") == [0, 1]

    store.put(_received(PROMPT, [1, 2]))
    request = make_request("r", PROMPT)
    update_request_block_hashes(request, BLOCK)
    computed, num_hit_tokens = manager.get_computed_blocks(request)
    assert ([block.block_id for block in computed], num_hit_tokens) == ([0], 12)  # 1 device block, 2 received
    allocation = manager.allocate_slots(request, 1, computed, num_hit_tokens)
    assert allocation is not None and allocation.new_block_ids == [0, 2, 3, 4]
    loads = manager.take_remote_loads()
    assert [(load.block_hash, load.block_id) for load in loads] == [(H1, 2), (H2, 3)]
    assert all(isinstance(load, RemoteLoad) and load.fingerprint == FP for load in loads)
    assert loads[0].payload == fake_payload(PROMPT[4:8])
    assert len(store) == 0 and manager.take_remote_loads() == []  # taken out of the store, planned once
    remote = manager.remote_tier
    assert remote is not None and remote.num_loaded_blocks_total == 2
    assert (remote.external_prefix_cache_queries, remote.external_prefix_cache_hits) == (13 - 4, 8)


def test_chain_stops_at_the_first_block_not_received() -> None:
    store = RemoteKVStore(1 << 20)
    manager = KVCacheManager(8, BLOCK, remote_kv_store=store)
    store.put(_received(PROMPT, [0, 2]))  # block 1 never arrived: block 2 cannot be used
    request = make_request("r", PROMPT)
    update_request_block_hashes(request, BLOCK)
    computed, num_hit_tokens = manager.get_computed_blocks(request)
    assert (computed, num_hit_tokens) == ([], 4)
    assert manager.allocate_slots(request, 9, computed, num_hit_tokens) is not None
    assert [(load.block_hash, load.block_id) for load in manager.take_remote_loads()] == [(H0, 0)]
    assert store.hashes() == [H2]  # still there, for a request that brings block 1 along


def test_producer_plans_the_send_in_the_step_that_completes_the_prompt() -> None:
    config = KVTransferConfig(kv_connector="TcpConnector", kv_role="kv_producer", kv_port=7000)
    connector = CoreKVConnector(config, BLOCK)
    scheduler = _scheduler(None, max_num_batched_tokens=8)  # the 13-token prompt takes 2 steps: 8, then 5
    worker = FakeWorker(16, BLOCK)
    remote = {"kv_transfer_params": {"do_remote_decode": True, "remote_host": "10.0.0.2", "remote_port": 7001}}
    scheduler.add_request(make_request("p", PROMPT, max_tokens=1, extra_args=remote))
    scheduler.add_request(make_request("plain", list(range(2000, 2009)), max_tokens=1))
    scheduler.add_request(make_request("default", list(range(3000, 3009)), max_tokens=1, extra_args=_decode()))
    sends: list[list[KVSend]] = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        connector.plan_sends(output, scheduler.requests, scheduler.kv_cache_manager.get_block_ids)
        sends.append(output.kv_sends)
        scheduler.update_from_output(output, worker.execute(output))
    # steps: p 8 | p 5, plain 3 | plain 6, default 2 | default 7 (its prompt completes: its 2 full blocks go to the
    # config's consumer; p's blocks went where its kv_transfer_params said)
    assert sends == [
        [],
        [KVSend("p", "10.0.0.2", 7001, [0, 1, 2], [H0, H1, H2])],
        [],
        [KVSend("default", "127.0.0.1", 7000, [7, 8], _chain(list(range(3000, 3009))))],
    ]
    scheduler.kv_cache_manager.assert_no_leaks()


def _decode() -> dict[str, object]:
    return {"kv_transfer_params": {"do_remote_decode": True}}


def test_sibling_samples_and_consumers_plan_no_sends() -> None:
    producer = CoreKVConnector(KVTransferConfig(kv_connector="TcpConnector", kv_role="kv_producer"), BLOCK)
    scheduler = _scheduler(None)
    scheduler.add_request(make_request("p", PROMPT, max_tokens=2, extra_args=_decode()))
    scheduler.add_request(make_request("p-1", PROMPT, max_tokens=2, fork_of="p", extra_args=_decode()))
    output = scheduler.schedule()
    producer.plan_sends(output, scheduler.requests, scheduler.kv_cache_manager.get_block_ids)
    assert output.kv_sends == []  # no port named anywhere: nowhere to send (the server refuses such a request)
    output.num_scheduled_tokens["p-1"] = 1  # as in the step after the fork: a sibling never sends
    named = CoreKVConnector(KVTransferConfig(kv_connector="TcpConnector", kv_role="kv_producer", kv_port=9), BLOCK)
    named.plan_sends(output, scheduler.requests, scheduler.kv_cache_manager.get_block_ids)
    assert [send.req_id for send in output.kv_sends] == ["p"]


def _consume(store: RemoteKVStore | None, request_id: str = "d", max_tokens: int = 5) -> tuple[Scheduler, object]:
    scheduler = _scheduler(store)
    request = make_request(request_id, PROMPT, max_tokens=max_tokens)
    scheduler.add_request(request)
    result = run_to_completion(scheduler, FakeWorker(16, BLOCK))
    return scheduler, (result, request)


def test_consumer_computes_only_the_tail_and_samples_what_a_single_engine_does() -> None:
    _, (reference, ref_request) = _consume(None)
    store = RemoteKVStore(1 << 20)
    store.put(list(reversed(_received(PROMPT, [0, 1, 2]))))  # the receiver puts a message tail first
    scheduler, (result, request) = _consume(store)
    first = result.steps[0]
    assert [(load.block_hash, load.block_id) for load in first.kv_remote_loads] == [(H0, 0), (H1, 1), (H2, 2)]
    assert first.num_scheduled_tokens == {"d": 1}  # the tail: only the last prompt token is computed
    assert result.outputs == reference.outputs and len(result.outputs["d"]) == 5
    assert (request.num_cached_tokens, ref_request.num_cached_tokens) == (12, 0)
    assert len(store) == 0


def test_a_block_of_another_layout_is_recomputed() -> None:
    _, (reference, _) = _consume(None)
    store = RemoteKVStore(1 << 20)
    store.put(_received(PROMPT, [0]) + _received(PROMPT, [1], fingerprint=b"X" * 32) + _received(PROMPT, [2]))
    scheduler, (result, request) = _consume(store)
    first, second = result.steps[0], result.steps[1]
    assert [load.block_id for load in first.kv_remote_loads] == [0, 1, 2]
    # the worker refused block 1: block 0 stays cached, the request comes back as new and computes the rest
    assert second.scheduled_new_reqs[0].num_computed_tokens == 4 and second.num_scheduled_tokens == {"d": 9}
    assert result.outputs == reference.outputs
    assert request.num_cached_tokens == 4 and len(store) == 0


def test_one_step_at_a_time_through_the_helpers() -> None:
    """The FakeWorker's remote loads run after the disk loads and before copy-on-write, within ``step``."""
    store = RemoteKVStore(1 << 20)
    store.put(_received(PROMPT, [0, 1, 2]))
    scheduler = _scheduler(store)
    scheduler.add_request(make_request("d", PROMPT, max_tokens=1))
    output, outputs = step(scheduler, FakeWorker(16, BLOCK))
    assert len(output.kv_remote_loads) == 3 and outputs[0].finished and outputs[0].num_cached_tokens == 12

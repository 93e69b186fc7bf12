"""One-line builders for tests: requests, schedulers, and a fake worker that checks the KV it is handed.

The FakeWorker is a stand-in for the real model runner that keeps the contract honest: it tracks each request's
state only from SchedulerOutput (like the real worker), stores in a fake KV cache the token id of each position
(standing in for its K/V), applies copy-on-write plans, and before "sampling" reads the whole context back through
the block table and asserts it equals the request's tokens. A wrong block id, a missed copy, a prefix hit on
unwritten blocks or an off-by-one in num_computed_tokens fails there. It runs the host tier's plans on its own fake
host blocks (stores, then loads, then copy-on-write, as the real worker), so a wrong store or load plan reads back
the wrong tokens there too. The disk tier's plans run on a fake disk (a dict by block hash, which a test may share
between workers to restart, or edit to lose a file) in the real worker's order; a disk load of a hash the fake disk
lacks fails as in the real worker: the request is left out of the step and reported, and it is dropped (it comes
back as new). Loads of received blocks (disaggregated prefill) carry the block's tokens as ``fake_payload`` bytes and
fail, as in the real worker, unless their fingerprint is ``FAKE_FINGERPRINT``. Sampling is a deterministic function
of (request id, context), so a preempted request must resume producing exactly the same tokens.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from folio.config import SchedulerConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from folio.core.scheduler import Scheduler
from folio.request import FinishReason, Request
from folio.sampling_params import SamplingParams

EOS = 2
FAKE_FINGERPRINT = b"F" * 32  # the FakeWorker's KV layout, for received blocks


def fake_payload(tokens: Sequence[int]) -> bytearray:
    """A received block's bytes for the FakeWorker: its token ids (standing in for their K/V)."""
    return bytearray(struct.pack(f"<{len(tokens)}q", *tokens))


def make_request(
    request_id: str,
    prompt: int | Sequence[int] = 4,
    max_tokens: int = 16,
    *,
    priority: int = 0,
    arrival_time: float | None = None,
    fork_of: str | None = None,
    eos: bool = False,
    **sampling_kwargs: object,
) -> Request:
    """A request; ``prompt`` is a length (tokens 1000, 1001, ...) or the token ids. ``eos``: EOS id 2 stops it."""
    token_ids = list(range(1000, 1000 + prompt)) if isinstance(prompt, int) else list(prompt)
    params = SamplingParams(max_tokens=max_tokens, **sampling_kwargs)  # type: ignore[arg-type]
    if eos:
        params.all_stop_token_ids.add(EOS)
    request = Request(request_id, token_ids, params, max_tokens=max_tokens, priority=priority, fork_of=fork_of)
    if arrival_time is not None:
        request.arrival_time = arrival_time
    return request


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 64,
    policy: str = "fcfs",
    long_prefill_token_threshold: int = 0,
    enable_prefix_caching: bool = True,
    num_host_blocks: int = 0,
    preemption_mode: str | None = None,
    num_disk_blocks: int = 0,
    disk_block_hashes: Sequence[int] = (),
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
        long_prefill_token_threshold=long_prefill_token_threshold,
        preemption_mode=preemption_mode,
    )
    manager = KVCacheManager(
        num_blocks, block_size, enable_prefix_caching, num_host_blocks, num_disk_blocks, disk_block_hashes
    )
    return Scheduler(config, manager)


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int


@dataclass
class FakeWorker:
    """Executes SchedulerOutputs against a fake KV cache (see the module docstring)."""

    num_blocks: int
    block_size: int
    vocab_size: int = 500
    script: dict[str, list[int]] = field(default_factory=dict)  # req_id -> tokens to sample, in order
    requests: dict[str, _WorkerRequest] = field(default_factory=dict)
    num_host_blocks: int = 0
    disk: dict[int, list[int | None]] = field(default_factory=dict)  # block hash -> the block's contents

    def __post_init__(self) -> None:
        self.kv: list[list[int | None]] = [[None] * self.block_size for _ in range(self.num_blocks)]
        self.host_kv: list[list[int | None]] = [[None] * self.block_size for _ in range(self.num_host_blocks)]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent as new but the worker holds it"
            tokens = new.prompt_token_ids + new.output_token_ids
            self.requests[new.req_id] = _WorkerRequest(
                tokens, list(new.block_ids), new.num_computed_tokens, len(new.prompt_token_ids)
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens[i], req_id
            if req_id in cached.num_kept_block_ids:
                del state.block_ids[cached.num_kept_block_ids[req_id] :]
            for index, block_id in cached.replaced_block_ids[i]:
                state.block_ids[index] = block_id
            state.block_ids.extend(cached.new_block_ids[i])
        for block_hash in so.kv_disk.deletes:
            self.disk.pop(block_hash, None)  # a lost file is deleted too
        for store in so.kv_disk.stores:
            assert store.block_hash not in self.disk, f"disk block {store.block_hash:#x} written twice"
            self.disk[store.block_hash] = list((self.kv if store.from_device else self.host_kv)[store.block_id])
        for device_block_id, host_block_id in so.kv_stores:
            self.host_kv[host_block_id] = list(self.kv[device_block_id])
        for host_block_id, device_block_id in so.kv_loads:
            self.kv[device_block_id] = list(self.host_kv[host_block_id])
        failed_blocks, failed_hashes = set(), []
        for block_hash, device_block_id in so.kv_disk.loads:
            if block_hash in self.disk:
                self.kv[device_block_id] = list(self.disk[block_hash])
            else:
                failed_blocks.add(device_block_id)
                failed_hashes.append(block_hash)
        for load in so.kv_remote_loads:
            if load.fingerprint == FAKE_FINGERPRINT and len(load.payload) == 8 * self.block_size:
                self.kv[load.block_id] = list(struct.unpack(f"<{self.block_size}q", load.payload))
            else:
                failed_blocks.add(load.block_id)
        for src, dst in so.block_copies:
            self.kv[dst] = list(self.kv[src])
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        failures = {}
        for req_id in so.num_scheduled_tokens:
            state = self.requests[req_id]
            failed = [i for i, block_id in enumerate(state.block_ids) if block_id in failed_blocks]
            if failed:
                failures[req_id] = failed[0] * self.block_size
        for req_id in failures:  # left out of the step and dropped: it comes back as new
            del self.requests[req_id]
        req_ids, sampled = [], []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            if req_id not in failures:
                self._write(self.requests[req_id], num_tokens)
        for req_id in so.num_scheduled_tokens:
            if req_id not in failures:
                req_ids.append(req_id)
                sampled.append(self._attend_and_sample(req_id, self.requests[req_id]))
        return ModelRunnerOutput(
            req_ids, sampled, [None] * len(req_ids), kv_load_failures=failures, failed_disk_hashes=failed_hashes
        )

    def _write(self, state: _WorkerRequest, num_tokens: int) -> None:
        start = state.num_computed_tokens
        assert start + num_tokens <= len(state.token_ids), "scheduled past the known tokens"
        for pos in range(start, start + num_tokens):
            self.kv[state.block_ids[pos // self.block_size]][pos % self.block_size] = state.token_ids[pos]
        state.num_computed_tokens += num_tokens

    def _attend_and_sample(self, req_id: str, state: _WorkerRequest) -> list[int]:
        context = [
            self.kv[state.block_ids[pos // self.block_size]][pos % self.block_size]
            for pos in range(state.num_computed_tokens)
        ]
        assert context == state.token_ids[: state.num_computed_tokens], f"{req_id}: KV cache holds {context}"
        if state.num_computed_tokens < len(state.token_ids):
            return []  # partial prefill: no sample
        num_sampled = len(state.token_ids) - state.num_prompt_tokens
        if req_id in self.script:
            token_id = self.script[req_id][num_sampled]
        else:
            token_id = 10 + zlib.crc32(repr((req_id, num_sampled, context)).encode()) % self.vocab_size
        state.token_ids.append(token_id)
        return [token_id]


def make_worker(scheduler: Scheduler, **kwargs: object) -> FakeWorker:
    manager = scheduler.kv_cache_manager
    num_host_blocks = manager.host_tier.num_blocks if manager.host_tier is not None else 0
    return FakeWorker(
        manager.num_blocks,
        manager.block_size,
        num_host_blocks=num_host_blocks,
        **kwargs,  # type: ignore[arg-type]
    )


@dataclass
class RunResult:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, FinishReason | None] = field(default_factory=dict)
    stop_reasons: dict[str, int | str | None] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)


def step(scheduler: Scheduler, worker: FakeWorker) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One schedule -> execute -> update_from_output cycle."""
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, worker.execute(so))


def run_to_completion(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 1000) -> RunResult:
    """Step until no request is left, collecting outputs; asserts that no KV block leaked."""
    result = RunResult()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        so, outputs = step(scheduler, worker)
        result.steps.append(so)
        for out in outputs:
            result.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                result.finish_reasons[out.request_id] = out.finish_reason
                result.stop_reasons[out.request_id] = out.stop_reason
    else:
        raise AssertionError(f"not finished after {max_steps} steps")
    scheduler.kv_cache_manager.assert_no_leaks()
    return result

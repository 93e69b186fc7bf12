"""The contracts between the engine core and the worker, both ways, as plain picklable Python.

Down: ``SchedulerOutput`` (what to compute this step). Up: ``ModelRunnerOutput`` (what was sampled).
Out of the core to the frontend: ``EngineCoreOutput``. ``Request`` objects never cross (DESIGN.md convention 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from folio.request import FinishReason
from folio.sampling_params import SamplingParams

if TYPE_CHECKING:
    from folio.core.kv_cache_manager import AllocationResult


@dataclass
class NewRequestData:
    """A request the worker has not seen (or dropped after preemption): sent in full once."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when a preempted request resumes (recompute)
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table for the request
    num_computed_tokens: int  # tokens whose K/V already sit in block_ids (prefix hit / fork)


@dataclass
class CachedRequestData:
    """Diffs for requests the worker already holds, as parallel lists indexed like ``req_ids``."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # appended to the block table
    # (index in the block table, new block id) for blocks replaced by copy-on-write this step
    replaced_block_ids: list[list[tuple[int, int]]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step's tokens
    # req_id -> length the block table is cut to before new_block_ids are appended (blocks that held only rejected
    # drafts' slots were freed: docs/speculative_decoding.md); absent for the others.
    num_kept_block_ids: dict[str, int] = field(default_factory=dict)
    # Pipeline parallelism only (else empty): the token ids at this step's positions, indexed like req_ids (vLLM's
    # name). The stages before the last never sample, so they learn the sampled tokens from here.
    new_token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add(self, req_id: str, num_computed_tokens: int, allocation: AllocationResult) -> None:
        """One scheduled request's diff: its allocation's changes to the block table, where its step starts."""
        self.req_ids.append(req_id)
        self.new_block_ids.append(allocation.new_block_ids)
        self.replaced_block_ids.append(allocation.replaced_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)
        if allocation.num_kept_block_ids is not None:
            self.num_kept_block_ids[req_id] = allocation.num_kept_block_ids


class DiskStore(NamedTuple):
    """Write one block to the disk tier, as the file of ``block_hash``. The source is the host block ``block_id``, or
    (``from_device``) the device block it was stored from in this same step and dropped again before the step ran."""

    block_hash: int
    block_id: int
    from_device: bool = False


@dataclass
class KVDiskPlans:
    """The disk tier's plans for one step (core/disk_tier.py). The worker runs them around the host tier's copies:
    deletes and stores first (a store reads a host block that this step's host stores may overwrite), then the host
    tier's stores and loads, then the disk loads. A hash is never both deleted and stored in one step."""

    stores: list[DiskStore] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (block hash, device block id): disk -> device
    deletes: list[int] = field(default_factory=list)  # block hashes dropped from the tier: their files go

    def __bool__(self) -> bool:
        return bool(self.stores or self.loads or self.deletes)


class RemoteLoad(NamedTuple):
    """Copy a block received from a prefill instance (core/remote_kv.py) into a fresh device block, before the
    forward, after the disk loads. The worker checks ``fingerprint`` and the size against its own KV layout."""

    block_hash: int
    block_id: int  # the device block
    fingerprint: bytes
    payload: bytearray


class KVSend(NamedTuple):
    """After this step's forward, send the request's full prompt blocks (device block ids and their hashes, in
    order) to the consumer at host:port, and wait for its ack (folio/kv_transfer/connector.py plans it)."""

    req_id: str
    host: str
    port: int
    block_ids: list[int]
    block_hashes: list[int]


@dataclass
class KVTransferResult:
    """One step's KV transfers as the worker did them (worker -> core): sends and failed remote loads."""

    num_sent_blocks: int = 0
    num_sent_bytes: int = 0
    send_seconds: float = 0.0  # copying out of the cache, sending, waiting for the acks
    num_failed_sends: int = 0  # requests whose blocks did not reach the consumer (its decode recomputes them)
    num_failed_loads: int = 0  # received blocks the worker could not load (another model or KV layout)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished or aborted since the last step: the worker drops them
    preempted_req_ids: set[str]  # preempted this step: the worker drops them (they come back as new)
    # Copy-on-write plans, executed by the worker before the forward: copy K/V of src block into dst block.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Host KV tier plans (core/offload.py). The worker runs them before the forward in this order: every store,
    # then every load, then block_copies. Stores come first because a device block stored this step (evicted
    # from the prefix cache, or swapped out) may be the destination of a load or a write in the same step.
    kv_stores: list[tuple[int, int]] = field(default_factory=list)  # (device block id, host block id): to host
    kv_loads: list[tuple[int, int]] = field(default_factory=list)  # (host block id, device block id): to device
    kv_disk: KVDiskPlans = field(default_factory=KVDiskPlans)  # the disk tier's plans (empty without one)
    # Disaggregated prefill (folio/kv_transfer/): received blocks to load, finished prompts' blocks to send.
    kv_remote_loads: list[RemoteLoad] = field(default_factory=list)
    kv_sends: list[KVSend] = field(default_factory=list)
    # Structured outputs (folio/structured/manager.py): row i of grammar_bitmask (numpy int32 [rows, ceil(V / 32)],
    # bit set = token allowed) constrains what structured_output_request_ids[i] samples this step. A request with
    # d scheduled drafts has d + 1 consecutive rows (its id d + 1 times): row j is the mask after drafts[:j].
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # Speculative decoding: req_id -> the draft tokens scheduled after its last token (counted in
    # num_scheduled_tokens); the worker verifies them in this step's forward (docs/speculative_decoding.md).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @staticmethod
    def make_empty() -> SchedulerOutput:
        return SchedulerOutput([], CachedRequestData(), {}, 0, set(), set(), [])

    def step_starts(self) -> dict[str, int]:
        """req_id -> the position this step starts at (num_computed_tokens before it), new and cached requests."""
        starts = {req.req_id: req.num_computed_tokens for req in self.scheduled_new_reqs}
        cached = self.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return starts


@dataclass
class LogprobsLists:
    """Logprobs at a run of positions. Row i: the chosen token first, then the top-k by logprob.

    For sampled tokens the chosen token is the sampled one; for prompt logprobs it is the next prompt token.
    """

    token_ids: list[list[int]]  # [num_positions][1 + k]
    logprobs: list[list[float]]  # [num_positions][1 + k]
    ranks: list[int]  # [num_positions] rank of the chosen token (1 = most likely)

    def rows(self, start: int, stop: int | None = None) -> LogprobsLists:
        """Positions [start, stop) of the run."""
        return LogprobsLists(self.token_ids[start:stop], self.logprobs[start:stop], self.ranks[start:stop])


@dataclass
class ModelRunnerOutput:
    """What the worker computed; rows follow ``req_ids``."""

    req_ids: list[str]
    # [] for a request whose scheduled chunk did not reach the end of its tokens (partial prefill)
    sampled_token_ids: list[list[int]]
    logprobs: list[LogprobsLists | None]
    # req_id -> prompt logprobs for the prompt positions computed this step (token i+1 given 0..i)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Disk and remote tiers: requests whose loads failed (a file missing, a block of another model) were left out of the
    # forward and dropped by the worker, as if preempted: req_id -> tokens whose K/V are valid (before the first failed
    # block).
    kv_load_failures: dict[str, int] = field(default_factory=dict)
    failed_disk_hashes: list[int] = field(default_factory=list)  # their block hashes: dropped from the disk index
    # Speculative decoding: req_id -> drafts proposed after this step's tokens, for the next step (may be empty).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    kv_transfer: KVTransferResult | None = None  # disaggregated prefill: this step's sends and failed remote loads
    # Tensor parallelism: the answering rank's wall time in its collectives so far (cumulative seconds); None at tp=1
    collective_seconds: float | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    queue_time: float | None = None  # seconds from arrival to first scheduling

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

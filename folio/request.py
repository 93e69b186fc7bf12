"""Request: the engine-side state of one sequence, owned by the scheduler. Plain Python (no torch).

One user request with n > 1 becomes n Requests here (vLLM's fan-out); the first one computes the prompt and
the others are forked from it (``fork_of``) to share its KV blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from folio.sampling_params import SamplingParams


class FinishReason(enum.Enum):
    """Why a request ended; str() gives the OpenAI / vLLM finish_reason string."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass
class Request:
    """num_tokens = prompt + output so far; num_computed_tokens of them have K/V in the cache (DESIGN.md)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None here (the InputProcessor caps it by max_model_len)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    fork_of: str | None = None  # request id whose prompt blocks this one shares (n > 1 siblings)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first scheduling; -1 until then
    block_hashes: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prompt positions 0..n-1 whose prompt logprobs went out: kept across preemption, whose recompute from
    # position 0 yields those rows again (Scheduler drops them instead of delivering them twice).
    num_prompt_logprobs_delivered: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when first given tokens (queue-time metric)
    # Speculative decoding: drafts proposed by the worker for the next step (docs/speculative_decoding.md).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> FinishReason | None:
        return RequestStatus.get_finish_reason(self.status)

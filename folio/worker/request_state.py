"""The worker's own copy of each request it holds: tokens, block table row, sampling state.

Built from ``NewRequestData`` once and then kept current from ``CachedRequestData`` diffs plus the tokens the
worker itself samples, so the scheduler never has to resend them (except to pipeline stages that do not sample:
``CachedRequestData.new_token_ids``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from folio.core.sched_output import CachedRequestData, NewRequestData
from folio.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    _token_buffer: np.ndarray | None = field(default=None, repr=False, compare=False)  # see token_array
    _num_buffered: int = field(default=0, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_array(self) -> np.ndarray:
        """prompt + output as an int64 array view (n-gram speculation reads it every step). The worker only ever
        appends outputs, so each call copies only what the lists gained since the last one, into a buffer that
        doubles when full: no per-step copy of the whole history."""
        num_tokens, buffer, done = self.num_tokens, self._token_buffer, self._num_buffered
        if buffer is None or len(buffer) < num_tokens:
            grown = np.empty(max(2 * num_tokens, 64), dtype=np.int64)
            if buffer is not None:
                grown[:done] = buffer[:done]
            buffer = self._token_buffer = grown
        if done < num_tokens:
            buffer[done:num_tokens] = self.token_slice(done, num_tokens)
            self._num_buffered = num_tokens
        return buffer[:num_tokens]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without concatenating the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


class RequestStates:
    """req_id -> CachedRequestState, updated by each SchedulerOutput before the step runs."""

    def __init__(self) -> None:
        self.states: dict[str, CachedRequestState] = {}

    def __getitem__(self, req_id: str) -> CachedRequestState:
        return self.states[req_id]

    def __len__(self) -> int:
        return len(self.states)

    def remove(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self.states.pop(req_id, None)

    def add_new(self, new_reqs: list[NewRequestData]) -> None:
        for new in new_reqs:
            self.states[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )

    def apply_diffs(self, cached: CachedRequestData) -> None:
        for i, req_id in enumerate(cached.req_ids):
            state = self.states[req_id]
            if req_id in cached.num_kept_block_ids:
                del state.block_ids[cached.num_kept_block_ids[req_id] :]
            for index, block_id in cached.replaced_block_ids[i]:
                state.block_ids[index] = block_id
            state.block_ids.extend(cached.new_block_ids[i])
            state.num_computed_tokens = cached.num_computed_tokens[i]
            if cached.new_token_ids:  # pipeline parallelism: the tokens a stage that does not sample lacks
                _append_missing_tokens(state, cached.new_token_ids[i])


def _append_missing_tokens(state: CachedRequestState, token_ids: list[int]) -> None:
    """``token_ids`` sit at positions [num_computed_tokens, + len); those past what the state holds are outputs the
    last stage sampled. Example: prompt 5 tokens, outputs [a], step positions [6, 7) = [b] -> outputs [a, b]; the
    last stage (outputs [a, b] already) and prompt chunks (positions inside the prompt) append nothing."""
    num_missing = state.num_computed_tokens + len(token_ids) - state.num_tokens
    if num_missing > 0:
        state.output_token_ids.extend(token_ids[-num_missing:])

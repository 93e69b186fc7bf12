"""Flatten one step's scheduled requests into the model's inputs: ids, positions, slot mapping, block tables.

Rows of the step follow the order of ``SchedulerOutput.num_scheduled_tokens``. Logits are computed only where
they are used: the last row of each request whose chunk reaches the end of its known tokens (it samples), and
the prompt rows of requests that asked for prompt logprobs. A request with k draft tokens (speculative decoding)
has them appended to its query and gets its last k + 1 rows verified instead of one sampled row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from folio.attention.metadata import AttnMetadata
from folio.worker.request_state import CachedRequestState


@dataclass
class PromptLogprobsSlice:
    """Logits rows [start, start + len(target_token_ids)) score the next prompt token at each position."""

    req_id: str
    start: int
    target_token_ids: list[int]


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttnMetadata
    logits_indices: torch.Tensor  # [S + P] int64 rows of the hidden states that need logits
    sample_req_ids: list[str]  # the S requests that sample; their logits are rows [0, S)
    prompt_logprobs: list[PromptLogprobsSlice]  # rows [S, S + P)
    # Speculative decoding: requests with drafts and their drafts; their k + 1 rows each follow, in this order,
    # from row S + P on. Example: drafts {a: [7, 8], b: [9]} -> rows S + P + [0, 1, 2] for a, [3, 4] for b.
    spec_req_ids: list[str] = field(default_factory=list)
    spec_draft_token_ids: list[list[int]] = field(default_factory=list)


def prepare_model_input(
    states: list[CachedRequestState],
    num_scheduled: list[int],
    block_size: int,
    device: torch.device,
    spec_decode_tokens: dict[str, list[int]] | None = None,
) -> ModelInput:
    """Build the flattened batch.

    Example (block_size 4): req A computed 0, scheduled 3 (a prompt of 3);
    req B computed 8, scheduled 1, blocks [5, 2, 7]:
        input positions [0, 1, 2, 8]; query_start_loc [0, 3, 4]; seq_lens [3, 9];
        slot_mapping for B's position 8 -> block_ids[8 // 4] = 7 -> 7 * 4 + 0 = 28.
    """
    num_reqs = len(states)
    num_computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
    counts = np.array(num_scheduled, dtype=np.int64)
    cu_num_tokens = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(counts, out=cu_num_tokens[1:])
    num_tokens = int(cu_num_tokens[-1])
    # num_scheduled [2, 5, 3] -> req_index [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    req_index = np.repeat(np.arange(num_reqs), counts)
    # offset within each request's chunk: [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
    offsets = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu_num_tokens[:-1], counts)
    positions = num_computed[req_index] + offsets
    seq_lens = num_computed + counts

    max_blocks = max(len(s.block_ids) for s in states)
    block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    input_ids = np.empty(num_tokens, dtype=np.int64)
    for i, state in enumerate(states):
        block_table[i, : len(state.block_ids)] = state.block_ids
        start = int(num_computed[i])
        drafts = spec_decode_tokens.get(state.req_id, []) if spec_decode_tokens else []
        known = state.token_slice(start, start + int(counts[i]) - len(drafts))
        input_ids[cu_num_tokens[i] : cu_num_tokens[i + 1]] = known + drafts if drafts else known
    slot_mapping = (
        block_table[req_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )

    sample_rows, sample_req_ids, prompt_slices, prompt_rows = _logits_plan(states, num_computed, counts, cu_num_tokens)
    spec_req_ids: list[str] = []
    spec_draft_token_ids: list[list[int]] = []
    spec_rows: list[int] = []
    if spec_decode_tokens:
        sample_rows, sample_req_ids = _move_spec_rows(
            states, cu_num_tokens, spec_decode_tokens, sample_rows, sample_req_ids, spec_rows
        )
        spec_req_ids = [s.req_id for s in states if spec_decode_tokens.get(s.req_id)]
        spec_draft_token_ids = [spec_decode_tokens[r] for r in spec_req_ids]
    logits_indices = np.array(sample_rows + prompt_rows + spec_rows, dtype=np.int64)

    def to_device(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    attn = AttnMetadata(
        query_start_loc=to_device(cu_num_tokens.astype(np.int32)),
        seq_lens=to_device(seq_lens.astype(np.int32)),
        block_table=to_device(block_table),
        slot_mapping=to_device(slot_mapping),
        max_query_len=int(counts.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=cu_num_tokens.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return ModelInput(
        input_ids=to_device(input_ids),
        positions=to_device(positions),
        attn=attn,
        logits_indices=to_device(logits_indices),
        sample_req_ids=sample_req_ids,
        prompt_logprobs=prompt_slices,
        spec_req_ids=spec_req_ids,
        spec_draft_token_ids=spec_draft_token_ids,
    )


def _move_spec_rows(
    states: list[CachedRequestState],
    cu_num_tokens: np.ndarray,
    spec_decode_tokens: dict[str, list[int]],
    sample_rows: list[int],
    sample_req_ids: list[str],
    spec_rows: list[int],
) -> tuple[list[int], list[str]]:
    """Requests with drafts leave the sampled rows; their last k + 1 rows go to ``spec_rows`` (in batch order)."""
    for i, state in enumerate(states):
        num_drafts = len(spec_decode_tokens.get(state.req_id, ()))
        if num_drafts:
            end = int(cu_num_tokens[i + 1])
            spec_rows.extend(range(end - num_drafts - 1, end))
    kept = [(row, r) for row, r in zip(sample_rows, sample_req_ids, strict=True) if not spec_decode_tokens.get(r)]
    return [row for row, _ in kept], [r for _, r in kept]


def _logits_plan(
    states: list[CachedRequestState],
    num_computed: np.ndarray,
    counts: np.ndarray,
    cu_num_tokens: np.ndarray,
) -> tuple[list[int], list[str], list[PromptLogprobsSlice], list[int]]:
    """Which hidden rows need logits: sampling rows first, then prompt-logprob rows."""
    sample_rows: list[int] = []
    sample_req_ids: list[str] = []
    prompt_rows: list[int] = []
    prompt_slices: list[PromptLogprobsSlice] = []
    for i, state in enumerate(states):
        end = int(num_computed[i] + counts[i])
        if end >= state.num_tokens:
            sample_rows.append(int(cu_num_tokens[i + 1]) - 1)
            sample_req_ids.append(state.req_id)
        wants_prompt_logprobs = state.sampling_params.prompt_logprobs is not None and not state.output_token_ids
        num_prompt = len(state.prompt_token_ids)
        start = int(num_computed[i])
        # position p scores prompt token p + 1, so only positions < num_prompt - 1 have a target
        last = min(end, num_prompt - 1)
        if wants_prompt_logprobs and last > start:
            prompt_slices.append(
                PromptLogprobsSlice(state.req_id, len(prompt_rows), state.prompt_token_ids[start + 1 : last + 1])
            )
            first_row = int(cu_num_tokens[i])
            prompt_rows.extend(range(first_row, first_row + last - start))
    return sample_rows, sample_req_ids, prompt_slices, prompt_rows

"""SamplingMetadata: the per-step sampling tensors for the S rows that sample this step (worker -> sampler).

Built once per step from the rows' SamplingParams. Every optional feature is ``None`` (or empty) when no row in
the batch uses it, so the sampler can skip its work entirely: an all-greedy batch with no penalties, masks or
logprobs costs one [S] tensor to build and one argmax to sample.

Conventions: a tensor field has one entry per row, with a neutral value for rows that do not use the feature
(top_k = V, top_p = 1, min_p = 0, penalties 0 / 0 / 1), so a feature applies to the whole batch in one op.
Token-id lists are padded with ``vocab_size`` (an id one past the vocabulary) and that bin is dropped after
counting. Example (V = 8): outputs [[3, 3], [5]] -> output_token_ids_padded [[3, 3], [5, 8]].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from folio.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """What the sampler needs for S rows; see the module docstring for the neutral values and padding."""

    vocab_size: int  # V, the logits' width; also the padding id of the token-id tensors
    temperature: torch.Tensor  # [S] float32, 0.0 for greedy rows
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [S] float32, 1.0 = off
    top_k: torch.Tensor | None  # [S] int64, vocab_size = off
    min_p: torch.Tensor | None  # [S] float32, 0.0 = off
    presence_penalties: torch.Tensor | None  # [S] float32; None when no row has any penalty
    frequency_penalties: torch.Tensor | None  # [S] float32
    repetition_penalties: torch.Tensor | None  # [S] float32
    # Padded with vocab_size; only filled for rows that need them (penalties), otherwise all padding.
    prompt_token_ids_padded: torch.Tensor | None  # [S, max_prompt_len] int64, None if no repetition penalty
    output_token_ids_padded: torch.Tensor | None  # [S, max_output_len] int64, None if no penalty
    # The live output lists (not copied), read by bad_words and min_tokens.
    output_token_ids: list[list[int]]
    # Row index -> generator, for seeded non-greedy rows only; the generator lives on the logits' device.
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None  # max SamplingParams.logprobs over the rows, None when no row wants logprobs
    num_logprobs: list[int | None]  # [S] per row, to slice the batch's logprobs back per request
    # logit_bias as sparse triples: logits[rows[j], token_ids[j]] += values[j].
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    disallowed_token_mask: torch.Tensor | None  # [S, V] bool, True = banned (allowed_token_ids rows)
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)  # row -> sequences
    min_tokens: dict[int, tuple[int, set[int]]] = field(default_factory=dict)  # row -> (min_tokens, stop ids)
    # Structured outputs: (rows [C] int64, bitmask [C, ceil(V / 32)] int32), bit set = allowed; set by the runner
    # from the scheduler's grammar bitmask (folio/structured/bitmask.py), None when no row is constrained.
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def no_penalties(self) -> bool:
        return self.presence_penalties is None

    @staticmethod
    def build(
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Build the metadata for ``len(params)`` rows; the lists are parallel and indexed by row.

        ``output_token_ids`` lists are kept by reference (the sampler reads their current lengths).
        Each feature is checked with one pass over ``params`` and built only if some row uses it.
        """
        num_rows = len(params)
        greedy = [p.is_greedy for p in params]
        temperature = torch.tensor(
            [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], dtype=torch.float32
        )
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]

        top_p = top_k = min_p = None
        if any(p.top_p < 1.0 for p in random_params):
            top_p = _row_tensor([p.top_p for p in params], torch.float32, device)
        if any(0 < p.top_k < vocab_size for p in random_params):
            top_k = _row_tensor(
                [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64, device
            )
        if any(p.min_p > 0.0 for p in random_params):
            min_p = _row_tensor([p.min_p for p in params], torch.float32, device)

        presence = frequency = repetition = prompt_padded = output_padded = None
        if any(p.has_penalty for p in params):
            presence = _row_tensor([p.presence_penalty for p in params], torch.float32, device)
            frequency = _row_tensor([p.frequency_penalty for p in params], torch.float32, device)
            repetition = _row_tensor([p.repetition_penalty for p in params], torch.float32, device)
            outputs = [out if p.has_penalty else [] for p, out in zip(params, output_token_ids, strict=True)]
            output_padded = _pad_token_ids(outputs, vocab_size, device)
            if any(p.repetition_penalty != 1.0 for p in params):
                prompts = [
                    ids if p.repetition_penalty != 1.0 else [] for p, ids in zip(params, prompt_token_ids, strict=True)
                ]
                prompt_padded = _pad_token_ids(prompts, vocab_size, device)

        num_logprobs = [p.logprobs for p in params]
        requested = [n for n in num_logprobs if n is not None]
        return SamplingMetadata(
            vocab_size=vocab_size,
            temperature=temperature.to(device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            prompt_token_ids_padded=prompt_padded,
            output_token_ids_padded=output_padded,
            output_token_ids=output_token_ids,
            generators={i: g for i, g in enumerate(generators) if g is not None and not greedy[i]},
            max_num_logprobs=max(requested) if requested else None,
            num_logprobs=num_logprobs,
            logit_bias=_build_logit_bias(params, vocab_size, device),
            disallowed_token_mask=_build_disallowed_mask(params, num_rows, vocab_size, device),
            bad_words_token_ids={i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids},
            min_tokens={
                i: (p.min_tokens, p.all_stop_token_ids)
                for i, p in enumerate(params)
                if p.min_tokens > 0 and p.all_stop_token_ids
            },
        )


def _row_tensor(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device)


def _pad_token_ids(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[S, max_len] int64 padded with vocab_size (at least one column so scatter has a shape to work on)."""
    max_len = max((len(r) for r in rows), default=0) or 1
    padded = [r + [vocab_size] * (max_len - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64).to(device)


def _build_logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Sparse (rows, token_ids, values); ids outside the vocabulary are dropped (the input processor rejects them)."""
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            if 0 <= token_id < vocab_size:
                rows.append(i)
                token_ids.append(token_id)
                values.append(bias)
    if not rows:
        return None
    return (
        _row_tensor(rows, torch.int64, device),
        _row_tensor(token_ids, torch.int64, device),
        _row_tensor(values, torch.float32, device),
    )


def _build_disallowed_mask(
    params: list[SamplingParams], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[S, V] bool, True where a row with allowed_token_ids may not sample; rows without the option are all False."""
    restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not restricted:
        return None
    mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
    for i in restricted:
        allowed = [t for t in params[i].allowed_token_ids or [] if 0 <= t < vocab_size]
        mask[i] = True
        mask[i, allowed] = False
    return mask.to(device)

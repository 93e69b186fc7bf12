"""Sampler: logits [S, V] + SamplingMetadata -> one token per row (and its logprobs).

The pipeline, in this order (each step is skipped when no row in the batch uses it):

 0. grammar bitmask (structured outputs): every token the row's grammar forbids is set to -inf, before anything
    else, so raw logprobs, penalties and temperature all see only what the grammar allows (as vLLM, which masks
    the logits before its sampler); applied with plain torch ops (folio/structured/bitmask.py);
 1. raw logprobs, if any row asked for them: log_softmax of the model's logits before any processing
    (vLLM's default ``raw_logprobs``), so what users see does not depend on their sampling knobs;
 2. allowed_token_ids: every other token is set to -inf;
 3. bad_words: the last token of a bad-word sequence is banned when the output ends with the sequence's other
    tokens (a single-token bad word is always banned);
 4. min_tokens: all_stop_token_ids are banned while len(output) < min_tokens;
 5. logit_bias: added to the logits;
 6. penalties, as vLLM applies them: repetition over prompt + output tokens (positive logits divided by it,
    negative multiplied), then frequency (x count in the output) and presence (x seen in the output) subtracted;
 7. greedy rows: argmax of the processed logits;
 8. random rows: temperature, top-k, top-p, min-p, then the exponential race argmax(probs / q), q ~ Exp(1).
    A seeded row draws its q from its own generator alone, so its tokens do not depend on the other rows or on
    its row index; unseeded rows draw from the device's default generator.

Every step is row-independent. The input logits are never modified (processing works on a copy).
Written in device-agnostic torch: the same code runs on CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from folio.sample.logprobs import LogprobsTensors, gather_logprobs
from folio.sample.metadata import SamplingMetadata
from folio.structured.bitmask import apply_token_bitmask_rows

_GREEDY_EPS = 1e-5  # temperature below this is greedy (matches SamplingParams.is_greedy)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [S] int64
    logprobs: LogprobsTensors | None  # [S, 1 + max_num_logprobs], None if no row asked for logprobs


class Sampler:
    """Stateless; one instance serves every step. See the module docstring for the pipeline."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, metadata)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.shape[1] != metadata.vocab_size:
            # The padding id (vocab_size) would otherwise count as a real token in the penalties.
            raise ValueError(
                f"logits have {logits.shape[1]} columns but the metadata vocab_size is {metadata.vocab_size}"
            )
        if metadata.grammar_bitmask is not None:
            logits = apply_token_bitmask_rows(logits, *metadata.grammar_bitmask)  # a masked float32 copy
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [S, V]
        processed = self.process_logits(logits, metadata)
        sampled = self.sample(processed, metadata)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def only_argmax(metadata: SamplingMetadata, grammar_checked_after: bool = False) -> bool:
        """Whether sampling these rows is the argmax of the raw logits (all greedy, no logprobs, nothing that
        changes the logits): then the model may hand over token ids instead of logits
        (LlamaForCausalLM.compute_greedy_token_ids) and the sampler is skipped. A grammar bitmask rules it out,
        unless the caller checks every arg-max against it afterwards (``grammar_checked_after``: the runner does,
        with folio.structured.bitmask.constrained_greedy)."""
        return (
            metadata.all_greedy
            and metadata.max_num_logprobs is None
            and (metadata.grammar_bitmask is None or grammar_checked_after)
            and not _changes_logits(metadata)
        )

    def process_logits(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 2-6 (masks, bias, penalties) on a float32 copy; returns ``logits`` itself when nothing applies."""
        if not _changes_logits(metadata):
            return logits.to(torch.float32)
        logits = logits.to(torch.float32, copy=True)
        if metadata.disallowed_token_mask is not None:
            logits.masked_fill_(metadata.disallowed_token_mask, float("-inf"))
        _ban_tokens(logits, _bad_words_bans(metadata))
        _ban_tokens(logits, _min_tokens_bans(metadata))
        if metadata.logit_bias is not None:
            rows, token_ids, values = metadata.logit_bias
            logits.index_put_((rows, token_ids), values, accumulate=True)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        return logits

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 7-8 on processed logits: [S] int64 token ids."""
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        random = self.sample_random(logits, metadata)
        if greedy is None:
            return random
        return torch.where(metadata.temperature < _GREEDY_EPS, greedy, random)

    def sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, exponential race. Greedy rows get temperature 1 (result unused)."""
        temperature = metadata.temperature
        if not metadata.all_random:
            temperature = torch.where(temperature < _GREEDY_EPS, 1.0, temperature)
        logits = logits / temperature.unsqueeze(1)  # new tensor: the caller's logits stay as they were
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        probs = torch.softmax(logits, dim=-1)
        return exponential_race(probs, metadata.generators)


def _changes_logits(metadata: SamplingMetadata) -> bool:
    """Whether any of steps 2-6 applies to some row."""
    return (
        metadata.disallowed_token_mask is not None
        or bool(metadata.bad_words_token_ids)
        or bool(metadata.min_tokens)
        or metadata.logit_bias is not None
        or not metadata.no_penalties
    )


def _ban_tokens(logits: torch.Tensor, bans: tuple[list[int], list[int]]) -> None:
    """logits[rows[j], token_ids[j]] = -inf for the (rows, token_ids) pairs, in one indexed write."""
    rows, token_ids = bans
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, dtype=torch.int64).to(device), torch.tensor(token_ids, dtype=torch.int64).to(device))
    logits.index_put_(index, torch.tensor(float("-inf"), device=device))


def _bad_words_bans(metadata: SamplingMetadata) -> tuple[list[int], list[int]]:
    """(rows, token_ids) to ban: seq[-1] where the output ends with seq[:-1]. Example: bad word [7, 9] and output
    [..., 7] -> ban 9 this step; bad word [4] -> ban 4 always."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, sequences in metadata.bad_words_token_ids.items():
        past = metadata.output_token_ids[row]
        for seq in sequences:
            prefix_len = len(seq) - 1
            if prefix_len > len(past):
                continue
            if prefix_len == 0 or past[-prefix_len:] == seq[:-1]:
                rows.append(row)
                token_ids.append(seq[-1])
    return rows, token_ids


def _min_tokens_bans(metadata: SamplingMetadata) -> tuple[list[int], list[int]]:
    """(rows, token_ids) to ban: every stop token of a row whose output is still shorter than its min_tokens."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, (min_tokens, stop_token_ids) in metadata.min_tokens.items():
        if len(metadata.output_token_ids[row]) < min_tokens:
            rows.extend([row] * len(stop_token_ids))
            token_ids.extend(stop_token_ids)
    return rows, token_ids


def _token_counts(token_ids_padded: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, L] ids padded with vocab_size -> [S, V] int64 occurrence counts (the padding bin is dropped)."""
    num_rows = token_ids_padded.shape[0]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int64, device=token_ids_padded.device)
    counts.scatter_add_(1, token_ids_padded, torch.ones_like(token_ids_padded))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output, then frequency and presence over the output.

    For a seen token with logit x: x / r if x > 0 else x * r (so r > 1 always makes it less likely); then
    x - frequency * count_in_output - presence * (count_in_output > 0).
    """
    assert metadata.presence_penalties is not None and metadata.frequency_penalties is not None
    assert metadata.repetition_penalties is not None and metadata.output_token_ids_padded is not None
    vocab_size = logits.shape[1]
    output_counts = _token_counts(metadata.output_token_ids_padded, vocab_size)  # [S, V]
    output_mask = output_counts > 0
    if metadata.prompt_token_ids_padded is not None:
        seen = output_mask | (_token_counts(metadata.prompt_token_ids_padded, vocab_size) > 0)
        repetition = torch.where(seen, metadata.repetition_penalties.unsqueeze(1), 1.0)  # [S, V]
        logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * output_counts.to(logits.dtype)
    logits = logits - metadata.presence_penalties.unsqueeze(1) * output_mask.to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what top-k (keep the k largest, ties at the k-th kept) then top-p (keep the smallest set
    whose probability reaches p, the most likely token always kept) leave out. Rows with k = V / p = 1 are unchanged.
    """
    if top_p is None:
        return logits if top_k is None else _apply_top_k_only(logits, top_k)
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # ascending: the kept tokens are at the end
    if top_k is not None:
        # Example: V = 5, k = 2 -> threshold is logits_sort[:, 3], the 2nd largest.
        kth_index = (logits_sort.shape[1] - top_k).unsqueeze(1)  # [S, 1]
        threshold = logits_sort.gather(1, kth_index)
        logits_sort = logits_sort.masked_fill(logits_sort < threshold, float("-inf"))
    probs_sum = torch.softmax(logits_sort, dim=-1).cumsum(dim=-1)
    top_p_mask = probs_sum <= 1 - top_p.unsqueeze(1)  # the low tail whose mass fits in 1 - p
    top_p_mask[:, -1] = False
    logits_sort = logits_sort.masked_fill(top_p_mask, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k without a full sort: topk(max k) gives each row's k-th largest value as its threshold."""
    vocab_size = logits.shape[1]
    no_top_k = top_k >= vocab_size
    k = top_k.masked_fill(no_top_k, 1)
    max_k = int(k.max().item())
    threshold = logits.topk(max_k, dim=1).values.gather(1, (k - 1).unsqueeze(1))  # [S, 1]
    threshold = threshold.masked_fill(no_top_k.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p x the row's top probability (min_p = 0 keeps all)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [S, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample each row from ``probs`` [S, V] as argmax(probs / q), q ~ Exp(1) i.i.d.: equivalent to a categorical
    draw, with no device sync. Row i in ``generators`` draws its V noise values from that generator alone.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # Exp(1) can return exactly 0 (1 - u with u rounding to 1); 0 / 0 would be NaN and win the argmax.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)

"""The worker's side of speculative decoding: verify the scheduled drafts, propose the next ones.

Verification (docs/speculative_decoding.md): row j of a request with k drafts is scored as if the request's output
already ended with drafts d_0 .. d_{j-1}; the target picks its own token t_j at every row, and ``greedy_accept``
keeps the drafts while d_j == t_j, then t_j (a + 1 tokens). Plain greedy requests pick by the fused arg-max (no
logits). The others go through the sampler's pipeline row by row: penalties and bad words see the drafts before the
row as output history, and a seeded request draws row j from ``position_generator(..., n + j)`` as plain decoding
draws output position n + j. For temperature > 0 this is the lossless rule with q one-hot at the draft (n-gram):
t_j ~ p_j, so d_j is accepted with probability p_j(d_j), and after a rejection t_j ~ p_j without d_j, renormalised.
A grammar-constrained request's row j is masked by its grammar after drafts[:j] (the engine core's bitmask rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from folio.core.sched_output import LogprobsLists
from folio.sample.metadata import SamplingMetadata
from folio.sample.rejection_sampler import greedy_accept
from folio.sample.sampler import Sampler
from folio.sample.seeding import position_generator
from folio.spec_decode.eligibility import verifies_by_argmax
from folio.spec_decode.ngram_proposer import NgramProposer
from folio.structured.bitmask import bitmask_for_rows, constrained_greedy
from folio.worker.input_batch import ModelInput
from folio.worker.request_state import CachedRequestState, RequestStates

TokensAndLogprobs = dict[str, tuple[list[int], LogprobsLists | None]]


def verify_drafts(
    spec_rows: torch.Tensor,
    model_input: ModelInput,
    requests: RequestStates,
    greedy_token_ids: Callable[[torch.Tensor], torch.Tensor],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    sampler: Sampler,
    vocab_size: int,
    grammar_req_ids: list[str] | None = None,
    grammar_bitmask: np.ndarray | None = None,
    argmax_ids: torch.Tensor | None = None,
) -> TokensAndLogprobs:
    """spec_rows [sum(k_i + 1), hidden] in ``model_input.spec_req_ids`` order -> req_id -> (accepted drafts + one
    token, their logprobs or None); each request's copy gets the tokens appended. ``grammar_req_ids`` /
    ``grammar_bitmask``: the step's structured-output rows (a constrained request's k + 1 rows in a row, row j
    the mask after drafts[:j]), applied to row j of that request: by constrained_greedy on the fused arg-max
    (logits only for rows whose arg-max the grammar bans), or as the sampler's first stage. ``argmax_ids``: the
    fused arg-max of every row of ``spec_rows`` when the caller already ran it (with the undrafted rows)."""
    states = [requests[req_id] for req_id in model_input.spec_req_ids]
    drafts = model_input.spec_draft_token_ids
    starts = [0]  # request i's rows are [starts[i], starts[i + 1])
    for request_drafts in drafts:
        starts.append(starts[-1] + len(request_drafts) + 1)
    by_argmax: list[int] = []  # request indices verified by the fused arg-max
    by_sampler: list[int] = []  # ... by the sampler's pipeline
    for i, state in enumerate(states):
        (by_argmax if verifies_by_argmax(state.sampling_params) else by_sampler).append(i)
    targets: list[list[int]] = [[] for _ in states]  # the target's own token at each of a request's rows

    def grammar_rows(chosen: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        ids, counts = [states[i].req_id for i in chosen], [len(drafts[i]) + 1 for i in chosen]
        return bitmask_for_rows(ids, grammar_req_ids or [], grammar_bitmask, spec_rows.device, counts)

    row_logprobs: dict[int, LogprobsLists] = {}  # request index -> logprobs at its k + 1 rows
    if by_argmax:
        rows = _select_rows(spec_rows, starts, by_argmax)
        token_ids = greedy_token_ids(rows) if argmax_ids is None else _select_rows(argmax_ids, starts, by_argmax)
        mask = grammar_rows(by_argmax)
        if mask is not None:  # exact per row: the arg-max where the grammar allows it, else masked logits' arg-max
            token_ids = constrained_greedy(token_ids, mask, lambda r: compute_logits(rows.index_select(0, r)))
        _split(token_ids.tolist(), [len(drafts[i]) + 1 for i in by_argmax], by_argmax, targets)
    if by_sampler:
        logits = compute_logits(_select_rows(spec_rows, starts, by_sampler))  # [rows of these requests, V]
        chosen = [states[i] for i in by_sampler]
        metadata = _draft_rows_metadata(chosen, [drafts[i] for i in by_sampler], vocab_size, logits.device)
        metadata.grammar_bitmask = grammar_rows(by_sampler)  # the sampler's first stage, row by row
        out = sampler.forward(logits, metadata)
        counts = [len(drafts[i]) + 1 for i in by_sampler]
        _split(out.sampled_token_ids.tolist(), counts, by_sampler, targets)
        if out.logprobs is not None:
            _split_logprobs(out.logprobs.tolists(), counts, by_sampler, states, row_logprobs)
    result: TokensAndLogprobs = {}
    for i, tokens in enumerate(greedy_accept(drafts, targets)):
        states[i].output_token_ids.extend(tokens)
        logprobs = row_logprobs.get(i)
        result[states[i].req_id] = (tokens, None if logprobs is None else logprobs.rows(0, len(tokens)))
    return result


def _select_rows(spec_rows: torch.Tensor, starts: list[int], requests: list[int]) -> torch.Tensor:
    """The rows of the given requests (indices into spec_req_ids), in that order; all rows when it is everyone."""
    if len(requests) == len(starts) - 1:
        return spec_rows
    index = [row for i in requests for row in range(starts[i], starts[i + 1])]
    return spec_rows.index_select(0, torch.tensor(index, dtype=torch.int64, device=spec_rows.device))


def _split(values: list[int], counts: list[int], requests: list[int], out: list[list[int]]) -> None:
    """Consecutive runs of ``values`` (``counts[m]`` long) to ``out[requests[m]]``."""
    start = 0
    for i, count in zip(requests, counts, strict=True):
        out[i] = values[start : start + count]
        start += count


def _split_logprobs(
    lists: LogprobsLists,
    counts: list[int],
    requests: list[int],
    states: list[CachedRequestState],
    out: dict[int, LogprobsLists],
) -> None:
    """As ``_split`` for the logprobs rows of the requests that want logprobs, each row cut to the request's own
    number of top logprobs (the chosen token first, then the top k)."""
    start = 0
    for i, count in zip(requests, counts, strict=True):
        k = states[i].sampling_params.logprobs
        if k is not None:
            rows = lists.rows(start, start + count)
            out[i] = LogprobsLists(
                [t[: 1 + k] for t in rows.token_ids], [v[: 1 + k] for v in rows.logprobs], rows.ranks
            )
        start += count


def _draft_rows_metadata(
    states: list[CachedRequestState], drafts: list[list[int]], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Sampling metadata for every row of these requests: row j of a request is its output position n + j, with
    output history output + drafts[:j] (penalties, bad words, min_tokens) and, if seeded, the generator of n + j.
    Example: output [5, 6], drafts [7, 8] -> rows with outputs [5, 6], [5, 6, 7], [5, 6, 7, 8] at positions 2, 3, 4.
    A request that reads no history shares its output list over its rows (no copy of a long output per row)."""
    params, prompts, outputs, generators = [], [], [], []
    for state, request_drafts in zip(states, drafts, strict=True):
        num_output = len(state.output_token_ids)
        reads_history = state.sampling_params.reads_output_history
        for j in range(len(request_drafts) + 1):
            params.append(state.sampling_params)
            prompts.append(state.prompt_token_ids)
            outputs.append(state.output_token_ids + request_drafts[:j] if reads_history else state.output_token_ids)
            generators.append(position_generator(state.sampling_params, num_output + j, device))
    return SamplingMetadata.build(params, prompts, outputs, generators, vocab_size, device)


def propose_drafts(proposer: NgramProposer, req_ids: Iterable[str], requests: RequestStates) -> dict[str, list[int]]:
    """Drafts for the requests that got tokens this step (every request may speculate). A constrained
    request's drafts are checked against its grammar in the engine core, before they are scheduled."""
    drafts: dict[str, list[int]] = {}
    for req_id in req_ids:
        state = requests[req_id]
        proposal = proposer.propose(state.token_array())
        if proposal:
            drafts[req_id] = proposal
    return drafts

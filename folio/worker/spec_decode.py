"""The worker's side of speculative decoding: verify the scheduled drafts, propose the next ones.

Verification (greedy, the first cut): the target's arg-max at each of a request's k + 1 rows, then
``greedy_accept``. Proposals: the n-gram proposer over each eligible request's tokens after this step's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from folio.sample.rejection_sampler import greedy_accept
from folio.spec_decode.eligibility import can_speculate
from folio.spec_decode.ngram_proposer import NgramProposer
from folio.worker.input_batch import ModelInput
from folio.worker.request_state import RequestStates


def verify_greedy(
    spec_rows: torch.Tensor,
    model_input: ModelInput,
    requests: RequestStates,
    greedy_token_ids: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, list[int]]:
    """spec_rows [sum(k_i + 1), hidden] in ``model_input.spec_req_ids`` order -> req_id -> accepted drafts + one
    token; each request's copy gets the tokens appended."""
    targets = greedy_token_ids(spec_rows).tolist()  # [sum(k_i + 1)]
    per_request: list[list[int]] = []
    start = 0
    for drafts in model_input.spec_draft_token_ids:
        per_request.append(targets[start : start + len(drafts) + 1])
        start += len(drafts) + 1
    result: dict[str, list[int]] = {}
    for req_id, tokens in zip(
        model_input.spec_req_ids, greedy_accept(model_input.spec_draft_token_ids, per_request), strict=True
    ):
        requests[req_id].output_token_ids.extend(tokens)
        result[req_id] = tokens
    return result


def propose_drafts(
    proposer: NgramProposer, req_ids: Iterable[str], requests: RequestStates, excluded: Iterable[str]
) -> dict[str, list[int]]:
    """Drafts for the requests that got tokens this step and may speculate (``can_speculate``, not excluded)."""
    skip = set(excluded)
    drafts: dict[str, list[int]] = {}
    for req_id in req_ids:
        state = requests[req_id]
        if req_id in skip or not can_speculate(state.sampling_params):
            continue
        proposal = proposer.propose(state.prompt_token_ids + state.output_token_ids)
        if proposal:
            drafts[req_id] = proposal
    return drafts

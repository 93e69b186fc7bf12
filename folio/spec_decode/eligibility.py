"""Which requests get drafts, and which of them are verified by the fused arg-max (docs/speculative_decoding.md).

Every request may speculate, grammar-constrained ones too: the engine core cuts their drafts at the first token the
grammar refuses before scheduling them, and masks each verified row by the grammar after the drafts before it
(folio/structured/manager.py).
Verification runs the sampler's whole pipeline on every draft row (penalties, bias, masks, temperature, top-k/p,
logprobs), with each row's output history extended by the drafts before it. Plain greedy requests (nothing changes
their logits, no logprobs) skip it: the arg-max of the raw logits at every row, without materialising them.
"""

from __future__ import annotations

from folio.sampling_params import SamplingParams


def verifies_by_argmax(params: SamplingParams) -> bool:
    """Greedy, no logprobs and nothing that changes the logits: the target's token is the raw logits' arg-max."""
    return params.is_greedy and params.logprobs is None and not params.changes_logits

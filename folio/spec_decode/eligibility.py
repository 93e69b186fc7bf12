"""Which requests get drafts: those whose verification is the plain rule (docs/speculative_decoding.md).

First cut: greedy requests whose logits nothing changes (no penalties, bias, masks, bad words, min_tokens), that
want no logprobs and no grammar. Their verification is the arg-max of the raw logits at every draft position.
The others decode one token per step, unchanged, in the same batch.
"""

from __future__ import annotations

from folio.sampling_params import SamplingParams


def can_speculate(params: SamplingParams) -> bool:
    return (
        params.is_greedy
        and params.logprobs is None
        and params.structured_outputs is None
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words_token_ids
        and params.min_tokens == 0
    )

"""N-gram proposer (prompt lookup): the request's own tokens predict what comes next when its text repeats.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min, longest first) are looked up earlier in
the request's tokens (prompt + output); at the earliest match the up to k tokens that followed it are proposed.
The same choice as vLLM's ``NgramProposer`` (longest n, then earliest position). Pure numpy, no engine state.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """``propose(token_ids)`` -> up to ``num_speculative_tokens`` draft token ids (empty when nothing matches)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_num_tokens: int | None = None) -> list[int]:
        """Drafts for a request whose tokens so far are ``token_ids``; at most ``max_num_tokens`` (the caller's
        room: max_model_len, max_tokens) when given.

        Example (min 2, max 3, k 4): tokens [1, 2, 3, 4, 2, 3]: the suffix [4, 2, 3] occurs nowhere earlier;
        [2, 3] occurs at position 1, followed by [4, 2, 3] -> proposes [4, 2, 3] (only 3 tokens follow it).
        """
        k = self.k if max_num_tokens is None else min(self.k, max_num_tokens)
        tokens = np.asarray(token_ids)
        num_tokens = len(tokens)
        max_n = min(self.max_n, num_tokens - 1)
        if k <= 0 or max_n < self.min_n:
            return []
        # A match is a window ending at e <= num_tokens - 2 (a token follows it; it may overlap the suffix). Only
        # the positions that hold the last token can end one: one pass over the tokens finds them, then each
        # candidate's match length grows backwards, one vector op per n over the (few) candidates. The whole
        # search is one comparison over the history, not one per n (2000 tokens: 198 -> 16 us a proposal,
        # benchmarks/ngram_proposer.py).
        ends = np.flatnonzero(tokens[: num_tokens - 1] == tokens[-1])
        length = np.ones(len(ends), dtype=np.int64)  # matched tokens so far, counted back from each end
        still = np.ones(len(ends), dtype=bool)
        for j in range(1, max_n):
            before = ends - j
            still &= before >= 0
            still[still] = tokens[before[still]] == tokens[num_tokens - 1 - j]
            length += still
        for n in range(max_n, self.min_n - 1, -1):
            hits = np.flatnonzero(length >= n)
            if len(hits):  # the earliest end of an n-gram match is its earliest start
                start = int(ends[hits[0]]) + 1
                return [int(t) for t in tokens[start : start + k]]
        return []

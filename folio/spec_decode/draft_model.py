"""The draft-model method's bookkeeping (docs/speculative_decoding.md): which positions of a request the draft
model's own KV cache holds, how many drafts it may propose, and the check that it shares the target's vocabulary.
Pure Python; ``folio/worker/draft_runner.py`` runs the model.

The draft's KV cache lives under the target's block tables (same block ids, same slots), so a position's draft K/V
is valid exactly when the draft computed it for the request's real token there, with valid K/V before it. After a
step the draft has computed every known token of a request (positions < N) and, for its proposals d_0 .. d_{k-1},
written the K/V of d_0 .. d_{k-2} at positions N .. N + k - 2. Once the target has verified them, those of the
accepted drafts were the request's tokens after all (``DraftProgress.confirm``); the rest are recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class DraftProgress:
    """One request's state in the draft model's KV cache."""

    num_computed_tokens: int  # positions 0 .. n - 1 hold the draft's K/V of the request's own tokens
    fed_token_ids: list[int] = field(default_factory=list)  # drafts whose K/V follow them, in position order

    def confirm(self, known_token_ids: Sequence[int]) -> None:
        """``known_token_ids``: the request's tokens from position num_computed_tokens on, as far as known now. The
        fed drafts that match them (a prefix) were its tokens: their K/V count as computed; the others are dropped.

        Example: 10 computed, fed [7, 8, 9]; the target accepted 7, 8 and then gave 5 -> tokens from 10 on are
        [7, 8, 5] -> 12 computed (position 12, where 9 was fed, is recomputed with 5)."""
        num_matching = 0
        for fed, known in zip(self.fed_token_ids, known_token_ids, strict=False):
            if fed != known:
                break
            num_matching += 1
        self.num_computed_tokens += num_matching
        self.fed_token_ids = []


def num_drafts_to_propose(
    num_speculative_tokens: int, num_tokens: int, max_model_len: int, max_tokens: int | None, num_output_tokens: int
) -> int:
    """Drafts worth proposing for a request with ``num_tokens`` tokens: k, cut as the scheduler would cut them, by
    max_model_len (drafts take positions num_tokens ..) and by max_tokens (the last draft's bonus token must still be
    allowed: at most max_tokens - outputs - 1 drafts). Example: k 4, 60 tokens, max_model_len 62 -> 2."""
    room = max_model_len - num_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - num_output_tokens - 1)
    return max(0, min(num_speculative_tokens, room))


def check_draft_vocab(draft_path: str, draft_vocab_size: int, target_vocab_size: int) -> None:
    """A draft proposes token ids the target verifies: both must use the same tokenizer, so the same vocabulary."""
    if draft_vocab_size != target_vocab_size:
        raise ValueError(
            f"speculative_config.model {draft_path!r} has a vocabulary of {draft_vocab_size} tokens, the target "
            f"{target_vocab_size}: the draft model must use the target's tokenizer"
        )

"""The draft-model method's bookkeeping (folio/spec_decode/draft_model.py): which positions of the draft's cache
hold a request's tokens after verification, how many drafts are worth proposing, the vocabulary check."""

from __future__ import annotations

import pytest

from folio.spec_decode.draft_model import DraftProgress, check_draft_vocab, num_drafts_to_propose


@pytest.mark.parametrize(
    ("fed", "known", "computed"),
    [
        ([7, 8, 9], [7, 8, 5, 6], 12),  # 7, 8 accepted, 9 rejected: its slot is recomputed
        ([7, 8, 9], [7, 8, 9, 4, 1], 13),  # all accepted (and the bonus 4 after them, never fed)
        ([7, 8, 9], [5], 10),  # the first rejected
        ([7, 8, 9], [7], 11),  # only as far as known (the scheduler cut the drafts)
        ([], [3, 4], 10),  # nothing fed
    ],
)
def test_confirm_counts_the_fed_drafts_that_were_accepted(fed: list[int], known: list[int], computed: int) -> None:
    progress = DraftProgress(10, list(fed))
    progress.confirm(known)
    assert (progress.num_computed_tokens, progress.fed_token_ids) == (computed, [])


def test_num_drafts_to_propose_cuts_as_the_scheduler() -> None:
    assert num_drafts_to_propose(4, 10, 64, None, 3) == 4
    assert num_drafts_to_propose(4, 60, 62, None, 3) == 2  # drafts at positions 60, 61
    assert num_drafts_to_propose(4, 62, 62, None, 3) == 0
    assert num_drafts_to_propose(4, 10, 64, 6, 3) == 2  # 3 outputs of 6: 2 drafts + the bonus token
    assert num_drafts_to_propose(4, 10, 64, 4, 3) == 0


def test_vocabularies_must_match() -> None:
    check_draft_vocab("d", 49152, 49152)
    with pytest.raises(
        ValueError, match=r"speculative_config.model 'd' has a vocabulary of 96 tokens, the target 49152"
    ):
        check_draft_vocab("d", 96, 49152)

"""NgramProposer: exact proposals (longest n first, earliest match, k and the caller's cap), and agreement with a
brute-force reference on random token lists."""

from __future__ import annotations

import random

import numpy as np
import pytest

from folio.spec_decode.ngram_proposer import NgramProposer


def test_docstring_example() -> None:
    assert NgramProposer(4, 2, 3).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_longest_ngram_wins_over_a_shorter_earlier_one() -> None:
    # suffix [5, 6, 7]: the 2-gram [6, 7] occurs first at 1 (followed by 9), the 3-gram [5, 6, 7] at 4 (-> 8)
    tokens = [0, 6, 7, 9, 5, 6, 7, 8, 1, 5, 6, 7]
    assert NgramProposer(2, 2, 3).propose(tokens) == [8, 1]
    assert NgramProposer(2, 2, 2).propose(tokens) == [9, 5]  # max 2: only 2-grams, the earliest


def test_earliest_occurrence_among_equal_lengths() -> None:
    assert NgramProposer(1, 2, 2).propose([3, 4, 10, 3, 4, 11, 3, 4]) == [10]


def test_k_caps_and_fewer_tokens_follow() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert NgramProposer(3, 2, 2).propose(tokens) == [3, 4, 5]
    assert NgramProposer(10, 2, 2).propose(tokens) == [3, 4, 5, 6, 1, 2]  # up to the end
    assert NgramProposer(3, 2, 2).propose(tokens, max_num_tokens=1) == [3]
    assert NgramProposer(3, 2, 2).propose(tokens, max_num_tokens=0) == []


def test_match_may_overlap_the_suffix() -> None:
    # [7, 7, 7, 7]: the 3-gram suffix [7, 7, 7] matches at 0 (ends before the last token) and is followed by 7
    assert NgramProposer(2, 1, 3).propose([7, 7, 7, 7]) == [7]
    assert NgramProposer(2, 1, 3).propose([7, 7, 7, 7, 7]) == [7, 7]


def test_no_proposal() -> None:
    proposer = NgramProposer(3, 2, 4)
    assert proposer.propose([1, 2, 3, 4, 5]) == []  # nothing repeats
    assert proposer.propose([9]) == []
    assert proposer.propose([]) == []
    assert proposer.propose([1, 2, 1]) == []  # only a 1-gram repeats, min is 2
    assert NgramProposer(3, 1, 4).propose([1, 2, 1]) == [2, 1]


def test_numpy_input_and_python_ints_out() -> None:
    out = NgramProposer(2, 1, 2).propose(np.array([5, 6, 5], dtype=np.int32))
    assert out == [6, 5] and all(type(t) is int for t in out)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        NgramProposer(2, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        NgramProposer(0, 1, 2)


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force over n (longest first) and start (earliest first)."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(tokens) - 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_matches_brute_force_on_random_token_lists() -> None:
    rng = random.Random(19)
    for _ in range(3000):
        vocab = rng.choice([2, 4, 50])  # few tokens: many candidate positions, long partial matches
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, rng.choice([30, 300])))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        assert NgramProposer(k, min_n, max_n).propose(tokens) == _reference(tokens, k, min_n, max_n), tokens

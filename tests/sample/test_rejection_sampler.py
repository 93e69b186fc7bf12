"""Rejection sampler: exact greedy outcomes; for temperature > 0 the emitted tokens follow the target's
distribution (chi-square on a small vocabulary, many samples, fixed seeds), for one-hot (n-gram) and for
sampled draft distributions; the test rejects a wrong rule; seeded draws are reproducible."""

from __future__ import annotations

import pytest
import torch

from folio.sample.rejection_sampler import draw_uniforms_and_noise, greedy_accept, rejection_sample
from folio.sample.sampler import exponential_race

CPU = torch.device("cpu")
P0 = [0.05, 0.10, 0.15, 0.20, 0.20, 0.30]  # the target at the first position
P1 = [0.40, 0.05, 0.05, 0.10, 0.30, 0.10]  # ... at the second (after the first draft)
P2 = [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]  # ... the bonus row after two drafts
Q0 = [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]  # a draft model's distribution at the first position
CHI2_CRIT_DF5 = 20.515  # chi-square critical value, 5 degrees of freedom, alpha = 0.001


def chi_square(tokens: list[int], probs: list[float]) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = torch.tensor(probs, dtype=torch.float64) * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


# ------------------------------------------------------------------------------------------------ greedy


def test_greedy_accept_exact() -> None:
    drafts = [[5, 6, 7], [5], [1, 2], [], [3, 3]]
    targets = [[5, 6, 9, 4], [5, 8], [0, 2, 2], [11], [3, 3, 3]]
    assert greedy_accept(drafts, targets) == [[5, 6, 9], [5, 8], [0], [11], [3, 3, 3]]


def test_greedy_accept_checks_lengths() -> None:
    with pytest.raises(ValueError, match="2 drafts need 3 target tokens, got 2"):
        greedy_accept([[1, 2]], [[1, 2]])


# ------------------------------------------------------------------------------------------ temperature > 0


def _batch(num_requests: int, drafts: list[int], rows: list[list[float]]) -> tuple[torch.Tensor, list[list[int]]]:
    """num_requests identical requests with the same drafts and target rows (len(drafts) + 1 of them)."""
    probs = torch.tensor(rows, dtype=torch.float32).repeat(num_requests, 1)
    return probs, [list(drafts) for _ in range(num_requests)]


@pytest.mark.parametrize("draft", [5, 0])  # the target's most likely token, and an unlikely one
def test_ngram_drafts_leave_the_target_distribution_unchanged(draft: int) -> None:
    """Two one-hot drafts [draft, 4]: the first token ~ P0; where the first draft was accepted, the second ~ P1."""
    torch.manual_seed(1)
    num = 40_000
    probs, drafts = _batch(num, [draft, 4], [P0, P1, P2])
    uniforms, noise = draw_uniforms_and_noise(len(probs), 6, {}, CPU)
    out = rejection_sample(probs, drafts, None, uniforms, noise)
    assert all(1 <= len(tokens) <= 3 for tokens in out)
    assert chi_square([tokens[0] for tokens in out], P0) < CHI2_CRIT_DF5
    second = [tokens[1] for tokens in out if tokens[0] == draft]
    assert len(second) > 1000
    assert chi_square(second, P1) < CHI2_CRIT_DF5
    # The statistic has power: a rule that accepts every draft with p > 0 (all uniforms 0) emits the draft.
    always = rejection_sample(probs, drafts, None, torch.zeros_like(uniforms), noise)
    assert chi_square([tokens[0] for tokens in always], P0) > 10 * CHI2_CRIT_DF5
    # The first draft is accepted with probability P0[draft] (q one-hot): a binomial within 5 sigma.
    rate = P0[draft]
    sigma = (rate * (1 - rate) / num) ** 0.5
    assert abs(sum(tokens[0] == draft and len(tokens) > 1 for tokens in out) / num - rate) < 5 * sigma


@pytest.mark.parametrize("draft", [5, 0])
def test_sampled_targets_with_matching_prefix_leave_the_target_distribution_unchanged(draft: int) -> None:
    """The engine's form for one-hot drafts: every row sampled as plain decoding samples it (the exponential race),
    then greedy_accept. First token ~ P0, the second ~ P1 where the first draft was accepted, acceptance ~ P0[d]."""
    torch.manual_seed(6)
    num = 40_000
    probs, drafts = _batch(num, [draft, 4], [P0, P1, P2])
    targets = exponential_race(probs, {}).view(num, 3).tolist()
    out = greedy_accept(drafts, targets)
    assert chi_square([tokens[0] for tokens in out], P0) < CHI2_CRIT_DF5
    second = [tokens[1] for tokens in out if tokens[0] == draft]
    assert len(second) > 1000
    assert chi_square(second, P1) < CHI2_CRIT_DF5
    rate = P0[draft]
    sigma = (rate * (1 - rate) / num) ** 0.5
    assert abs(sum(tokens[0] == draft and len(tokens) > 1 for tokens in out) / num - rate) < 5 * sigma
    # The statistic has power: taking the arg-max of p (greedy) at every row is far from P0.
    greedy = greedy_accept(drafts, probs.argmax(dim=-1).view(num, 3).tolist())
    assert chi_square([tokens[0] for tokens in greedy], P0) > 10 * CHI2_CRIT_DF5


def test_draft_model_drafts_leave_the_target_distribution_unchanged() -> None:
    """Drafts sampled from Q0 with q given: the emitted first token ~ P0."""
    generator = torch.Generator().manual_seed(2)
    num = 40_000
    q = torch.tensor(Q0).repeat(num, 1)
    draft_tokens = torch.multinomial(q, 1, generator=generator).squeeze(1).tolist()
    probs = torch.tensor([P0, P1], dtype=torch.float32).repeat(num, 1)
    torch.manual_seed(3)
    uniforms, noise = draw_uniforms_and_noise(len(probs), 6, {}, CPU)
    out = rejection_sample(probs, [[t] for t in draft_tokens], q, uniforms, noise)
    assert chi_square([tokens[0] for tokens in out], P0) < CHI2_CRIT_DF5
    # The statistic has power: claiming the wrong q (uniform) for drafts drawn from Q0 biases the output
    # (expected statistic ~5600 here). (One-hot q is right for any way of choosing the draft: n-gram's case.)
    wrong_q = torch.full_like(q, 1 / 6)
    wrong = rejection_sample(probs, [[t] for t in draft_tokens], wrong_q, uniforms, noise)
    assert chi_square([tokens[0] for tokens in wrong], P0) > 10 * CHI2_CRIT_DF5


def test_draft_with_zero_target_probability_is_never_accepted() -> None:
    torch.manual_seed(4)
    p = [0.0, 0.2, 0.2, 0.2, 0.2, 0.2]
    probs, drafts = _batch(20_000, [0], [p, P1])
    uniforms, noise = draw_uniforms_and_noise(len(probs), 6, {}, CPU)
    out = rejection_sample(probs, drafts, None, uniforms, noise)
    assert all(len(tokens) == 1 and tokens[0] != 0 for tokens in out)
    assert chi_square([tokens[0] for tokens in out], [1e-12, 0.2, 0.2, 0.2, 0.2, 0.2]) < CHI2_CRIT_DF5


def test_certain_draft_is_always_accepted_and_the_bonus_follows() -> None:
    torch.manual_seed(5)
    onehot = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    probs, drafts = _batch(2_000, [2], [onehot, P2])
    uniforms, noise = draw_uniforms_and_noise(len(probs), 6, {}, CPU)
    out = rejection_sample(probs, drafts, None, uniforms, noise)
    assert all(len(tokens) == 2 and tokens[0] == 2 for tokens in out)
    assert chi_square([tokens[1] for tokens in out], P2) < CHI2_CRIT_DF5


def test_mixed_draft_counts_row_layout() -> None:
    """Requests with 2, 0 and 1 drafts in one call; one-hot targets make every outcome certain."""
    e = torch.eye(6)
    probs = torch.stack([e[4], e[2], e[3], e[5], e[1], e[0]])  # rows: req0 x3, req1 x1, req2 x2
    uniforms, noise = draw_uniforms_and_noise(6, 6, {}, CPU)
    out = rejection_sample(probs, [[4, 1], [], [3]], None, uniforms, noise)
    assert out == [[4, 2], [5], [1]]  # req0: 4 accepted, 1 rejected (p = 0) -> p without 1 = row 1 -> 2
    with pytest.raises(ValueError, match="6 target rows for drafts needing 5"):
        rejection_sample(probs, [[4, 1], [3]], None, uniforms, noise)


def test_seeded_rows_reproduce_their_draws_in_any_batch() -> None:
    probs, drafts = _batch(3, [5, 4], [P0, P1, P2])

    def run(extra_rows: int) -> list[int]:
        generators = {extra_rows + j: torch.Generator().manual_seed(100 + j) for j in range(3)}
        uniforms, noise = draw_uniforms_and_noise(extra_rows + 3, 6, generators, CPU)
        full = torch.cat([probs[:extra_rows], probs[:3]]) if extra_rows else probs[:3]
        batch = [[5, 4]] * (extra_rows // 3) + [drafts[0]]
        return rejection_sample(full, batch, None, uniforms, noise)[-1]

    results = {tuple(run(extra)) for extra in (0, 3, 6) for _ in range(3)}
    assert len(results) == 1

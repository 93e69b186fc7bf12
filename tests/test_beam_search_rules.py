"""folio/beam_search.py's rules on hand-made candidate rows (no model): which EOS candidates finish, the length the
penalty divides by, ignore_eos, max_tokens, and that the early stop never changes the result (hypothesis)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from folio.beam_search import MAX_BEAM_WIDTH, BeamSearchInstance, BeamSearchParams, get_beam_search_score
from folio.outputs import Logprob

EOS = 0


def row(**logprobs: float) -> dict[int, Logprob]:
    """Token names t1, t2, ... and eos -> ids 1, 2, ... and 0, with their logprobs, in rank order."""
    ranked = sorted(logprobs.items(), key=lambda item: -item[1])
    return {(EOS if name == "eos" else int(name[1:])): Logprob(lp, rank) for rank, (name, lp) in enumerate(ranked, 1)}


def outputs(search: BeamSearchInstance) -> list[list[int]]:
    return [seq.output_token_ids for seq in search.results()]


def test_eos_finishes_only_among_the_top_width_candidates() -> None:
    search = BeamSearchInstance([7, 8], BeamSearchParams(beam_width=2, max_tokens=5), {EOS})
    # Step 1, one beam: EOS ranks 2nd of 4 (< width 2): it finishes; the live beams are t1 and t2.
    search.step([row(t1=-0.1, eos=-0.5, t2=-0.6, t3=-2.0)])
    assert [(s.output_token_ids, s.finish_reason) for s in search.completed] == [([EOS], "stop")]
    assert [b.output_token_ids for b in search.beams] == [[1], [2]]
    # Step 2: the candidates by cumulative logprob are [1,3] -0.2, [1,4] -0.3, [2,eos] -0.7, ...: EOS ranks 3rd
    # (>= width): it does not finish (vLLM would keep it), and the beams are the two best live ones.
    search.step([row(t3=-0.1, t4=-0.2, t5=-3.0, t6=-4.0), row(eos=-0.1, t3=-2.0, t4=-3.0, t5=-4.0)])
    assert len(search.completed) == 1
    assert [b.output_token_ids for b in search.beams] == [[1, 3], [1, 4]]
    assert [b.cum_logprob for b in search.beams] == pytest.approx([-0.2, -0.3])
    assert search.beams[0].tokens == [7, 8, 1, 3] and search.beams[0].num_prompt_tokens == 2
    assert search.beams[0].logprobs[1][3].logprob == pytest.approx(-0.1)


def test_score_divides_by_the_generated_tokens_eos_included() -> None:
    assert get_beam_search_score(4, -2.0, 1.0) == pytest.approx(-0.5)
    assert get_beam_search_score(4, -2.0, 0.0) == pytest.approx(-2.0)
    # width 2: step 1 finishes [eos] (cum -1.0, length 1); [t1] and [t2] live; after max_tokens 3 they end with
    # "length". With length_penalty 1, [1, 3, 5] (cum -2.4, 3 tokens: -0.8) beats [eos] (-1.0); with 0 it loses.
    rows = [
        [row(t1=-0.4, eos=-1.0, t2=-1.1, t3=-5.0)],
        [row(t3=-1.0, t4=-3.0, t5=-4.0, t6=-5.0), row(t4=-2.0, t5=-3.0, t6=-4.0, t7=-5.0)],
        [row(t5=-1.0, t6=-2.0, t7=-4.0, t8=-5.0), row(t6=-2.0, t7=-3.0, t8=-4.0, t9=-5.0)],
    ]
    expected = {1.0: [[1, 3, 5], [EOS]], 0.0: [[EOS], [1, 3, 5]]}
    for penalty, best in expected.items():
        search = BeamSearchInstance([9], BeamSearchParams(2, 3, length_penalty=penalty), {EOS})
        for step_rows in rows:
            search.step(step_rows)
        assert search.done
        assert outputs(search) == best
        by_tokens = {tuple(s.output_token_ids): s for s in search.results()}
        assert by_tokens[(EOS,)].finish_reason == "stop" and by_tokens[(1, 3, 5)].finish_reason == "length"
        assert by_tokens[(1, 3, 5)].cum_logprob == pytest.approx(-2.4)


def test_the_length_is_the_generated_tokens_not_the_prompt() -> None:
    """transformers' length (generated tokens, EOS included) against vLLM's (prompt + output without EOS): with a
    5-token prompt, [1, eos] (cum -1.0) scores -1.0 / 2 = -0.5 and [2, 6, 7] (cum -1.4) -1.4 / 3 = -0.47, so
    [2, 6, 7] wins; vLLM's lengths (6 and 8) would rank [1, eos] first (-0.167 > -0.175)."""
    search = BeamSearchInstance([9] * 5, BeamSearchParams(2, 3), {EOS})
    search.step([row(t1=-0.3, t2=-0.5, t3=-5.0, t4=-6.0)])
    search.step([row(eos=-0.7, t5=-0.8, t3=-5.0, t4=-6.0), row(t6=-0.4, t3=-5.0, t4=-6.0, t5=-7.0)])
    assert [(s.output_token_ids, s.finish_reason) for s in search.completed] == [([1, EOS], "stop")]
    search.step([row(t7=-0.5, t3=-5.0, t4=-6.0, t5=-7.0), row(t8=-1.0, t3=-5.0, t4=-6.0, t6=-7.0)])
    assert outputs(search) == [[2, 6, 7], [1, EOS]]
    assert [s.cum_logprob for s in search.results()] == pytest.approx([-1.4, -1.0])


def test_ignore_eos_keeps_eos_as_a_token() -> None:
    search = BeamSearchInstance([9], BeamSearchParams(1, 2, ignore_eos=True), {EOS})
    search.step([row(eos=-0.1, t1=-0.2)])
    assert not search.completed and [b.output_token_ids for b in search.beams] == [[EOS]]
    search.step([row(t2=-0.1, t1=-0.2)])
    assert outputs(search) == [[EOS, 2]] and search.results()[0].finish_reason == "length"


def test_params_are_validated_naming_the_field() -> None:
    for width in (0, MAX_BEAM_WIDTH + 1):
        with pytest.raises(ValueError, match=rf"^beam_width must be an integer in \[1, {MAX_BEAM_WIDTH}\]"):
            BeamSearchParams(beam_width=width, max_tokens=4)
    with pytest.raises(ValueError, match="^max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="^length_penalty"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=math.nan)


class _NoEarlyStop(BeamSearchInstance):
    def _can_improve(self) -> bool:
        return True


def _toy_rows(beams: list[list[int]], seed: int, vocab: int, width: int) -> list[dict[int, Logprob]]:
    """A deterministic toy language model: each prefix's next-token logprobs come from a generator seeded by it;
    each row holds the prefix's 2 * width best tokens, as the engine's step requests return them."""
    rows = []
    for tokens in beams:
        rng = random.Random(hash((seed, *tokens)))
        logits = [rng.gauss(0.0, 2.0) for _ in range(vocab)]
        norm = math.log(sum(math.exp(x) for x in logits))
        ranked = sorted(range(vocab), key=lambda t: -logits[t])[: 2 * width]
        rows.append({t: Logprob(logits[t] - norm, r) for r, t in enumerate(ranked, 1)})
    return rows


def _search(cls: type[BeamSearchInstance], seed: int, params: BeamSearchParams) -> BeamSearchInstance:
    search = cls([99], params, {EOS})
    while not search.done:
        search.step(_toy_rows([b.tokens for b in search.beams], seed, vocab=8, width=params.beam_width))
    return search


def _found(search: BeamSearchInstance) -> list[tuple[list[int], float, str | None]]:
    return [(s.output_token_ids, round(s.cum_logprob, 12), s.finish_reason) for s in search.results()]


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    width=st.integers(1, 4),
    max_tokens=st.integers(1, 8),
    penalty=st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]),
)
def test_early_stop_never_changes_the_result(seed: int, width: int, max_tokens: int, penalty: float) -> None:
    params = BeamSearchParams(width, max_tokens, length_penalty=penalty)
    early, full = _search(BeamSearchInstance, seed, params), _search(_NoEarlyStop, seed, params)
    assert early.num_steps <= full.num_steps == max_tokens
    assert _found(early) == _found(full)
    for tokens, _, reason in _found(early):
        assert 1 <= len(tokens) <= max_tokens
        assert (tokens[-1] == EOS) == (reason == "stop")
        assert reason == "stop" or len(tokens) == max_tokens


def test_early_stop_happens_on_toy_models() -> None:
    """The property above is not vacuous: on a fixed grid some searches do stop early (and agree)."""
    num_early = 0
    for seed in range(10):
        for penalty in (0.0, 1.0, 2.0):
            params = BeamSearchParams(2, 8, length_penalty=penalty)
            early = _search(BeamSearchInstance, seed, params)
            num_early += early.num_steps < 8
            assert _found(early) == _found(_search(_NoEarlyStop, seed, params))
    assert num_early > 0

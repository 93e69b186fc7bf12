"""Beam search with vLLM's names (``LLM.beam_search``, ``BeamSearchParams``, ``BeamSearchOutput``): the search.

vLLM's design: every step runs each live beam as its own engine request for one token with
``logprobs = 2 * beam_width``. The engine needs nothing special: the beams' common prefix is a prefix-cache hit,
so its full KV blocks are shared (ref counts), not recomputed; each beam recomputes only its last, partial block
(at most ``block_size`` tokens), which the prefix cache does not hold. This module is the search alone, pure
Python; the drivers that submit the step requests are ``run_beam_search`` below (offline, ``LLM.beam_search``) and
folio/server/beam_search.py (the OpenAI server's ``use_beam_search``).

The selection is transformers' (``GenerationMixin._beam_search``, transformers 5.x), so that the top sequence is
the one ``generate(num_beams=w, do_sample=False, early_stopping="never")`` returns:

- a step's candidates are the live beams, each extended by one of its ``2 * w`` most likely tokens (raw
  logprobs), ranked by cumulative logprob;
- a candidate ending in EOS finishes only if it ranks among the first ``w`` candidates (transformers'
  ``top_num_beam_mask``; vLLM keeps every EOS candidate, which can return a sequence transformers never would);
- the next live beams are the ``w`` best candidates that do not end in EOS;
- a finished sequence scores ``cum_logprob / (num_generated_tokens ** length_penalty)``, where
  ``num_generated_tokens`` counts the generated tokens, the EOS token included (transformers divides by
  ``cur_len + 1 - decoder_prompt_len``; vLLM divides by the prompt plus the output without the EOS);
- after ``max_tokens`` steps the live beams finish with reason "length", scored the same way;
- the search stops early once no live beam can still beat the ``w``-th best finished score (the bound of
  transformers' ``early_stopping="never"``, exact: it never changes the returned sequences).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from folio.outputs import Logprob
from folio.sampling_params import SamplingParams

# 2 * beam_width logprobs per step, and a request may ask for at most 20 (vLLM's default max_logprobs): the same
# limit vLLM's default engine puts on the beam width.
MAX_BEAM_WIDTH = 10


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams. ``temperature`` is that of the step requests: the candidates are each beam's top
    tokens by raw logprob, so it does not change which sequences are found."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        width = self.beam_width
        if not (isinstance(width, int) and 1 <= width <= MAX_BEAM_WIDTH):
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {width!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, int | float) and 0.0 <= self.temperature < math.inf):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.length_penalty, int | float) and math.isfinite(self.length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One beam. ``tokens`` holds the prompt and the generated tokens, as vLLM's (EOS included when it ended the
    beam); ``logprobs`` one dict per generated token: the step's candidates of the beam it grew from."""

    tokens: list[int]
    num_prompt_tokens: int
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None  # filled when returned: the decoded tokens, prompt included, as vLLM's
    finish_reason: str | None = None  # "stop" (EOS) or "length" (max_tokens)
    stop_reason: int | str | None = None  # None for EOS, as the engine reports it

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    @property
    def num_generated_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens


@dataclass
class BeamSearchOutput:
    """vLLM's: the best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(num_generated_tokens: int, cum_logprob: float, length_penalty: float) -> float:
    """transformers' length-penalised score; ``num_generated_tokens`` counts an ending EOS token."""
    return cum_logprob / math.pow(num_generated_tokens, length_penalty)


def _score(seq: BeamSearchSequence, length_penalty: float) -> float:
    return get_beam_search_score(seq.num_generated_tokens, seq.cum_logprob, length_penalty)


class BeamSearchInstance:
    """The search for one prompt: ``beams`` are live, ``completed`` finished. Feed ``step`` the candidates of
    every live beam until ``done``; ``results`` then ranks the finished sequences."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: set[int]) -> None:
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids), num_prompt_tokens=len(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.beams

    def step(self, candidates: Sequence[dict[int, Logprob] | None]) -> None:
        """One step: ``candidates[i]`` is live beam i's top tokens with their logprobs (None: the beam's request
        ended without a token, and the beam is dropped, as vLLM drops it)."""
        if len(candidates) != len(self.beams):
            raise ValueError(f"{len(candidates)} candidate rows for {len(self.beams)} live beams")
        width = self.params.beam_width
        self.num_steps += 1
        # (cumulative logprob, beam, token) over every beam's candidates; sort is stable, so ties keep beam order
        # and each beam's rank order.
        pool = [
            (beam.cum_logprob + logprob.logprob, i, token_id)
            for i, (beam, row) in enumerate(zip(self.beams, candidates, strict=True))
            for token_id, logprob in (row or {}).items()
        ]
        pool.sort(key=lambda item: -item[0])
        new_beams: list[BeamSearchSequence] = []
        for rank, (cum_logprob, i, token_id) in enumerate(pool):
            if len(new_beams) == width:
                break  # every EOS candidate ranked below width comes after width live ones: nothing is lost
            parent, row = self.beams[i], candidates[i]
            assert row is not None
            seq = BeamSearchSequence(
                tokens=parent.tokens + [token_id],
                num_prompt_tokens=parent.num_prompt_tokens,
                logprobs=parent.logprobs + [row],
                cum_logprob=cum_logprob,
            )
            if token_id in self.eos_token_ids:
                if rank < width:  # transformers' rule: only the top `width` candidates may finish
                    seq.finish_reason = "stop"
                    self.completed.append(seq)
                continue
            new_beams.append(seq)
        self.beams = new_beams
        if self.num_steps >= self.params.max_tokens:
            for seq in self.beams:
                seq.finish_reason = "length"
            self.completed += self.beams
            self.beams = []
        elif self.beams and not self._can_improve():
            self.beams = []

    def _can_improve(self) -> bool:
        """Whether some live beam may still end above the width-th best finished score.

        Every later score of a live beam is cum' / L' ** p with cum' <= cum <= 0 and num_steps < L' <= max_tokens,
        so it is at most cum / max_tokens ** p when p > 0 and at most cum / num_steps ** p when p <= 0.
        """
        width, penalty = self.params.beam_width, self.params.length_penalty
        if len(self.completed) < width:
            return True
        worst_kept = sorted((_score(s, penalty) for s in self.completed), reverse=True)[width - 1]
        best_cum = max(beam.cum_logprob for beam in self.beams)
        length = self.params.max_tokens if penalty > 0 else self.num_steps
        return get_beam_search_score(length, best_cum, penalty) >= worst_kept

    def results(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` finished sequences, best first (ties: the one that finished first)."""
        penalty = self.params.length_penalty
        ranked = sorted(self.completed, key=lambda s: _score(s, penalty), reverse=True)
        return ranked[: self.params.beam_width]


def step_sampling_params(params: BeamSearchParams, num_logprobs: int | None = None) -> SamplingParams:
    """What each beam's one-token request asks for: its top ``2 * beam_width`` tokens (or ``num_logprobs``, if
    more, so that a caller's logprobs can be shown from the same rows)."""
    return SamplingParams(
        n=1,
        temperature=params.temperature,
        max_tokens=1,
        logprobs=max(2 * params.beam_width, num_logprobs or 0),
        detokenize=False,
    )


def check_prefix_caching(enabled: bool) -> None:
    """Beam search without prefix caching would recompute every beam's whole prefix at every step (quadratic in
    the output length); it is refused instead (vLLM assumes prefix caching too)."""
    if not enabled:
        raise ValueError(
            "beam search needs prefix caching (enable_prefix_caching=True): each step runs every beam as a "
            "request, and only prefix-cache hits let the beams share their prefix's KV blocks"
        )


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """The prompt plus max_tokens must fit the context (the last step's request holds both but the last token)."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens {max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds max_model_len "
            f"{max_model_len} (at most {max(max_model_len - num_prompt_tokens, 0)} new tokens fit)"
        )


StepRunner = Callable[[list[list[int]], SamplingParams], list[dict[int, Logprob] | None]]


def run_beam_search(
    prompts_token_ids: list[list[int]],
    params: BeamSearchParams,
    eos_token_ids: set[int],
    run_step: StepRunner,
    decode: Callable[[list[int]], str],
) -> list[BeamSearchOutput]:
    """The offline driver: each step hands every live beam of every prompt to ``run_step`` as one batch (token
    ids -> each beam's candidate row), until every search is done; then the best sequences get their text."""
    instances = [BeamSearchInstance(ids, params, eos_token_ids) for ids in prompts_token_ids]
    step_params = step_sampling_params(params)
    while live := [inst for inst in instances if not inst.done]:
        rows = run_step([beam.tokens for inst in live for beam in inst.beams], step_params)
        start = 0
        for inst in live:
            num_beams = len(inst.beams)
            inst.step(rows[start : start + num_beams])
            start += num_beams
    outputs = []
    for inst in instances:
        best = inst.results()
        for seq in best:
            seq.text = decode(seq.tokens)
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs


def first_row(output: Any) -> dict[int, Logprob] | None:
    """A one-token request's candidate row (None when it ended without one)."""
    completion = output.outputs[0]
    if not completion.logprobs:
        return None
    row: dict[int, Logprob] = completion.logprobs[0]
    return row

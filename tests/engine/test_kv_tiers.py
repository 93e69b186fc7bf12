"""Both halves of the host KV tier on the real model (issue 18): the scheduler's store/load plans executed by the
worker. A device pool of 12 blocks for 4 requests of 5 growing to 7 blocks each, sharing a 3-block prefix, forces swaps
and evicts cached prefixes to the host tier; a second round re-sends the prompts (reversed) and finds them there.
Outputs must not change: with the host tier vs without, swap vs recompute. Every run samples the same mix, two
requests greedy and two seeded at temperature 0.8, so that seeded sampling is held to the same runs as greedy (a
run of the real model here is about 140 steps: the seeded runs of their own were a third of the module's time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from folio import LLM, SamplingParams
from folio.request import Request
from tests.engine.conftest import assert_no_leaks

BLOCK = 16
PREFIX = [(7 * i + 3) % 5000 + 200 for i in range(3 * BLOCK)]  # 3 full blocks shared by every prompt
PROMPTS = [PREFIX + [(97 * i + 11 * j) % 5000 + 300 for j in range(24)] for i in range(4)]  # 72 tokens each
MAX_TOKENS = 40  # 112 tokens at the end: 7 blocks per request
SMALL_POOL = dict(num_gpu_blocks_override=12, max_model_len=128, max_num_seqs=4)
HOST_GIB = 0.05  # ~70 blocks of SmolLM2 in float32: room for every swap and every evicted prefix block

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = (1, 3)  # the prompts sampled with a seed; the others are greedy
PROBE_TOKENS = 8  # the greedy tokens a seeded row's output is compared with, to show that it sampled


def params_of(i: int) -> SamplingParams:
    """Prompt i's sampling: seeded at temperature 0.8 for the prompts in SEEDED, else greedy."""
    if i in SEEDED:
        return SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
    return GREEDY


class _Run:
    """Two rounds (the prompts, then the same prompts reversed) on one engine; which requests were swapped."""

    def __init__(self, llm: LLM, params: Callable[[int], SamplingParams] = params_of) -> None:
        self.llm = llm
        preemption = llm.llm_engine.scheduler.preemption
        release = preemption.release_blocks
        self.swapped: set[str] = set()

        def observed_release(request: Request) -> bool:  # the real strategy, watched
            done = release(request)
            if done:
                self.swapped.add(request.request_id)
            return done

        preemption.release_blocks = observed_release
        order = [list(range(4)), list(reversed(range(4)))]
        self.rounds: list[list[Any]] = []
        self.tokens: dict[int, list[list[int]]] = {i: [] for i in range(4)}
        for indices in order:
            outputs = llm.generate(
                [{"prompt_token_ids": PROMPTS[i]} for i in indices], [params(i) for i in indices], use_tqdm=False
            )
            assert_no_leaks(llm)  # both pools: every device and host block free again
            self.rounds.append(outputs)
            for i, out in zip(indices, outputs, strict=True):
                self.tokens[i].append(list(out.outputs[0].token_ids))
        preemption.release_blocks = release
        self.stats = llm.llm_engine.scheduler.get_stats()


@pytest.fixture(scope="module")
def plain(make_llm_module: Callable[..., LLM]) -> _Run:
    return _Run(make_llm_module(**SMALL_POOL))


@pytest.fixture(scope="module")
def make_llm_module() -> Callable[..., LLM]:
    def make(**kwargs: Any) -> LLM:
        return LLM(dtype="float32", **kwargs)

    return make


@pytest.fixture(scope="module")
def tiered(make_llm_module: Callable[..., LLM]) -> _Run:
    return _Run(make_llm_module(**SMALL_POOL, kv_offloading_size=HOST_GIB))


def test_swap_and_host_prefix_hits_keep_greedy_and_seeded_outputs(plain: _Run, tiered: _Run) -> None:
    plain_stats, stats = plain.stats, tiered.stats
    assert plain_stats.num_preemptions_total > 0 and plain_stats.num_swapped_preemptions_total == 0
    assert plain_stats.kv_offload_blocks_to_cpu_total == 0
    assert stats.num_swapped_preemptions_total > 0, stats
    assert stats.num_swapped_preemptions_total == stats.num_preemptions_total, "no fallback to recompute"
    assert stats.kv_offload_blocks_to_cpu_total > 0 and stats.kv_offload_blocks_to_device_total > 0, stats
    assert stats.external_prefix_cache_hits > 0, stats
    # FCFS preempts running[-1], so the last prompts of round 1 are swapped, and those of the reversed round 2 are
    # round 1's first: every prompt is swapped at least once.
    orders = (range(4), reversed(range(4)))
    prompt_of = {
        out.request_id: i
        for order, outputs in zip(orders, tiered.rounds, strict=True)
        for i, out in zip(order, outputs, strict=True)
    }
    assert {prompt_of[req_id] for req_id in tiered.swapped} == set(range(4)), (prompt_of, tiered.swapped)
    assert plain.tokens == tiered.tokens
    for i in range(4):  # each round gives the same output for the same prompt (greedy, or seeded with its seed)
        assert tiered.tokens[i][0] == tiered.tokens[i][1]
    for i in SEEDED:  # the seeded rows sampled: their first tokens are not their prompt's greedy ones
        assert tiered.tokens[i][0][:PROBE_TOKENS] != _greedy_tokens(tiered.llm, i), i


def test_swap_and_recompute_modes_agree(make_llm_module: Callable[..., LLM], tiered: _Run) -> None:
    recompute = _Run(make_llm_module(**SMALL_POOL, kv_offloading_size=HOST_GIB, preemption_mode="recompute"))
    stats = recompute.stats
    assert stats.num_preemptions_total > 0 and stats.num_swapped_preemptions_total == 0, stats
    assert not recompute.swapped
    assert stats.external_prefix_cache_hits > 0, "recompute mode still uses the host tier as a prefix cache"
    assert recompute.tokens == tiered.tokens


def test_a_full_host_tier_falls_back_to_recompute(make_llm_module: Callable[..., LLM], plain: _Run) -> None:
    """A 7-block host tier cannot take every swap, and prompts are chunked (32 tokens a step): some preemptions
    swap, the others fall back to recompute, and the outputs still equal the plain engine's."""
    small = _Run(make_llm_module(**SMALL_POOL, kv_offloading_size=0.005, max_num_batched_tokens=32))
    stats = small.stats
    assert 0 < stats.num_swapped_preemptions_total < stats.num_preemptions_total, stats
    assert small.tokens == plain.tokens


def _greedy_tokens(llm: LLM, i: int) -> list[int]:
    """The first PROBE_TOKENS greedy tokens of prompt i, alone."""
    greedy = SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[i]}], greedy, use_tqdm=False)
    return list(out.outputs[0].token_ids)

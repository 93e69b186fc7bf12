"""Tensor parallelism end to end on real worker processes: greedy outputs at tp=2 (uneven heads) on the real model
(9 heads, 3 KV heads), at tp=3 on a random model of the real one's layer shapes and at tp=2 on a tiny random Llama
equal tp=1's, or follow the top-5 rule at a divergence; the distributed arg-max picks the same tokens as the arg-max
of the gathered logits. Plus the shard plan's arithmetic (which heads, KV heads, rows each rank keeps) without
processes. (Every rank process loads the whole checkpoint before it keeps its shard: the random model of SmolLM2's
layout makes tp=3 and the fused-vs-layer-by-layer comparison at tp=2 a fifth of their cost on the real model.)"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest

from folio import LLM, SamplingParams
from folio.cli import build_parser, engine_args_from
from folio.model.spec import ModelSpec
from folio.parallel.tensor_parallel import ShardPlan, check_tensor_parallel
from tests.engine.greedy_compare import compare_greedy, from_folio_output
from tests.parallel.conftest import shutdown
from tests.tiny_models import SMOLLM2_LAYOUT, save_tiny_llama


def _greedy(llm: LLM, prompts: list[Any], max_tokens: int, logprobs: int | None) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return llm.generate(prompts, params, use_tqdm=False)


def _check_against_tp1(
    reference: list[Any], candidate: LLM, prompts: list[Any], max_tokens: int
) -> tuple[list[str], list[Any]]:
    """candidate's greedy runs with logprobs (gathered logits) held to tp=1's by the top-5 rule; its runs without
    (distributed arg-max) must pick exactly the tokens of its own gathered-logits runs. Returns the verdicts and the
    runs with logprobs."""
    with_logprobs = _greedy(candidate, prompts, max_tokens, 5)
    verdicts = [
        compare_greedy(from_folio_output(ref), from_folio_output(out), f"prompt {i}")
        for i, (ref, out) in enumerate(zip(reference, with_logprobs, strict=True))
    ]
    argmax_only = _greedy(candidate, prompts, max_tokens, None)
    for a, b in zip(with_logprobs, argmax_only, strict=True):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
    return verdicts, with_logprobs


_REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def real_tp1(make_engine: Callable[..., LLM]) -> tuple[list[Any], int]:
    """tp=1 on the real model: its greedy outputs with logprobs, and its KV blocks for 2**26 bytes."""
    reference_llm = make_engine()
    return _greedy(reference_llm, _REAL_PROMPTS, 10, 5), reference_llm.llm_engine.config.cache_config.num_blocks


_LAYOUT_PROMPTS = [{"prompt_token_ids": [1, 5, 9, 17, 33, 40, 41, 60, 7]}, {"prompt_token_ids": [1, 90, 3, 4, 200]}]


@pytest.fixture(scope="module")
def layout_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random model of SmolLM2's layer shapes (9 query heads, 3 KV heads), 2 layers, weights large enough that
    attention is peaked (tokens then follow the weights closely: a wrong shard changes them)."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("tp_layout"),
        vocab_size=256,
        num_hidden_layers=2,
        max_position_embeddings=256,
        initializer_range=0.25,
        **SMOLLM2_LAYOUT,
    )


def test_tp3_matches_tp1_with_one_kv_head_per_rank(make_engine: Callable[..., LLM], layout_model: str) -> None:
    kv_bytes = 100 * 2 * 2 * 16 * 3 * 64 * 4  # 100 blocks of tp=1 (2 layers, K and V, 16 tokens, 3 KV heads of 64)
    tp1 = make_engine(layout_model, kv_cache_memory_bytes=kv_bytes)
    reference, tp1_blocks = _greedy(tp1, _LAYOUT_PROMPTS, 12, 5), tp1.llm_engine.config.cache_config.num_blocks
    assert tp1_blocks == 100
    tp3 = make_engine(layout_model, tensor_parallel_size=3, kv_cache_memory_bytes=kv_bytes)
    try:
        assert tp3.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
        assert len(tp3.llm_engine.executor.worker_pids) == 3
        # every rank holds 1 of the 3 KV heads: a third of tp=1's bytes per block, so the same bytes hold 3x the blocks
        assert tp3.llm_engine.config.cache_config.num_blocks == 3 * tp1_blocks
        verdicts, _ = _check_against_tp1(reference, tp3, _LAYOUT_PROMPTS, 12)
    finally:
        shutdown(tp3)
    print("tp=3 vs tp=1:", verdicts)


def test_tp2_with_uneven_heads_on_the_real_model_matches_tp1(
    make_engine: Callable[..., LLM], real_tp1: tuple[list[Any], int]
) -> None:
    """tp=2 does not divide SmolLM2's 9 heads and 3 KV heads: with --tensor-parallel-uneven-heads rank 0 holds KV
    head 0 with query heads 0-2, rank 1 KV heads 1-2 with query heads 3-8. The ranks agree on rank 1's block count
    (2 of 3 KV heads: 1.5x tp=1's blocks). The answering rank's time in collectives reaches the executor."""
    reference, tp1_blocks = real_tp1
    tp2 = make_engine(tensor_parallel_size=2, tensor_parallel_uneven_heads=True)
    try:
        executor = tp2.llm_engine.executor
        assert len(executor.worker_pids) == 2
        assert tp2.llm_engine.config.cache_config.num_blocks in (3 * tp1_blocks // 2, 3 * tp1_blocks // 2 + 1)
        seconds_before, steps_before = executor.collective_seconds, executor.steps_collected
        verdicts, _ = _check_against_tp1(reference, tp2, _REAL_PROMPTS, 10)
        assert executor.steps_collected > steps_before and executor.collective_seconds > seconds_before
    finally:
        shutdown(tp2)
    print("tp=2 (uneven heads) vs tp=1:", verdicts)


def test_tp2_ranks_fused_decoder_equals_layer_by_layer(
    make_engine: Callable[..., LLM], layout_model: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """At tp=2 with uneven heads the ranks run the fused CPU decoder, which calls the all-reduce back after its o
    and down projections: its tokens and logprobs equal the layer-by-layer path's (enforce_eager) bit for bit, as
    the two paths' outputs are equal at one rank. The ranks' start-up lines say which path each engine took."""
    outputs = {}
    for eager in (False, True):
        capfd.readouterr()  # only this engine's ranks' lines below
        tp2 = make_engine(layout_model, tensor_parallel_size=2, tensor_parallel_uneven_heads=True, enforce_eager=eager)
        try:
            outputs[eager] = _greedy(tp2, _LAYOUT_PROMPTS, 12, 5)
        finally:
            shutdown(tp2)
        plan_lines = [line for line in capfd.readouterr().err.splitlines() if "fused_decoder=folio" in line]
        assert len(plan_lines) == 2, plan_lines  # one per rank
        assert all(line.endswith("(fused decoder off: enforce_eager)") == eager for line in plan_lines), plan_lines
    for fused, layer_by_layer in zip(outputs[False], outputs[True], strict=True):
        assert list(fused.outputs[0].token_ids) == list(layer_by_layer.outputs[0].token_ids)
        assert fused.outputs[0].logprobs == layer_by_layer.outputs[0].logprobs


@pytest.mark.parametrize("tp", [2])
def test_tiny_model_tp_matches_tp1(tiny_model: str, make_engine: Callable[..., LLM], tp: int) -> None:
    prompts = [{"prompt_token_ids": [1, 5, 9, 17, 33, 40, 41, 60, 7]}, {"prompt_token_ids": [1, 90, 3, 4]}]
    reference_llm = make_engine(tiny_model)
    reference = _greedy(reference_llm, prompts, 16, 5)
    # seeded sampling through the whole sampler (temperature, top-p) on the gathered logits: every rank draws the
    # same token from the same numbers, or the ranks' copies of the requests would part and the text would change
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
    expected_sampled = [o.outputs[0].token_ids for o in reference_llm.generate(prompts, sampled, use_tqdm=False)]
    llm = make_engine(tiny_model, tensor_parallel_size=tp)
    try:
        verdicts, _ = _check_against_tp1(reference, llm, prompts, 16)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)] == expected_sampled
    finally:
        shutdown(llm)
    assert verdicts == ["identical", "identical"]


def _spec(heads: int, kv_heads: int, intermediate: int = 64, vocab: int = 96) -> ModelSpec:
    return ModelSpec(
        "LlamaForCausalLM", vocab, 8 * heads, intermediate, 2, heads, kv_heads, 8, 1e-5, 1e4, None, 256, True, False, 1
    )


def test_shard_plan_of_smollm2_at_tp3() -> None:
    spec = _spec(9, 3, intermediate=1536, vocab=49152)
    plans = [ShardPlan.make(spec, rank, 3) for rank in range(3)]
    assert [p.q_heads for p in plans] == [(0, 3), (3, 6), (6, 9)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 2), (2, 3)]
    assert [p.intermediate for p in plans] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [p.vocab for p in plans] == [(0, 16384), (16384, 32768), (32768, 49152)]
    assert [p.num_kv_heads for p in plans] == [1, 1, 1]


def test_shard_plan_of_smollm2_at_tp2_with_uneven_heads() -> None:
    """Whole KV heads with their 3 query heads each: rank 0 one, rank 1 two (rounded down at rank 0)."""
    spec = _spec(9, 3, intermediate=1536, vocab=49152)
    plans = [ShardPlan.make(spec, rank, 2, uneven_heads=True) for rank in range(2)]
    assert [p.q_heads for p in plans] == [(0, 3), (3, 9)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 3)]
    assert [p.num_kv_heads for p in plans] == [1, 2]
    assert [p.intermediate for p in plans] == [(0, 768), (768, 1536)]
    assert [p.vocab for p in plans] == [(0, 24576), (24576, 49152)]
    # tp=6 > 3 KV heads: two ranks per KV head, which split its 3 query heads 1 + 2
    assert [ShardPlan.make(spec, r, 6, uneven_heads=True).q_heads for r in range(6)] == [
        (0, 1),
        (1, 3),
        (3, 4),
        (4, 6),
        (6, 7),
        (7, 9),
    ]


def test_kv_heads_are_replicated_where_tp_exceeds_them() -> None:
    """4 heads, 2 KV heads at tp=4 (vLLM's rule): ranks 0, 1 share KV head 0, ranks 2, 3 KV head 1."""
    spec = _spec(4, 2)
    assert [ShardPlan.make(spec, r, 4).kv_heads for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [ShardPlan.make(spec, r, 4).num_kv_heads for r in range(4)] == [1, 1, 1, 1]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 8), (12, 4), (16, 2), (9, 3), (32, 8), (15, 5)])
@pytest.mark.parametrize("uneven_heads", [False, True])
def test_every_rank_holds_the_kv_heads_its_query_heads_read(heads: int, kv_heads: int, uneven_heads: bool) -> None:
    """Grouped-query attention: query head h reads KV head h // (heads / kv_heads). For every tp the check accepts
    (with and without uneven heads), each rank's query heads find their KV head among the rank's own, at the same
    local offset; the ranks' query heads tile all heads, each rank holding at least one; where tp divides the heads
    (and the KV heads, or is a multiple of them) the split is the even one, heads / tp each."""
    spec = _spec(heads, kv_heads, intermediate=math.lcm(*range(1, heads + 1)))  # every tp up to the heads divides it
    group = heads // kv_heads
    accepted = []
    for tp in range(1, 2 * heads + 1):
        try:
            check_tensor_parallel(spec, tp, uneven_heads)
        except ValueError:
            continue
        accepted.append(tp)
        plans = [ShardPlan.make(spec, rank, tp, uneven_heads) for rank in range(tp)]
        assert [h for p in plans for h in range(*p.q_heads)] == list(range(heads)), (tp, plans)
        for rank, plan in enumerate(plans):
            assert plan.q_heads[1] > plan.q_heads[0] and plan.num_kv_heads >= 1
            for h in range(*plan.q_heads):
                assert plan.kv_heads[0] <= h // group < plan.kv_heads[1], (tp, rank, h)
            if heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0):
                assert plan.q_heads == (rank * heads // tp, (rank + 1) * heads // tp)
    even = [t for t in range(1, heads + 1) if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)]
    uneven = [t for t in range(1, heads + 1) if t <= kv_heads or t % kv_heads == 0]
    assert accepted == (uneven if uneven_heads else even)


def test_a_vocabulary_tp_does_not_divide_leaves_the_last_slice_short() -> None:
    spec = _spec(4, 2, vocab=97)
    assert [ShardPlan.make(spec, r, 4).vocab for r in range(4)] == [(0, 25), (25, 50), (50, 75), (75, 97)]


_UNEVEN_HINT = " (or set --tensor-parallel-uneven-heads to split them unevenly)"


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "uneven_heads", "message"),
    [
        (
            9,
            3,
            2,
            False,
            "tensor_parallel_size (--tensor-parallel-size) 2 must divide the model's number of attention heads 9"
            + _UNEVEN_HINT,
        ),
        (9, 3, 2, True, None),
        (
            12,
            4,
            6,
            False,
            "tensor_parallel_size (--tensor-parallel-size) 6 must divide the model's number of KV heads 4 or be a "
            "multiple of it",
        ),
        (
            12,
            4,
            6,
            True,
            "tensor_parallel_size (--tensor-parallel-size) 6 with --tensor-parallel-uneven-heads must be at most the "
            "model's number of KV heads 4, or a multiple of it up to its number of attention heads 12",
        ),
        (9, 3, 12, True, "tensor_parallel_size (--tensor-parallel-size) 12 with --tensor-parallel-uneven-heads"),
        (4, 2, 4, False, None),
    ],
)
def test_check_tensor_parallel(heads: int, kv_heads: int, tp: int, uneven_heads: bool, message: str | None) -> None:
    spec = _spec(heads, kv_heads, intermediate=48)
    if message is None:
        check_tensor_parallel(spec, tp, uneven_heads)
    else:
        with pytest.raises(ValueError, match="^" + re.escape(message)) as raised:
            check_tensor_parallel(spec, tp, uneven_heads)
        # the hint only where the flag would help
        assert raised.value.args[0].endswith(_UNEVEN_HINT) == (not uneven_heads and tp <= kv_heads)


def test_the_uneven_heads_flag_reaches_the_engine_config() -> None:
    argv = ["serve", "-tp", "2", "--tensor-parallel-uneven-heads"]
    parallel = engine_args_from(build_parser().parse_args(argv)).create_engine_config("m", 64).parallel_config
    assert (parallel.tensor_parallel_size, parallel.tensor_parallel_uneven_heads) == (2, True)
    default = engine_args_from(build_parser().parse_args(["serve", "-tp", "2"])).create_engine_config("m", 64)
    assert default.parallel_config.tensor_parallel_uneven_heads is False

"""Pipeline parallelism end to end on real worker processes (gloo send/recv between the stages on this CPU): on the
real model (30 layers, 15 per stage at pp=2) greedy tokens and their logprobs equal pp=1's run layer by layer (the
path every stage takes); seeded sampling gives the same tokens; the stages overlap (two batches in flight); the KV
cache is sized per stage. Bad settings are refused at start naming the flag and the limit, before any worker
starts. (tp x pp and a killed stage: test_pipeline_ranks.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psutil
import pytest

from folio import LLM, SamplingParams
from folio.cli import main
from tests.engine.greedy_compare import compare_greedy, from_folio_output
from tests.parallel.conftest import shutdown

_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def _generate(llm: LLM, params: SamplingParams) -> list[Any]:
    return llm.generate(_PROMPTS, params, use_tqdm=False)


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def _logprobs(outputs: list[Any]) -> list[list[dict[int, float]]]:
    return [[{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs] for out in outputs]


def test_pp2_on_the_real_model_matches_pp1(make_engine: Callable[..., LLM]) -> None:
    """pp=1 run layer by layer (enforce_eager: the path every stage takes; the fused CPU decoder has no stage
    boundary) is the reference: the same tokens and the same logprobs, greedy and seeded sampling alike."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    # the whole sampler (temperature, top-p) on the last stage's logits, seeded per request
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    pp1 = make_engine(enforce_eager=True)
    reference, reference_sampled = _generate(pp1, greedy), _generate(pp1, sampled)
    pp2 = make_engine(pipeline_parallel_size=2)
    try:
        assert pp2.llm_engine.config.parallel_config.distributed_executor_backend == "mp"
        assert len(pp2.llm_engine.executor.worker_pids) == 2
        # each stage caches 15 of the 30 layers: the same 2**26 bytes hold twice the blocks
        assert pp2.llm_engine.config.cache_config.num_blocks == 2 * pp1.llm_engine.config.cache_config.num_blocks
        with_logprobs = _generate(pp2, greedy)
        argmax_only = _generate(pp2, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        pp2_sampled = _generate(pp2, sampled)
        queue = pp2.llm_engine.engine_core.batch_queue
        assert queue is not None and queue.peak_in_flight == 2  # 4 requests: batches of 2 alternate
    finally:
        shutdown(pp2)
    verdicts = [
        compare_greedy(from_folio_output(ref), from_folio_output(out), f"prompt {i}")
        for i, (ref, out) in enumerate(zip(reference, with_logprobs, strict=True))
    ]
    assert verdicts == ["identical"] * len(_PROMPTS)
    assert _tokens(with_logprobs) == _tokens(argmax_only)  # the last stage's fused arg-max picks the same
    assert _logprobs(with_logprobs) == _logprobs(reference)  # the same numbers, not only the same arg-max
    assert _tokens(pp2_sampled) == _tokens(reference_sampled)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pipeline_parallel_size": 0}, r"pipeline_parallel_size \(--pipeline-parallel-size\) must be >= 1, got 0"),
        (
            {"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"},
            "distributed_executor_backend 'uni' runs one rank; pipeline_parallel_size 2 needs 'mp'",
        ),
        (
            {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
            r"'uni' runs one rank; tensor_parallel_size x pipeline_parallel_size \(2 x 2 = 4 ranks\) needs 'mp'",
        ),
        (
            {
                "pipeline_parallel_size": 2,
                "tensor_parallel_size": 2,
                "kv_offloading_size": 1,
                "kv_offloading_disk_path": "/nonexistent/folio-kv",
                "kv_offloading_disk_size": 1,
            },
            r"kv_offloading_disk_path with tensor_parallel_size x pipeline_parallel_size \(2 x 2 = 4 ranks\) is not",
        ),
        (
            {"pipeline_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            r"speculative_config with pipeline_parallel_size \(--pipeline-parallel-size\) > 1 is not implemented",
        ),
    ],
)
def test_bad_pipeline_settings_are_refused_before_any_worker_starts(kwargs: dict[str, object], message: str) -> None:
    before = set(psutil.Process().children())
    with pytest.raises(ValueError, match=message):
        LLM(dtype="float32", kv_cache_memory_bytes=2**26, **kwargs)  # type: ignore[arg-type]
    assert set(psutil.Process().children()) == before


def test_more_stages_than_layers_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Through the CLI (-pp), as `folio serve` and `folio generate` refuse it: exit 2 and the message."""
    before = set(psutil.Process().children())
    assert main(["generate", "-pp", "31", "--max-tokens", "1", "hello"]) == 2
    error = capsys.readouterr().err
    assert "pipeline_parallel_size (--pipeline-parallel-size) 31 exceeds the model's number of layers 30" in error
    assert set(psutil.Process().children()) == before

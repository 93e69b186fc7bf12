"""Pipeline parallelism with more ranks: tp=2 x pp=2 (4 worker processes) on a tiny random Llama gives one rank's
greedy and seeded-sampling tokens, with the KV cache sized per rank; a killed stage worker fails the engine at once
(the executor watches every worker's process, not only the one whose output it reads), and later calls too."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from folio import LLM, SamplingParams
from tests.parallel.conftest import kill_rank_mid_run, mark_failed, shutdown
from tests.tiny_models import save_tiny_llama

_HANG_GUARD_S = 60.0


def _tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_tp2_pp2_on_a_tiny_model_matches_one_rank(tiny_model: str, make_engine: Callable[..., LLM]) -> None:
    """4 ranks: 2 stages of 1 layer, each split over 2 tensor-parallel ranks (1 KV head each of the 2)."""
    prompts = [{"prompt_token_ids": [1, 5, 9, 17, 33, 40, 41, 60, 7]}, {"prompt_token_ids": [1, 90, 3, 4]}]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
    one = make_engine(tiny_model)
    expected = [_tokens(one.generate(prompts, p, use_tqdm=False)) for p in (greedy, sampled)]
    llm = make_engine(tiny_model, tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        assert len(llm.llm_engine.executor.worker_pids) == 4
        assert llm.llm_engine.executor.output_rank == 2  # the last stage's first tensor-parallel rank
        # a quarter of the bytes per block on every rank (half the layers, half the KV heads): 4x the blocks
        assert llm.llm_engine.config.cache_config.num_blocks == 4 * one.llm_engine.config.cache_config.num_blocks
        assert [_tokens(llm.generate(prompts, p, use_tqdm=False)) for p in (greedy, sampled)] == expected
    finally:
        shutdown(llm)


def test_a_killed_stage_fails_the_engine_at_once(tiny_model: str, make_engine: Callable[..., LLM]) -> None:
    """Stage 0 dies: the core, which waits on stage 1's output, sees it through the workers' sentinels."""
    llm = make_engine(tiny_model, pipeline_parallel_size=2)
    mark_failed(llm)
    prompts = [{"prompt_token_ids": [1, 5, 9, 17]}, {"prompt_token_ids": [1, 90, 3, 4]}]
    kill_rank_mid_run(llm, prompts, rank=0)
    with pytest.raises(RuntimeError, match="worker rank 0"):  # later calls fail the same way, never hang
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)


def test_prompt_logprobs_of_chunked_prefills_with_two_steps_in_flight(
    tmp_path: Path, make_engine: Callable[..., LLM]
) -> None:
    """pp=2 keeps two steps in flight: step i + 1 is scheduled (advancing num_computed_tokens) before step i's output
    is read. Every prompt position's logprobs must still be delivered once, as with one rank (the rows are placed by
    the step they came from, not by the request's current count), with the same tokens; no deadlock either, with
    whole prompts going down and logprob rows coming up in the same steps."""
    tiny_model = save_tiny_llama(tmp_path, max_position_embeddings=1024)
    long_prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 90 for j in range(600)]} for i in range(16)]
    with_prompt_logprobs = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=20, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    params = [with_prompt_logprobs if i % 2 == 0 else greedy for i in range(len(long_prompts))]
    # many requests per step, 32 tokens each: prompts are chunked over many steps, two of them in flight
    settings = {"max_model_len": 1024, "max_num_batched_tokens": 512, "long_prefill_token_threshold": 32}
    expected = make_engine(tiny_model, **settings).generate(long_prompts, params, use_tqdm=False)
    llm = make_engine(tiny_model, pipeline_parallel_size=2, **settings)
    outputs: list[Any] = []
    generate = lambda: outputs.extend(llm.generate(long_prompts, params, use_tqdm=False))  # noqa: E731
    thread = threading.Thread(target=generate, daemon=True)  # daemon: a deadlocked one must not hold the exit
    thread.start()
    thread.join(_HANG_GUARD_S)
    assert not thread.is_alive(), "the pipeline hung"
    assert llm.llm_engine.engine_core.batch_queue.peak_in_flight == 2
    assert _tokens(outputs) == _tokens(expected)
    assert [len(out.prompt_logprobs or []) for out in outputs] == [len(out.prompt_logprobs or []) for out in expected]
    assert [out.prompt_logprobs for out in outputs] == [out.prompt_logprobs for out in expected]
    shutdown(llm)


def test_a_step_larger_than_the_pipe_while_a_larger_output_waits(
    tmp_path: Path, make_engine: Callable[..., LLM]
) -> None:
    """pp=2, two requests: step 1 prefills A with prompt logprobs (its output ~240 KB), step 2, sent while step 1 is in
    flight, carries B's whole 14000-token prompt (ids above 65535, 5 pickled bytes each: ~70 KB). Both exceed a pipe's
    64 KiB buffer: the output rank must not wait to write its output before reading the next step while the core
    waits to write that step (it hung so). One attention head of 16 dimensions: B's prefill attention is quadratic in
    its length, and with the tiny model's four heads it took most of the test's CPU."""
    narrow = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 1, "num_key_value_heads": 1}
    tiny_model = save_tiny_llama(tmp_path, vocab_size=70000, max_position_embeddings=16384, **narrow)
    prompts = [
        {"prompt_token_ids": [1 + (7 * j) % 90 for j in range(1000)]},
        {"prompt_token_ids": [65536 + j % 4000 for j in range(14000)]},
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    ]
    settings = {"max_model_len": 16384, "max_num_batched_tokens": 1024, "kv_cache_memory_bytes": 2**26}
    expected = make_engine(tiny_model, **settings).generate(prompts, params, use_tqdm=False)
    llm = make_engine(tiny_model, pipeline_parallel_size=2, **settings)
    executor = llm.llm_engine.executor
    sent: list[tuple[str, int]] = []  # ("step" | "output", pickled bytes), in the core's order
    submit, collect = executor.submit, executor.collect

    def sized_submit(scheduler_output: Any) -> None:
        sent.append(("step", len(pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL))))
        submit(scheduler_output)

    def sized_collect() -> Any:
        output = collect()
        sent.append(("output", len(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL))))
        return output

    executor.submit, executor.collect = sized_submit, sized_collect  # type: ignore[method-assign]
    outputs: list[Any] = []
    thread = threading.Thread(target=lambda: outputs.extend(llm.generate(prompts, params, use_tqdm=False)), daemon=True)
    thread.start()
    thread.join(_HANG_GUARD_S)
    assert not thread.is_alive(), "the pipeline hung"
    # the case: the second step went down larger than a pipe's buffer before the first step's larger output came up
    assert sent[1][0] == "step" and sent[1][1] > 2**16 and sent[2] == ("output", sent[2][1]) and sent[2][1] > 2**16
    assert _tokens(outputs) == _tokens(expected)
    assert [out.prompt_logprobs for out in outputs] == [out.prompt_logprobs for out in expected]
    shutdown(llm)

"""Fixtures for end-to-end engine tests on the real default model.

Loading the GGUF (dequantize) and its tokenizer takes several seconds; engines with different configs reuse one
loaded copy through a memo over the loader functions (test-only). The memo and the default engine live as long as
this package's tests run (package scope), so a worker going on to other directories gives their memory back.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import folio.engine.llm_engine as llm_engine_module
import folio.worker.worker as worker_module
from folio import LLM, SamplingParams
from tests.engine.greedy_compare import GreedyRun, compare_greedy, from_folio_output, hf_greedy_many
from tests.engine.prompts import all_prompt_token_ids
from tests.small_engine import SMALL_ENGINE

HF_REFERENCE_NEW_TOKENS = 32


@pytest.fixture(scope="package", autouse=True)
def _memoized_loading() -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    original_load_model = worker_module.load_model

    # A few models, not every one the session built: each holds ~0.5-1 GB (weights, packed copies), and an unbounded
    # memo grew a test process to 8 GB (13 GB in a pytest-xdist worker, killed by the OOM killer).
    @functools.lru_cache(maxsize=3)
    def load_model_once(path: str, dtype: torch.dtype, device: torch.device, **kwargs: Any) -> Any:
        return original_load_model(path, dtype, device, **kwargs)

    def load_model_memo(*args: Any, before_each_tensor: Any = None, **kwargs: Any) -> Any:
        return load_model_once(*args, **kwargs)  # the hook is per worker (its thread governor): not in the key

    mp.setattr(worker_module, "load_model", load_model_memo)
    mp.setattr(llm_engine_module, "load_tokenizer", functools.cache(llm_engine_module.load_tokenizer))
    yield
    mp.undo()


_LIVE_ENGINES: weakref.WeakSet[LLM] = weakref.WeakSet()  # every LLM built in this session and still alive


@pytest.fixture(scope="package", autouse=True)
def _track_engines() -> Iterator[None]:
    """Records every LLM built by the engine tests, so that ``_no_leaks_after_each_test`` can check them all."""
    mp = pytest.MonkeyPatch()
    original_init = LLM.__init__

    def tracking_init(self: LLM, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        _LIVE_ENGINES.add(self)

    mp.setattr(LLM, "__init__", tracking_init)
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _no_leaks_after_each_test() -> Iterator[None]:
    """After every engine test, every live engine holds no request and no block, in either KV tier."""
    yield
    for engine in list(_LIVE_ENGINES):
        assert_no_leaks(engine)


@pytest.fixture(scope="package")
def llm() -> LLM:
    """The default engine: SmolLM2 in float32 with default settings."""
    return LLM(dtype="float32", **SMALL_ENGINE)


@pytest.fixture(scope="package")
def hf_reference(hf_model: Any, tokenizer: Any) -> list[GreedyRun]:
    """transformers' float32 greedy runs over tests/engine/prompts.py: the reference every engine is held to."""
    return hf_greedy_many(hf_model, all_prompt_token_ids(tokenizer), HF_REFERENCE_NEW_TOKENS)


def greedy_verdicts(
    llm: LLM, tokenizer: Any, hf_reference: list[GreedyRun], num_prompts: int | None = None
) -> list[str]:
    """``llm``'s greedy runs over the reference prompts (the first ``num_prompts``, default all), each held to
    transformers' by compare_greedy (which raises where the top-5 rule fails): one verdict per prompt,
    'identical' or 'diverged@step'."""
    prompts = all_prompt_token_ids(tokenizer)[:num_prompts]
    params = SamplingParams(temperature=0.0, max_tokens=HF_REFERENCE_NEW_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        compare_greedy(ref, from_folio_output(out), f"prompt {i}")
        for i, (ref, out) in enumerate(zip(hf_reference[: len(outputs)], outputs, strict=True))
    ]


@pytest.fixture()
def make_llm() -> Callable[..., LLM]:
    def make(**kwargs: Any) -> LLM:
        return LLM(dtype="float32", **{**SMALL_ENGINE, **kwargs})

    return make


def assert_no_leaks(llm: LLM) -> None:
    """Every KV block is back in the free queue and every ref count is 0."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    manager = engine.kv_cache_manager
    pool = manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_blocks, "KV blocks leaked"
    assert all(block.ref_count == 0 for block in pool.blocks), "a KV block still has references"
    assert not manager.req_to_blocks, f"block lists left for {list(manager.req_to_blocks)}"
    assert manager.find_leaks() == [], manager.find_leaks()  # the host tier's blocks too


def clone_params(params: Any, **changes: Any) -> Any:
    new = copy.deepcopy(params)
    for k, v in changes.items():
        setattr(new, k, v)
    return new

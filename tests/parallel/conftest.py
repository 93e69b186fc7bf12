"""Fixtures for the multiprocess executor and tensor parallelism: a tiny random Llama that tp=2 and tp=4 split
(4 heads, 2 KV heads), and the leak checks every test here ends with."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from folio import LLM
from tests.engine.conftest import assert_no_leaks
from tests.tiny_models import save_tiny_llama

TINY_KV_BYTES = 2**22  # per rank; the tiny model's blocks are small
_ENGINES: weakref.WeakSet[LLM] = weakref.WeakSet()
_FAILED: weakref.WeakSet[LLM] = weakref.WeakSet()  # engines a test made fail on purpose (a killed worker)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(Path(tmp_path_factory.mktemp("tiny_tp")))


@pytest.fixture(scope="session")
def make_engine() -> Callable[..., LLM]:
    """An LLM in float32 with a small KV cache, tracked for the leak checks (shut down by ``shutdown``)."""

    def make(model: str | None = None, **kwargs: Any) -> LLM:
        kwargs.setdefault("kv_cache_memory_bytes", TINY_KV_BYTES if model else 2**26)
        kwargs.setdefault("max_model_len", 256)
        llm = LLM(model, dtype="float32", **kwargs)
        _ENGINES.add(llm)
        return llm

    return make


def shutdown(llm: LLM) -> None:
    """Stops the engine's worker processes (the in-process executor has none) and checks they are gone."""
    executor = llm.llm_engine.executor
    llm.llm_engine.engine_core.shutdown()
    for proc in getattr(executor, "_procs", []):
        assert not proc.is_alive(), f"worker pid {proc.pid} outlived shutdown()"


def mark_failed(llm: LLM) -> None:
    """An engine whose worker a test killed mid-run: its requests stay unfinished, the leak checks skip it."""
    _FAILED.add(llm)


@pytest.fixture(autouse=True)
def _no_leaks_after_each_test() -> Iterator[None]:
    """After every test, every engine (running or shut down, not failed on purpose) holds no request and no KV
    block."""
    yield
    for llm in list(_ENGINES):
        if llm not in _FAILED:
            assert_no_leaks(llm)

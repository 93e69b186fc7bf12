"""Fixtures for the multiprocess executor and tensor parallelism: a tiny random Llama that tp=2 and tp=4 split
(4 heads, 2 KV heads), and the leak checks every test here ends with."""

from __future__ import annotations

import os
import signal
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from folio import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks
from tests.server.conftest import wait_until
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
        kwargs.setdefault("device", "cpu")  # gloo ranks; NCCL: test_multiproc's CUDA test
        kwargs.setdefault("cpu_huge_pages", False)  # as tests/small_engine.py says
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


HANG_GUARD_S = 60.0


def shm_segments(pid: int) -> list[str]:
    """The shared-memory all-reduce segments (folio/parallel/shm_allreduce.py) process pid maps, each listed as
    its /dev/shm path + " (deleted)": the name is unlinked once every rank has mapped it."""
    with open(f"/proc/{pid}/maps") as maps:
        return sorted({line.split(maxsplit=5)[-1].strip() for line in maps if "/folio_tp_" in line})


def shm_names(creator_pids: list[int]) -> set[str]:
    """The segment names in /dev/shm that these processes created (none is left once the ranks have started,
    whatever dies later). Only theirs: another test's engine on a parallel test worker makes its own meanwhile."""
    prefixes = tuple(f"folio_tp_{pid}_" for pid in creator_pids)
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefixes)}


def kill_rank_mid_run(
    llm: LLM, prompts: list[Any], rank: int, how: str = "exit code -9", reaped_within_s: float = 0.0
) -> None:
    """Generates in a thread, SIGKILLs worker ``rank`` once a request has decoded 3 tokens (the scheduler's own
    record, checked in the engine's thread right after each update: a fast engine would finish between two polls
    from outside), and asserts the engine fails promptly with that rank's death (``how``: what the error says of it in
    brackets), with every worker process gone: at once (the mp executor joins them), or within ``reaped_within_s``
    where another process reaps them (Ray's raylet kills its actors' processes after the executor returns)."""
    import psutil

    pids = llm.llm_engine.executor.worker_pids
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    scheduler = llm.llm_engine.scheduler
    update_from_output = scheduler.update_from_output
    killed = threading.Event()

    def update_then_kill(*args: Any) -> Any:
        outputs = update_from_output(*args)
        if not killed.is_set() and any(r.num_output_tokens >= 3 for r in scheduler.requests.values()):
            killed.set()
            os.kill(pids[rank], signal.SIGKILL)
        return outputs

    scheduler.update_from_output = update_then_kill  # type: ignore[method-assign]
    thread = threading.Thread(target=generate)
    thread.start()
    thread.join(HANG_GUARD_S)  # hang guard only
    assert killed.is_set(), "no request decoded 3 tokens"
    assert not thread.is_alive(), f"the engine hung after worker rank {rank} died"
    (error,) = errors
    assert isinstance(error, RuntimeError)
    assert f"worker rank {rank} (pid {pids[rank]}) died ({how})" in str(error)

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    for pid in pids:  # the executor stopped the other ranks too
        assert wait_until(lambda pid=pid: gone(pid), reaped_within_s), f"worker pid {pid} outlived the engine"

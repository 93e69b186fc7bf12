"""Model loading runs under the worker's CPU thread governor (folio/worker/worker.py), as steps do: where other
processes take cores, every tensor loads on fewer threads (each OpenMP region of a load otherwise waits for a
descheduled thread); on a quiet machine, on all of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import folio.worker.worker as worker_module
from folio import LLM
from folio.model import loader
from folio.worker.cpu_threads import CpuThreadGovernor
from tests.tiny_models import TINY_SHAPE, save_tiny_llama


class ScriptedGovernor(CpuThreadGovernor):
    """The real governor on clocks that say ``lost_cores`` of the machine are taken: each reading is 1 s later
    (a window each; every 5 s it probes all threads again, as it does for real)."""

    lost_cores = 0.0
    built: list[CpuThreadGovernor] = []

    def __init__(self, max_threads: int) -> None:
        self.now = 0.0
        self.built.append(self)

        def clock() -> float:
            self.now += 1.0
            return self.now

        super().__init__(max_threads, clock=clock, wait_clock=lambda: self.now * self.lost_cores)


@pytest.mark.parametrize(("lost_cores", "threads"), [(1.0, 1), (0.0, 2)], ids=["busy", "quiet"])
def test_each_tensor_loads_on_the_governors_thread_count(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, lost_cores: float, threads: int
) -> None:
    model_dir = save_tiny_llama(tmp_path)
    seen: list[tuple[int, int]] = []  # per tensor: (torch's thread count, the governor's)

    def spying_load_model(*args: Any, before_each_tensor: Any = None, **kwargs: Any) -> Any:
        assert before_each_tensor is not None, "the worker loads without its thread governor"

        def hook() -> None:
            before_each_tensor()
            seen.append((torch.get_num_threads(), ScriptedGovernor.built[-1].threads))

        return loader.load_model(*args, before_each_tensor=hook, **kwargs)

    monkeypatch.setattr(worker_module, "load_model", spying_load_model)  # a real load, not the session's memo
    monkeypatch.setattr(ScriptedGovernor, "lost_cores", lost_cores)
    monkeypatch.setattr(ScriptedGovernor, "built", [])
    monkeypatch.setattr(worker_module, "CpuThreadGovernor", ScriptedGovernor)
    original_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        LLM(model=model_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=2**24, max_model_len=256)
    finally:
        torch.set_num_threads(original_threads)
    num_tensors = 3 + 9 * TINY_SHAPE["num_hidden_layers"]  # embedding, final norm, LM head; 9 per layer
    assert len(seen) == num_tensors + 1  # before each tensor, and once more to find the end
    assert all(torch_threads == governed for torch_threads, governed in seen), seen
    assert seen[0][0] == threads  # the first tensor already: the window began with the worker
    assert {torch_threads for torch_threads, _ in seen} == ({1, 2} if lost_cores else {2})  # busy: probes too


def test_a_later_engine_in_the_process_starts_from_the_quiet_count(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An engine whose governor left torch on fewer threads (a neighbour came and went, the engine was dropped
    mid-reduction) must not hand that count to the next engine in the process as its quiet count: the benchmark's
    --compare-rounds builds a fresh engine per run, and every later one ran on one thread of two for good."""
    model_dir = save_tiny_llama(tmp_path)
    monkeypatch.setattr(ScriptedGovernor, "built", [])
    monkeypatch.setattr(worker_module, "CpuThreadGovernor", ScriptedGovernor)
    monkeypatch.setattr(worker_module, "_last_governed_threads", None)  # this test's engines only; restored after
    original_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(ScriptedGovernor, "lost_cores", 1.0)
        first = LLM(model=model_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=2**24, max_model_len=256)
        worker = first.llm_engine.engine_core.executor.worker
        for _ in range(10):  # steps under the neighbour until a window has taken the thread away (not a probe's)
            worker._govern_threads()
            if torch.get_num_threads() == 1:
                break
        assert ScriptedGovernor.built[-1].threads == 1 and torch.get_num_threads() == 1  # left reduced
        del first, worker
        monkeypatch.setattr(ScriptedGovernor, "lost_cores", 0.0)
        LLM(model=model_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=2**24, max_model_len=256)
        assert ScriptedGovernor.built[-1].max_threads == 2
        assert torch.get_num_threads() == 2  # a quiet machine: the second engine runs on both
        torch.set_num_threads(1)  # set by hand, not by a governor: a later engine keeps it
        LLM(model=model_dir, device="cpu", dtype="float32", kv_cache_memory_bytes=2**24, max_model_len=256)
        assert ScriptedGovernor.built[-1].max_threads == 1
    finally:
        torch.set_num_threads(original_threads)

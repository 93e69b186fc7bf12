"""The multiprocess executor on real worker processes: the same greedy tokens as the in-process worker; bad
parallel settings refused at start naming the flag and the limit; a worker killed mid-run is an engine error at
once (offline: RuntimeError, later calls too; serving: the stream's error event, /health 503, exit 1), and no
worker process outlives its engine."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from folio import LLM, SamplingParams
from folio.parallel.group import rendezvous_store
from tests.parallel.conftest import TINY_KV_BYTES, kill_rank_mid_run, mark_failed, shm_names, shm_segments, shutdown
from tests.server.conftest import http_status, start_server, stream_killing_after_first_event, wait_until

_PROMPTS = [{"prompt_token_ids": [1, 5, 9, 17, 33, 40, 41]}, {"prompt_token_ids": [1, 90, 3, 4]}]
_GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
_HANG_GUARD_S = 60.0


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(_PROMPTS, _GREEDY, use_tqdm=False)]


def test_one_worker_process_gives_the_in_process_tokens(tiny_model: str, make_engine: Callable[..., LLM]) -> None:
    expected = _tokens(make_engine(tiny_model))
    llm = make_engine(tiny_model, distributed_executor_backend="mp")
    try:
        (pid,) = llm.llm_engine.executor.worker_pids
        assert pid != os.getpid()
        assert _tokens(llm) == expected
    finally:
        shutdown(llm)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tensor_parallel_size": 2},
            r"tensor_parallel_size \(--tensor-parallel-size\) 2 must divide the model's number of attention heads 9",
        ),
        (
            {"tensor_parallel_size": 4, "tensor_parallel_uneven_heads": True},
            r"tensor_parallel_size \(--tensor-parallel-size\) 4 with --tensor-parallel-uneven-heads must be at most "
            "the model's number of KV heads 3, or a multiple of it up to its number of attention heads 9",
        ),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
        (
            {"tensor_parallel_size": 3, "distributed_executor_backend": "uni"},
            "distributed_executor_backend 'uni' runs one rank; tensor_parallel_size 3 needs 'mp'",
        ),
        (
            {"distributed_executor_backend": "dask"},
            r"distributed_executor_backend must be one of \('uni', 'mp', 'ray'\), got 'dask'",
        ),
        (
            {"tensor_parallel_size": 3, "cpu_allreduce": "tcp"},
            r"cpu_allreduce \(--cpu-allreduce\) must be one of \('shm', 'gloo'\), got 'tcp'",
        ),
        (
            {
                "tensor_parallel_size": 3,
                "kv_offloading_size": 0.01,
                "kv_offloading_disk_path": "/nonexistent/folio-kv",
                "kv_offloading_disk_size": 0.1,
            },
            "kv_offloading_disk_path with tensor_parallel_size 3 is not supported yet",
        ),
    ],
)
def test_bad_parallel_settings_are_refused_before_any_worker_starts(kwargs: dict[str, object], message: str) -> None:
    before = set(psutil.Process().children())
    with pytest.raises(ValueError, match=message):
        LLM(dtype="float32", kv_cache_memory_bytes=2**26, **kwargs)  # type: ignore[arg-type]
    assert set(psutil.Process().children()) == before


def test_more_ranks_than_gpus_is_refused(tiny_model: str) -> None:
    num_gpus = torch.cuda.device_count()
    if num_gpus >= 4:
        pytest.skip("this machine has a GPU for every rank the tiny model can split into")
    tp = 2 if num_gpus < 2 else 4
    message = (
        f"tensor_parallel_size \\(--tensor-parallel-size\\) {tp} needs one GPU per rank; this machine has {num_gpus}"
    )
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, device="cuda", tensor_parallel_size=tp, kv_cache_memory_bytes=TINY_KV_BYTES)


def test_a_killed_worker_fails_the_engine_at_once(tiny_model: str, make_engine: Callable[..., LLM]) -> None:
    llm = make_engine(tiny_model, tensor_parallel_size=2)
    worker_pids = list(llm.llm_engine.executor.worker_pids)
    mark_failed(llm)
    for pid in llm.llm_engine.executor.worker_pids:  # the shared-memory all-reduce is on, its name already gone
        (segment,) = shm_segments(pid)
        assert segment.endswith(" (deleted)")
    kill_rank_mid_run(llm, _PROMPTS, rank=1)
    with pytest.raises(RuntimeError, match="worker rank 1"):  # later calls fail the same way, never hang
        llm.generate(_PROMPTS, _GREEDY, use_tqdm=False)
    assert shm_names(worker_pids) == set()  # a SIGKILLed rank leaves nothing in /dev/shm


def test_a_killed_worker_makes_the_server_answer_503_and_exit_1(tmp_path: Path, tiny_model: str) -> None:
    args = [
        "--model",
        tiny_model,
        "--device",
        "cpu",
        "-tp",
        "2",
        "--kv-cache-memory-bytes",
        str(TINY_KV_BYTES),
        "--max-model-len",
        "256",
    ]
    server = start_server(tmp_path, "tp_death", args)
    try:
        core_pid = httpx.get(server.url("/version")).json()["engine_core_pid"]
        # the ranks are the children of the core's fork server (its other child: multiprocessing's resource tracker)
        workers = [p for p in psutil.Process(core_pid).children(recursive=True) if p.ppid() != core_pid]
        assert len(workers) == 2
        body = {"prompt": "w3 w4 w5", "max_tokens": 200, "ignore_eos": True, "stream": True}
        error = stream_killing_after_first_event(server, body, workers[-1].kill, _HANG_GUARD_S)
        assert error["code"] == "engine_dead"
        # marked dead before the error event went out; the server answers for 2 s more (as for the core's death)
        assert http_status(server) == 503
        assert server.process.wait(timeout=_HANG_GUARD_S) == 1  # hang guard only
        log = server.log_tail(20000)
        assert "RuntimeError: worker rank 1" in log and "died (exit code -9)" in log
        assert wait_until(lambda: not any(w.is_running() and w.status() != "zombie" for w in workers), 10)
    finally:
        server.stop()


def test_the_rendezvous_port_is_held_from_the_moment_it_is_chosen() -> None:
    """The ranks' rendezvous listens on its port as soon as it exists: no other process can take the port before
    rank 0 starts (a port found free and bound later could be, with two engines starting at once)."""
    store = rendezvous_store()
    with socket.socket() as other, pytest.raises(OSError) as refused:
        other.bind(("127.0.0.1", store.port))
    assert refused.value.errno == errno.EADDRINUSE
    with socket.create_connection(("127.0.0.1", store.port), timeout=10):
        pass  # and it accepts the ranks' connections

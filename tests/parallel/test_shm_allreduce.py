"""The shared-memory all-reduce and all-gather (folio/parallel/shm_allreduce.py) on real spawned processes joined
by a gloo group: 2 and 3 ranks, sizes from 1 element to many slots (tails included), float32 and bfloat16, a
non-contiguous input. Every rank must hold the same bits, equal to the rank-ordered sum ((x0 + x1) + x2) and within
float32 rounding of the float64 sum; the gather must be every rank's input in rank order. Then the failures: a
peer that exited (a zombie, not yet reaped) and a peer that never arrives both raise a RuntimeError naming it
instead of waiting forever; and nothing is left in /dev/shm while the ranks run."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import torch

from folio import LLM, SamplingParams
from folio.parallel.group import init_rank_group, rendezvous_store
from folio.parallel.shm_allreduce import ShmCommunicator, shm_supported
from tests.parallel.conftest import shm_names, shm_segments, shutdown

pytestmark = pytest.mark.skipif(not shm_supported(), reason="the shared-memory path runs on x86-64 only")

SLOT_BYTES = 4096  # 1024 float32 elements: the sizes below cross slots, with tails
# (dtype, shape): one element, a tail shorter than a slot, a decode row, exactly a slot, a slot and one, a batch
# of decode rows (36 slots), a bfloat16 row a slot and one long
CASES: list[tuple[torch.dtype, tuple[int, ...]]] = [
    (torch.float32, (1,)),
    (torch.float32, (7,)),
    (torch.float32, (1, 576)),
    (torch.float32, (1024,)),
    (torch.float32, (1025,)),
    (torch.float32, (64, 576)),
    (torch.bfloat16, (2049,)),
]
HANG_GUARD_S = 60.0


def rank_input(rank: int, case: int) -> torch.Tensor:
    """Rank r's tensor of case i, scaled by 10**r so that the order of the additions changes the rounding."""
    dtype, shape = CASES[case]
    values = torch.randn(shape, generator=torch.Generator().manual_seed(1000 * case + rank), dtype=torch.float64)
    return (values * 10.0**rank).to(dtype)


def _rank_main(rank: int, world_size: int, port: int, ending: str, conn: Any) -> None:
    """One rank: every case through all_reduce and all_gather (plus a non-contiguous all-reduce), the results to
    the parent; then ``ending``: "exit" (the last rank exits, the others try one more all-reduce), "stall" (the
    last rank waits for the parent, the others try one with a 0.5 s timeout)."""
    try:
        torch.set_num_threads(1)
        group = init_rank_group(rank, world_size, port, "cpu", "gloo")
        comm = ShmCommunicator.create(group.group, rank, world_size, slot_bytes=SLOT_BYTES)
        reduced = [comm.all_reduce(rank_input(rank, i).clone()) for i in range(len(CASES))]
        # after a round every rank has finished create(), rank 0's unlink included
        with open("/proc/self/maps") as maps:
            mapped = [line.split()[-2] for line in maps if "folio_tp_" in line and line.rstrip().endswith("(deleted)")]
        gathered = [comm.all_gather(rank_input(rank, i)) for i in range(len(CASES))]
        strided = rank_input(rank, 5).t()  # [576, 64], not contiguous
        strided_sum = comm.all_reduce(strided)
        _send(conn, ("ok", {"mapped": mapped, "reduced": reduced, "gathered": gathered, "strided": strided_sum}))
        last = rank == world_size - 1
        if ending == "exit" and last:
            os._exit(0)
        if ending == "stall" and last:
            conn.recv()  # blocks until the parent has the others' errors
            os._exit(0)
        if ending == "exit":
            conn.recv()  # the parent's go: the last rank has exited (a zombie, not yet reaped)
        comm.timeout_s = 0.5
        try:
            comm.all_reduce(torch.ones(4))
            _send(conn, ("no error", None))
        except RuntimeError as e:
            _send(conn, (type(e).__name__, str(e)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        _send(conn, ("error", traceback.format_exc()))
    os._exit(0)


def _send(conn: Any, message: Any) -> None:
    """Plain pickle: multiprocessing's own would hand tensors over as shared memory of a process about to exit."""
    conn.send_bytes(pickle.dumps(message))


def _run_ranks(world_size: int, ending: str) -> tuple[list[dict[str, Any]], list[tuple[str, Any]], list[int]]:
    """Spawns the ranks; returns each rank's results, each surviving rank's ending report, and the pids."""
    ctx = multiprocessing.get_context("spawn")
    store = rendezvous_store()  # held here until the ranks are done, as an executor holds it
    port = store.port
    pipes = [ctx.Pipe() for _ in range(world_size)]
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, ending, pipes[r][1]), daemon=True)
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        results = [_receive(pipes[r][0]) for r in range(world_size)]
        for r, (status, payload) in enumerate(results):
            assert status == "ok", f"rank {r}: {payload}"
        # while every rank still runs: the segment's name is gone, only the ranks' mappings hold it
        rank0 = f"folio_tp_{procs[0].pid}_"
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(rank0)]
        if ending == "exit":  # the others' last round starts once the last rank is gone, however slow its exit
            _wait_until_zombie(procs[-1].pid)
            for r in range(world_size - 1):
                pipes[r][0].send("go")
        endings = [_receive(pipes[r][0]) for r in range(world_size - 1)]
        pipes[-1][0].send("go")  # the stalled rank may exit now (the exited one is gone)
        return [payload for _, payload in results], endings, [proc.pid for proc in procs]  # type: ignore[misc]
    finally:
        for proc in procs:
            proc.join(HANG_GUARD_S)
            if proc.is_alive():
                proc.kill()


def _wait_until_zombie(pid: int) -> None:
    """Until the child ``pid`` has exited and is not reaped yet (its rank's liveness check must see it dead)."""
    deadline = time.monotonic() + HANG_GUARD_S  # hang guard only
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"rank process {pid} did not exit"
        time.sleep(0.01)


def _receive(conn: Any) -> Any:
    assert conn.poll(HANG_GUARD_S), "a rank hung"  # hang guard only
    return pickle.loads(conn.recv_bytes())


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def _check_results(results: list[dict[str, Any]], world_size: int) -> None:
    for rank, result in enumerate(results):
        assert len(result["mapped"]) == 1, f"rank {rank} maps {result['mapped']}"  # the unlinked segment
        assert result["mapped"][0] == results[0]["mapped"][0]
    for i, (dtype, shape) in enumerate(CASES):
        inputs = [rank_input(r, i) for r in range(world_size)]
        rank_ordered = inputs[0].clone()
        for x in inputs[1:]:
            rank_ordered += x  # (x0 + x1) + x2, rounded to dtype after each addition
        for rank, result in enumerate(results):
            out = result["reduced"][i]
            assert out.dtype == dtype and out.shape == shape
            assert torch.equal(_bits(out), _bits(results[0]["reduced"][i])), f"case {i}: rank {rank} differs"
            assert torch.equal(_bits(out), _bits(rank_ordered)), f"case {i}: not the rank-ordered sum"
            assert torch.equal(result["gathered"][i], torch.stack(inputs)), f"case {i}: rank {rank} gather"
        exact = torch.stack([x.double() for x in inputs]).sum(0)
        magnitude = torch.stack([x.double().abs() for x in inputs]).sum(0)
        unit = torch.finfo(dtype).eps / 2  # unit roundoff: |sum error| <= (n - 1) * u * sum |x_i| (recursive sum)
        assert ((rank_ordered.double() - exact).abs() <= (world_size - 1) * unit * magnitude * 1.0001).all()
    expected_strided = sum((rank_input(r, 5).t() for r in range(1, world_size)), rank_input(0, 5).t().clone())
    for result in results:
        assert not result["strided"].is_contiguous()
        assert torch.equal(_bits(result["strided"].contiguous()), _bits(expected_strided.contiguous()))


def test_two_ranks_sum_exactly_and_a_dead_peer_raises_naming_it() -> None:
    results, endings, pids = _run_ranks(2, "exit")
    _check_results(results, 2)
    ((kind, message),) = endings
    assert kind == "PeerDiedError"
    assert message.startswith(f"shared-memory all-reduce on rank 0: rank 1 (pid {pids[1]}) died")


def test_three_ranks_sum_exactly_and_a_missing_peer_times_out_naming_it() -> None:
    results, endings, _ = _run_ranks(3, "stall")
    _check_results(results, 3)
    for rank, (kind, message) in enumerate(endings):
        assert kind == "RuntimeError"
        assert message.startswith(f"shared-memory all-reduce on rank {rank}: rank 2 did not arrive within 0.5 s")


def _outputs(llm: LLM) -> list[Any]:
    """Greedy tokens with their top-5 logprobs (gathered logits), greedy tokens by the distributed arg-max alone,
    and seeded top-p samples, for two prompts."""
    prompts: list[Any] = [{"prompt_token_ids": [1, 5, 9, 17, 33, 40, 41, 60, 7]}, {"prompt_token_ids": [1, 90, 3, 4]}]
    runs = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True),
    ]
    return [
        [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
        for params in runs
    ]


def test_tp2_through_shared_memory_gives_the_exact_gloo_outputs(
    tiny_model: str, make_engine: Callable[..., LLM]
) -> None:
    """Two ranks: a + b in either order is the same float, so shm and gloo must agree to the bit (logprobs too)."""
    gloo = make_engine(tiny_model, tensor_parallel_size=2, cpu_allreduce="gloo")
    try:
        assert [shm_segments(pid) for pid in gloo.llm_engine.executor.worker_pids] == [[], []]
        expected = _outputs(gloo)
    finally:
        shutdown(gloo)
    llm = make_engine(tiny_model, tensor_parallel_size=2)  # the default on the CPU
    try:
        assert llm.llm_engine.config.parallel_config.cpu_allreduce == "shm"
        segments = [shm_segments(pid) for pid in llm.llm_engine.executor.worker_pids]
        assert len(segments[0]) == 1 and segments[0] == segments[1] and segments[0][0].endswith(" (deleted)")
        assert segments[0][0].startswith(f"/dev/shm/folio_tp_{llm.llm_engine.executor.worker_pids[0]}_")  # rank 0's
        assert shm_names(llm.llm_engine.executor.worker_pids) == set()
        assert _outputs(llm) == expected
    finally:
        shutdown(llm)

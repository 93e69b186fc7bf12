"""The Ray executor on a real two-node Ray cluster on 127.0.0.1 (tests/parallel/ray_cluster.py): tp=2 with one actor
on each node gives one rank's greedy and seeded-sampling tokens on a tiny model; on the real model pp=2 follows tp=1
by the top-5 rule, and a killed stage's actor then fails the engine at once, as a dead worker process does; served
(`folio serve -tp 2`), a killed rank's actor makes the server answer 503 and exit 1. (Uneven heads at tp=2 are
test_tensor_parallel.py's: how heads split does not depend on the executor.)
Every engine ends with no KV block and no request held, and the cluster's CPUs are all free again after each test
(the placement group removed). Without Ray installed, the backend is a clear error.

The cluster tests need a network namespace with only loopback in it (ray_cluster.py says why): run outside one,
this module runs itself again under ``unshare -n`` (test_ray_tests_in_a_loopback_only_namespace) and the cluster
tests here are skipped; inside, the reverse.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from folio import LLM, RequestOutput, SamplingParams
from folio.cli import build_parser, engine_args_from
from tests.engine.conftest import assert_no_leaks
from tests.engine.greedy_compare import compare_greedy, from_folio_output
from tests.parallel.conftest import TINY_KV_BYTES, kill_rank_mid_run, mark_failed, shutdown
from tests.parallel.ray_cluster import LocalRayCluster, loopback_only
from tests.server.conftest import http_status, start_server, stream_killing_after_first_event, wait_until

_HAS_RAY = importlib.util.find_spec("ray") is not None
_IN_NAMESPACE = loopback_only()
_CLUSTER_TESTS = 4  # the tests below that take the ray_cluster fixture
_NAMESPACE_RUN_TIMEOUT_S = 720.0  # hang guard only: the run took 275-300 s beside two other xdist workers on a slow VM
_TEMP_DIR_VARIABLE = "FOLIO_TEST_RAY_TEMP_DIR"
_PROMPTS = [{"prompt_token_ids": [1, 5, 9, 17, 33, 40, 41, 60, 7]}, {"prompt_token_ids": [1, 90, 3, 4]}]
_GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
_SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
_REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
_REAL_GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)

needs_ray = pytest.mark.skipif(not _HAS_RAY, reason="Ray is not installed: pip install -e .[ray]")
# the cluster tests: skipped before their fixtures are built (the outer run does not build the tiny model)
in_namespace = pytest.mark.skipif(
    not (_HAS_RAY and _IN_NAMESPACE),
    reason="runs in a loopback-only network namespace (test_ray_tests_in_a_loopback_only_namespace), with Ray",
)


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(_PROMPTS, params, use_tqdm=False)]


def _verdicts_against(reference: list[RequestOutput], llm: LLM) -> list[str]:
    """llm's greedy outputs (with logprobs) on the real prompts held to the reference's by the top-5 rule."""
    outputs = llm.generate(_REAL_PROMPTS, _REAL_GREEDY, use_tqdm=False)
    return [
        compare_greedy(from_folio_output(ref), from_folio_output(out), f"prompt {i}")
        for i, (ref, out) in enumerate(zip(reference, outputs, strict=True))
    ]


def test_the_ray_backend_without_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as where it is not installed
    before = set(psutil.Process().children())
    with pytest.raises(ValueError, match=r"distributed_executor_backend 'ray' needs Ray: pip install -e \.\[ray\]"):
        LLM(device="cpu", pipeline_parallel_size=2, distributed_executor_backend="ray")
    assert set(psutil.Process().children()) == before


@needs_ray  # the config refuses the ray backend without Ray
def test_the_ray_flags_reach_the_engine_config() -> None:
    argv = ["serve", "-tp", "2", "--distributed-executor-backend", "ray", "--ray-address", "127.0.0.1:6379"]
    parallel = engine_args_from(build_parser().parse_args(argv)).create_engine_config("m", 64).parallel_config
    assert (parallel.distributed_executor_backend, parallel.ray_address, parallel.world_size) == (
        "ray",
        "127.0.0.1:6379",
        2,
    )


@needs_ray
@pytest.mark.skipif(_IN_NAMESPACE, reason="already in a loopback-only namespace: the cluster tests run here")
def test_ray_tests_in_a_loopback_only_namespace() -> None:
    """This module again, under `unshare -n` with lo up: every cluster test passes there."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare (util-linux) and ip (iproute2) to make a loopback-only network namespace")
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here (unshare -n: {probe.stderr.strip()})")
    inner = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--durations=5", __file__]
    command = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *inner]
    cluster = LocalRayCluster()  # its temp dir, handed to the inner run: whatever happens there, stopped here too
    env = {**os.environ, _TEMP_DIR_VARIABLE: str(cluster.temp_dir)}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        output, _ = proc.communicate(timeout=_NAMESPACE_RUN_TIMEOUT_S)  # hang guard only
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # pytest's KeyboardInterrupt still runs the fixtures' teardown
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"the namespace run hung:\n{output[-8000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.stop()
    print(output[-4000:])  # the inner run's summary and durations (pytest -s shows them)
    assert proc.returncode == 0, output[-12000:]
    passed = re.search(r"(\d+) passed", output)
    assert passed is not None and int(passed.group(1)) == _CLUSTER_TESTS + 2, output[-2000:]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """The two-node cluster's address, for the module; then the driver's connection and the cluster stopped."""
    import ray

    temp_dir = os.environ.get(_TEMP_DIR_VARIABLE)  # the outer run's (the test's own environment, not the engine's)
    cluster = LocalRayCluster(Path(temp_dir)) if temp_dir else LocalRayCluster()
    try:
        cluster.start()
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.stop()


@pytest.fixture(scope="module")
def real_reference(make_engine: Callable[..., LLM]) -> list[RequestOutput]:
    """The real model's greedy outputs with logprobs at one in-process rank."""
    return make_engine().generate(_REAL_PROMPTS, _REAL_GREEDY, use_tqdm=False)


@pytest.fixture
def ray_pools_full_after(ray_cluster: str) -> Iterator[str]:
    """After the test: every CPU of the cluster is free again (the executor removed its placement group)."""
    yield ray_cluster
    import ray

    if ray.is_initialized():
        total = ray.cluster_resources()["CPU"]
        assert total == 2.0
        assert wait_until(lambda: ray.available_resources().get("CPU", 0.0) == total, 30), ray.available_resources()


@in_namespace
def test_ray_tp2_on_two_nodes_matches_one_rank(
    tiny_model: str, make_engine: Callable[..., LLM], ray_pools_full_after: str
) -> None:
    import ray

    one = make_engine(tiny_model)
    expected = [_tokens(one, p) for p in (_GREEDY, _SAMPLED)]
    llm = make_engine(
        tiny_model, tensor_parallel_size=2, distributed_executor_backend="ray", ray_address=ray_pools_full_after
    )
    try:
        executor = llm.llm_engine.executor
        nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        assert len(nodes) == 2 and set(executor.node_ids) == nodes  # one actor on each node
        assert os.getpid() not in executor.worker_pids and len(set(executor.worker_pids)) == 2
        assert ray.available_resources().get("CPU", 0.0) == 0.0  # both bundles held while the engine runs
        # half the KV heads per rank: 2x the blocks for the same bytes, as with the mp executor
        assert llm.llm_engine.config.cache_config.num_blocks == 2 * one.llm_engine.config.cache_config.num_blocks
        assert [_tokens(llm, p) for p in (_GREEDY, _SAMPLED)] == expected
    finally:
        shutdown(llm)


@in_namespace
def test_more_ranks_than_the_cluster_has_cpus_are_refused(tiny_model: str, ray_pools_full_after: str) -> None:
    message = r"tensor_parallel_size \(--tensor-parallel-size\) 4 needs one CPU per rank; the Ray cluster has 2"
    with pytest.raises(ValueError, match=message):
        LLM(
            tiny_model,
            device="cpu",
            tensor_parallel_size=4,
            distributed_executor_backend="ray",
            ray_address=ray_pools_full_after,
        )


@in_namespace
def test_ray_pp2_on_the_real_model_matches_tp1_then_a_killed_stage_fails_it(
    make_engine: Callable[..., LLM], real_reference: list[RequestOutput], ray_pools_full_after: str
) -> None:
    """The default model in 2 stages of 15 layers, one actor per node; then stage 0 is killed mid-run while the
    core waits on stage 1's output (one engine for both: an engine start costs seconds on this machine)."""
    llm = make_engine(pipeline_parallel_size=2, distributed_executor_backend="ray", ray_address=ray_pools_full_after)
    try:
        executor = llm.llm_engine.executor
        assert len(set(executor.node_ids)) == 2 and executor.output_rank == 1
        verdicts = _verdicts_against(real_reference, llm)
        print("Ray pp=2 vs tp=1:", verdicts)
        assert_no_leaks(llm)
        mark_failed(llm)
        death = f"Ray actor on node {executor.node_ids[0][:8]}, exit type SYSTEM_ERROR"
        kill_rank_mid_run(llm, _REAL_PROMPTS, 0, death, reaped_within_s=10)
        with pytest.raises(RuntimeError, match="worker rank 0"):  # later calls fail the same way, never hang
            llm.generate(_REAL_PROMPTS, _REAL_GREEDY, use_tqdm=False)
    finally:
        shutdown(llm)


def _rank_actor_processes() -> list[psutil.Process]:
    """The live processes of ranks' Ray actors on this machine (Ray titles them after the actor's class)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["cmdline"] or [""])[0].startswith("ray::RayWorker") and proc.info["status"] != "zombie":
                found.append(proc)
    return found


@in_namespace
def test_a_killed_ray_actor_makes_the_server_answer_503_and_exit_1(
    tmp_path: Path, tiny_model: str, ray_pools_full_after: str
) -> None:
    """`folio serve` with tp=2 on the cluster: a rank's actor killed mid-stream ends the stream with engine_dead,
    /health answers 503 and the server exits 1 with the dead rank in its log, as with the mp executor."""
    args = ["--model", tiny_model, "--device", "cpu", "-tp", "2", "--distributed-executor-backend", "ray"]
    args += ["--ray-address", ray_pools_full_after, "--kv-cache-memory-bytes", str(TINY_KV_BYTES)]
    server = start_server(tmp_path, "ray_death", [*args, "--max-model-len", "256"])
    try:
        # the server's two (an earlier test's killed actors may still be exiting)
        assert wait_until(lambda: len(_rank_actor_processes()) == 2, 30), _rank_actor_processes()
        actors = _rank_actor_processes()
        body = {"prompt": "w3 w4 w5", "max_tokens": 200, "ignore_eos": True, "stream": True}
        error = stream_killing_after_first_event(server, body, actors[-1].kill, _NAMESPACE_RUN_TIMEOUT_S)
        assert error["code"] == "engine_dead"
        assert http_status(server) == 503  # marked dead before the error event went out
        assert server.process.wait(timeout=_NAMESPACE_RUN_TIMEOUT_S) == 1  # hang guard only
        log = server.log_tail(20000)
        assert "RuntimeError: worker rank" in log and "Ray actor on node" in log, log[-3000:]
    finally:
        server.stop()

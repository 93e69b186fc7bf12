"""RayExecutor (distributed_executor_backend="ray"): one Ray actor per rank, placed by a placement group on the
nodes of a Ray cluster, for models and batches that need more than one machine.

The actors run the multiprocess executor's worker code (folio/executor/worker_proc.py: the same rank group, tensor
and pipeline passes, Worker); only the transport differs. The engine core is the Ray driver: it joins the cluster
(ParallelConfig.ray_address, or the process's current ray.init() connection), reserves one bundle per rank
({"CPU": 1} on the CPU, {"GPU": 1} on CUDA; PACK, as vLLM: as few nodes as the bundles fit on, and rank 0's bundle
on the driver's node), and the ranks rendezvous for torch.distributed at the driver node's IP as Ray reports it
(rank 0 listens there). Each step the SchedulerOutput goes to every actor (one actor task each, run in submission
order); only the output rank's task returns its ModelRunnerOutput. Every wait watches every rank's outstanding
task: a dead actor (RayActorError) is an engine error at once, a RuntimeError naming the rank, as a dead worker
process is for the mp executor; the executor then kills the other actors and frees the placement group.
Ray is imported here only: everything else runs without it (pip install -e .[ray]).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import time
import weakref
from typing import Any

from folio.config import EngineConfig
from folio.core.sched_output import ModelRunnerOutput, SchedulerOutput
from folio.executor.distributed import DistributedExecutor, check_num_devices, check_parallel_start
from folio.executor.worker_proc import WorkerReady, apply_ready, is_output_rank, ready_message, start_worker

logger = logging.getLogger("folio")

_READY_TIMEOUT_S = 600.0  # model load and the rank group's rendezvous on every actor (as the mp executor's)
_PLACEMENT_TIMEOUT_S = 120.0  # the cluster has the resources (checked first) but other jobs may hold them
_PING_TIMEOUT_S = 5.0  # an actor busy in a step does not answer; a dead one fails at once


class RayWorker:
    """One rank, as a Ray actor (ray.remote(RayWorker) at run time, so that this module imports without Ray)."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.sends_output = False

    def describe(self) -> tuple[int, str, str]:
        """(pid, node id, node IP) of the actor's process."""
        ray = import_ray()
        return os.getpid(), ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def start(self, config: EngineConfig, rank: int, host: str, port: int, on_gpu: bool) -> WorkerReady:
        """Joins the rank group (rank 0 at host:port) and builds the Worker. The thread count is the CPUs Ray gave
        this actor (its bundle's); on CUDA Ray shows it its one GPU, device 0."""
        import torch

        from folio.logger import init_logger

        ray = import_ray()
        init_logger()
        num_cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        torch.set_num_threads(max(1, int(num_cpus)))
        world_size = config.parallel_config.world_size
        # gloo between the actors: they may be on different machines (the shared-memory all-reduce is one machine's)
        gpu_index = 0 if on_gpu else None
        self.worker = start_worker(config, rank, world_size, host, port, gpu_index, cpu_allreduce="gloo")
        self.sends_output = is_output_rank(config, rank)
        return ready_message(config, rank, self.worker)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = self.worker.execute_model(scheduler_output)
        return output if self.sends_output else None

    def ping(self) -> None:
        """Answers once the actor is idle: a liveness probe."""


class RayExecutor(DistributedExecutor):
    def __init__(self, config: EngineConfig) -> None:
        from folio.worker.device import resolve_device

        super().__init__(config)
        parallel = config.parallel_config
        check_parallel_start(config, count_local_gpus=False)
        self._ray = ray = import_ray()
        if not ray.is_initialized():  # else: the caller's connection (it chose the cluster)
            ray.init(address=parallel.ray_address)
        on_gpu = resolve_device(config.device).type == "cuda"
        resource = "GPU" if on_gpu else "CPU"
        check_num_devices(config, resource, ray.cluster_resources().get(resource, 0.0), "the Ray cluster")
        host = ray.util.get_node_ip_address()  # the driver's node: rank 0 is placed there and listens on it
        self._placement_group = _place(ray, resource, self.world_size, host)
        self._actors = _start_actors(ray, RayWorker, self._placement_group, self.world_size, on_gpu)
        # shutdown(): kills the actors, frees the placement group
        self._stop = weakref.finalize(self, _stop_actors, ray, self._actors, self._placement_group)
        self._rank_of: dict[Any, int] = {}  # the outstanding tasks (every rank's) -> their rank
        self.worker_pids: list[int | None] = [None] * self.world_size  # the actors' processes (on their nodes)
        self.node_ids: list[str] = ["?"] * self.world_size  # Ray's node id of each rank's actor
        described = self._wait_all([actor.describe.remote() for actor in self._actors], _READY_TIMEOUT_S)
        self.worker_pids = [pid for pid, _, _ in described]
        self.node_ids = [node_id for _, node_id, _ in described]
        from folio.parallel.group import rendezvous_store

        self._rendezvous = rendezvous_store(host)  # the ranks meet at the driver; it lives as long as this executor
        port = self._rendezvous.port
        starts = [actor.start.remote(config, r, host, port, on_gpu) for r, actor in enumerate(self._actors)]
        ready: list[WorkerReady] = self._wait_all(starts, _READY_TIMEOUT_S)
        apply_ready(config, ready[0])
        self._model_spec = ready[0].model_spec
        self._outputs: collections.deque[Any] = collections.deque()  # the output rank's tasks, oldest first
        nodes = sorted({(ip, node_id[:8]) for _, node_id, ip in described})
        logger.info(
            "Ray: %d ranks on %d node(s) %s, rendezvous at %s:%d", self.world_size, len(nodes), nodes, host, port
        )

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """The step to every actor (a task each, run in submission order); does not wait for its output."""
        self._raise_if_failed()
        for rank, actor in enumerate(self._actors):
            ref = actor.execute_model.remote(scheduler_output)
            self._rank_of[ref] = rank
            if rank == self.output_rank:
                self._outputs.append(ref)

    def _collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's ModelRunnerOutput, watching every rank's outstanding task meanwhile."""
        self._raise_if_failed()
        target = self._outputs.popleft()
        while True:  # the other ranks' tasks (a death shows there first), then this step's output
            watch = [ref for ref, rank in self._rank_of.items() if rank != self.output_rank] + [target]
            ready, _ = self._ray.wait(watch, num_returns=1)
            for ref in ready:
                value = self._result(ref)
                if ref == target:
                    assert isinstance(value, ModelRunnerOutput)
                    return value

    def _wait_all(self, refs: list[Any], timeout_s: float) -> list[Any]:
        """Every task's value, in order; the first failure raises at once (a bad configuration as ValueError)."""
        self._rank_of.update({ref: rank for rank, ref in enumerate(refs)})
        values: dict[Any, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(values) < len(refs):
            pending = [ref for ref in refs if ref not in values]
            ready, _ = self._ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(f"the Ray actors did not start within {timeout_s:.0f} s")
            for ref in ready:
                values[ref] = self._result(ref)
        return [values[ref] for ref in refs]

    def _result(self, ref: Any) -> Any:
        """A finished task's value; a dead actor or a failed task fails the executor (RuntimeError naming the
        rank; a ValueError raised by the worker's start stays a ValueError)."""
        ray = self._ray
        rank = self._rank_of.pop(ref)
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            self._fail(self._death_message(rank, e))
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if e.cause is not None else e
            if isinstance(cause, ValueError):  # a bad configuration, as the in-process worker would raise it
                self._failure = str(cause)
                self.shutdown()
                raise ValueError(str(cause)) from None
            # a rank whose peer died fails in its next collective or stage message: the death is the cause to report
            self._fail(self._dead_peer_message(rank) or f"worker rank {rank} failed: {type(cause).__name__}: {cause}")

    def _dead_peer_message(self, rank: int) -> str | None:
        """The death of another rank than ``rank``, if a liveness probe finds one within a few seconds."""
        ray = self._ray
        probes = {actor.ping.remote(): r for r, actor in enumerate(self._actors) if r != rank}
        if not probes:
            return None
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=_PING_TIMEOUT_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return self._death_message(probes[ref], e)
        return None

    def _death_message(self, rank: int, error: Exception) -> str:
        """'worker rank 1 (pid 7159) died (Ray actor on node c1b4b29e, exit type SYSTEM_ERROR)'"""
        exit_type = re.search(r"Worker exit type: (\w+)", str(error))
        how = f"exit type {exit_type.group(1)}" if exit_type else str(error).strip().splitlines()[0]
        pid = "?" if self.worker_pids[rank] is None else self.worker_pids[rank]
        return f"worker rank {rank} (pid {pid}) died (Ray actor on node {self.node_ids[rank][:8]}, {how})"


def import_ray() -> Any:
    """Ray, or the ImportError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("distributed_executor_backend 'ray' needs Ray: pip install -e .[ray]") from e
    return ray


def _place(ray: Any, resource: str, world_size: int, driver_ip: str) -> Any:
    """A placement group of one {resource: 1} bundle per rank (PACK: as few nodes as they fit on), rank 0's on the
    driver's node (its rendezvous address); waits until placed."""
    from ray.util.placement_group import placement_group

    bundles = [{resource: 1.0} for _ in range(world_size)]
    bundles[0][f"node:{driver_ip}"] = 0.001  # Ray's per-node resource: pins the bundle to that node
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"the Ray placement group {bundles} was not placed within {_PLACEMENT_TIMEOUT_S:.0f} s "
            f"(available in the cluster: {ray.available_resources()})"
        )
    return group


def _start_actors(ray: Any, cls: type, group: Any, world_size: int, on_gpu: bool) -> list[Any]:
    """Rank r's actor in bundle r."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote_cls = ray.remote(cls)
    return [
        remote_cls.options(
            num_cpus=0 if on_gpu else 1,
            num_gpus=1 if on_gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        ).remote()
        for rank in range(world_size)
    ]


def _stop_actors(ray: Any, actors: list[Any], group: Any) -> None:
    """Kills every actor, waits (a few seconds at most) until Ray reports them dead, frees the placement group."""
    if not ray.is_initialized():
        return  # the driver's connection is gone (interpreter exit): the cluster reaps its actors
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    with contextlib.suppress(Exception):
        probes = [actor.ping.remote() for actor in actors]
        ray.wait(probes, num_returns=len(probes), timeout=_PING_TIMEOUT_S)
    with contextlib.suppress(Exception):
        ray.util.remove_placement_group(group)

"""The ranks that share one model (a torch.distributed process group) and the few collectives the model uses.

Each worker process of the multiprocess executor (or Ray actor) joins one group at start (gloo on the CPU, NCCL on
CUDA) over TCP (127.0.0.1 on one machine); the group object is passed to the layers that need it, never looked up
from a global. On the CPU the per-step all-reduces and all-gathers go through a shared-memory segment instead of
gloo when the ranks share a machine (``cpu_allreduce="shm"``, the default: folio/parallel/shm_allreduce.py); gloo
keeps the rest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from folio.parallel.shm_allreduce import ShmCommunicator, shm_supported

# A collective that waits longer than this raises (a peer is gone or stuck): the worker then exits and the engine
# core, which watches every worker process, reports the failure. Long enough for a first CUDA step's compilation.
COLLECTIVE_TIMEOUT_S = 300.0


@dataclass
class RankGroup:
    rank: int
    world_size: int
    group: Any = None  # torch.distributed ProcessGroup; None only where world_size is 1 (no collectives)
    shm: ShmCommunicator | None = None  # CPU tensors' all-reduce / all-gather through shared memory; None: gloo
    # Wall time this rank has spent in all_reduce / all_gather since it joined, waiting for its peers included:
    # the per-step communication figure of `folio bench throughput` (on CUDA only the launches: NCCL runs async).
    collective_seconds: float = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place; returns it."""
        if self.world_size == 1:
            return x
        start = time.perf_counter()
        if self.shm is not None and x.device.type == "cpu":
            self.shm.all_reduce(x)
        else:
            dist.all_reduce(x, group=self.group)
        self.collective_seconds += time.perf_counter() - start
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[...] on every rank -> [world_size, ...]: every rank's x, in rank order (x has the same shape everywhere)."""
        if self.world_size == 1:
            return x.unsqueeze(0)
        start = time.perf_counter()
        out = self._all_gather(x)
        self.collective_seconds += time.perf_counter() - start
        return out

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.shm is not None and x.device.type == "cpu":
            return self.shm.all_gather(x)
        # gloo wants the ranks' tensors concatenated along dim 0: [world_size * x.shape[0], ...], then viewed
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, x.contiguous(), group=self.group)
        return out.view(self.world_size, *x.shape)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (the KV blocks every rank can hold)."""
        return self._reduce_int(value, dist.ReduceOp.MIN)

    def sum_int(self, value: int) -> int:
        """The sum of every rank's value (the bytes of one KV block over all ranks)."""
        return self._reduce_int(value, dist.ReduceOp.SUM)

    def _reduce_int(self, value: int, op: Any) -> int:
        if self.world_size == 1:
            return value
        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=op, group=self.group)
        return int(t.item())


def rendezvous_store(host: str = "127.0.0.1") -> Any:
    """The ranks' rendezvous (a torch.distributed TCPStore), held by the executor for the group's life: it listens
    on a port the kernel picks as it binds (``.port``). A port found free and bound later by rank 0 could be taken
    by another process in between (two engines starting at once on a busy machine)."""
    return dist.TCPStore(host, 0, None, True, timedelta(seconds=COLLECTIVE_TIMEOUT_S), wait_for_workers=False)


def init_rank_group(
    rank: int,
    world_size: int,
    port: int,
    device_type: str,
    cpu_allreduce: str | None = None,
    host: str = "127.0.0.1",
) -> RankGroup:
    """Joins the group of world_size ranks that meet at the rendezvous store on host:port (``rendezvous_store``;
    gloo on the CPU, NCCL on CUDA); the host is 127.0.0.1 for one machine's worker processes, the driver node's IP
    under Ray. ``cpu_allreduce``: "shm" or "gloo" for the model's collectives on the CPU; None: no model
    collectives on this group (the pipeline's world group: block counts and stage messages only)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        backend,
        store=dist.TCPStore(host, port, None, False, timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return with_cpu_allreduce(RankGroup(rank, world_size, dist.group.WORLD), device_type, cpu_allreduce)


def with_cpu_allreduce(group: RankGroup, device_type: str, cpu_allreduce: str | None) -> RankGroup:
    """The group with its shared-memory segment where the CPU all-reduce is "shm" (a collective: every member of
    the group calls it); unchanged on CUDA (NCCL), for "gloo", for one rank, or where shm is not supported."""
    if cpu_allreduce == "shm" and device_type == "cpu" and group.world_size > 1 and shm_supported():
        group.shm = ShmCommunicator.create(group.group, group.rank, group.world_size, timeout_s=COLLECTIVE_TIMEOUT_S)
    return group


def destroy_rank_group(group: RankGroup) -> None:
    if group.shm is not None:
        group.shm.close()
        group.shm = None
    if group.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()

"""N engine cores behind one frontend: data parallelism (``folio serve --data-parallel-size N``, vLLM's flag).

Each core is today's single core (its own process, its own scheduler and KV cache; with tensor parallelism its own
worker ranks). The frontend tokenizes and detokenizes for all of them; ``DPRouter`` picks the core of each request
(folio/engine/dp_router.py) and a request lives on that core until it ends. With N = 1 this is a thin shell over
the one ``EngineCoreClient`` (no hashing, no routing).

Placement: on the CPU the cores split the threads (each gets threads // N, at least 1); on CUDA core i gets the
GPUs [i * tp, (i + 1) * tp) of those visible, so dp * tp ranks must fit the GPUs. The default CPU KV budget is
divided among the cores, as tensor parallelism divides it among ranks.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable

from folio.config import EngineConfig
from folio.core.sched_output import EngineCoreOutput
from folio.engine.core_proc import CorePlacement, CoreReady, EngineCoreClient
from folio.engine.dp_router import DATA_PARALLEL_ROUTINGS, DPRouter
from folio.request import Request

logger = logging.getLogger("folio")

FLAG = "data_parallel_size (--data-parallel-size)"


def check_data_parallel(config: EngineConfig, data_parallel_size: int) -> None:
    """Bad data-parallel settings as a ValueError naming the flag and the limit, before any process starts."""
    if data_parallel_size < 1:
        raise ValueError(f"{FLAG} must be >= 1, got {data_parallel_size}")
    if data_parallel_size == 1:
        return
    if config.cache_config.kv_offloading_disk_path is not None:
        raise ValueError(
            f"kv_offloading_disk_path with {FLAG} > 1 is not supported yet: the engines would share one directory"
        )
    if _device_type(config) == "cuda":
        if config.device.startswith("cuda:"):
            raise ValueError(f"--device {config.device} names one GPU; {FLAG} {data_parallel_size} needs --device cuda")
        ranks = config.parallel_config.world_size
        num_gpus = len(_visible_gpus())
        if data_parallel_size * ranks > num_gpus:
            raise ValueError(
                f"{FLAG} {data_parallel_size} x {config.parallel_config.describe_ranks()} needs "
                f"{data_parallel_size * ranks} GPUs (one per rank); this machine has {num_gpus}"
            )


def plan_engines(
    config: EngineConfig, data_parallel_size: int, num_cpu_threads: int | None, gpus: list[str]
) -> list[tuple[EngineConfig, CorePlacement | None]]:
    """Each core's config and placement (None for the one core of N = 1: it runs as it always did). ``gpus``: the
    ids of the GPUs the cores may use (CUDA), in order; ``num_cpu_threads`` None: torch's thread count, read only
    where N > 1 cores divide it (one core never imports torch here: the API server process would pay about 1.5 s
    of CPU at every start).
    Example: dp 2, tp 2, gpus ["0", "1", "2", "3"] -> core 0 sees "0,1", core 1 "2,3" (rank r uses the r-th)."""
    if data_parallel_size == 1:
        return [(config, None)]
    if num_cpu_threads is None:
        import torch

        num_cpu_threads = torch.get_num_threads()
    tp = config.parallel_config.world_size
    cuda = _device_type(config) == "cuda"
    threads = max(1, num_cpu_threads // data_parallel_size)
    if not cuda and data_parallel_size * tp > num_cpu_threads:
        ranks = data_parallel_size * tp
        logger.warning("%s: %d ranks share %d CPU threads: each gets 1", FLAG, ranks, num_cpu_threads)
    # The default KV budget is read once from free RAM and divided: read per core, it drifts with other processes.
    cache = config.cache_config
    per_rank_kv_bytes = None
    if not cuda and cache.kv_cache_memory_bytes is None and cache.num_gpu_blocks_override is None:
        from folio.worker.kv_cache_shape import default_cpu_kv_bytes

        per_rank_kv_bytes = default_cpu_kv_bytes() // (data_parallel_size * tp)
    plans: list[tuple[EngineConfig, CorePlacement | None]] = []
    for index in range(data_parallel_size):
        engine_config = copy.deepcopy(config)
        if cuda:
            placement = CorePlacement(cuda_visible_devices=",".join(gpus[index * tp : (index + 1) * tp]))
        else:
            placement = CorePlacement(num_cpu_threads=threads)
            if per_rank_kv_bytes is not None:
                engine_config.cache_config.kv_cache_memory_bytes = per_rank_kv_bytes
        plans.append((engine_config, placement))
    return plans


class DPEngineCoreClient:
    """The frontend's side of N engine cores: starts them, routes requests, sends aborts to the right core.

    ``engines[i]`` is core i's ``EngineCoreClient``; the frontend reads each one's outputs and hands them to
    ``on_outputs(i, ...)`` so that finished requests stop counting as that core's load.
    """

    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int = 1,
        num_cpu_threads: int | None = None,
        routing: str = "prefix",
    ) -> None:
        check_data_parallel(config, data_parallel_size)
        if routing not in DATA_PARALLEL_ROUTINGS:
            raise ValueError(f"data_parallel_routing must be one of {DATA_PARALLEL_ROUTINGS}, got {routing!r}")
        self.routing = routing
        self.config = config
        self.engines: list[EngineCoreClient] = []
        gpus = _visible_gpus() if data_parallel_size > 1 and _device_type(config) == "cuda" else []
        plans = plan_engines(config, data_parallel_size, num_cpu_threads, gpus)
        try:
            for index, (engine_config, placement) in enumerate(plans):
                name = f"-{index}" if data_parallel_size > 1 else ""
                self.engines.append(EngineCoreClient(engine_config, placement, name))  # loads start at once
        except BaseException:
            self.shutdown()
            raise
        self.router: DPRouter | None = None

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    @property
    def pids(self) -> list[int]:
        return [engine.pid for engine in self.engines]

    def wait_ready(self) -> CoreReady:
        """Blocks until every core has loaded; raises the first failure (after stopping every core)."""
        try:
            readies = [engine.wait_ready() for engine in self.engines]
        except BaseException:
            self.shutdown()
            raise
        cache = self.config.cache_config
        num_blocks = [r.num_blocks for r in readies]
        self.router = DPRouter(num_blocks, cache.block_size, cache.enable_prefix_caching, routing=self.routing)
        if len({r.num_blocks for r in readies}) > 1:
            logger.info("KV blocks per engine: %s", [r.num_blocks for r in readies])
        return readies[0]

    def add_requests(self, requests: list[Request]) -> int:
        """Sends one prompt's requests (its n samples) to the engine the router picks; returns its index."""
        assert self.router is not None, "wait_ready() first"
        engine = self.router.route([r.request_id for r in requests], requests[0].prompt_token_ids)
        self.engines[engine].add_requests(requests)
        return engine

    def engine_of(self, request_id: str) -> int | None:
        return self.router.engine_of(request_id) if self.router is not None else None

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Aborts the requests still in flight, each on its own core; finished ones are no core's concern."""
        if self.router is None:
            return
        for engine, ids in self.router.release(request_ids).items():
            self.engines[engine].abort_requests(ids)

    def on_outputs(self, engine_index: int, outputs: list[EngineCoreOutput]) -> None:
        """A core's step outputs: the requests it finished leave its load."""
        if self.router is not None:
            self.router.release(out.request_id for out in outputs if out.finished)

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.send_shutdown()  # all stop at once; then each is waited for
        for engine in self.engines:
            engine.shutdown()


def _device_type(config: EngineConfig) -> str:
    from folio.worker.device import resolve_device

    return resolve_device(config.device).type


def _visible_gpus() -> list[str]:
    """The GPU ids the cores may use: CUDA_VISIBLE_DEVICES' list where it is set (the user's choice), else all."""
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(count)]
    return [gpu.strip() for gpu in visible.split(",") if gpu.strip()][:count]

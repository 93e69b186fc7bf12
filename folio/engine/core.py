"""EngineCore: one step = schedule -> execute -> update_from_output. No tokenizer here."""

from __future__ import annotations

import logging
import time

from folio.config import EngineConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.sched_output import EngineCoreOutput, SchedulerOutput
from folio.core.scheduler import Scheduler
from folio.executor.uniproc import UniProcExecutor
from folio.request import Request
from folio.step_timer import SCHEDULE, UPDATE_FROM_OUTPUT, StepTimer

logger = logging.getLogger("folio")


class EngineCore:
    def __init__(self, config: EngineConfig, executor: UniProcExecutor) -> None:
        self.config = config
        self.executor = executor
        cache = config.cache_config
        if cache.num_blocks * cache.block_size < config.scheduler_config.max_model_len:
            raise ValueError(
                f"the KV cache holds {cache.num_blocks * cache.block_size} tokens, fewer than max_model_len "
                f"{config.scheduler_config.max_model_len}: raise kv_cache_memory_bytes or lower max_model_len"
            )
        self.kv_cache_manager = KVCacheManager(
            cache.num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            num_host_blocks=cache.num_host_blocks,
            num_disk_blocks=cache.num_disk_blocks,
            disk_block_hashes=cache.disk_block_hashes,
        )
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)
        self.step_timer: StepTimer | None = None  # set only by profiling benchmarks (folio.step_timer)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        timer = self.step_timer
        scheduler_output = self.scheduler.schedule()
        if timer is not None:
            timer.lap(SCHEDULE)
            timer.set_batch(len(scheduler_output.num_scheduled_tokens), scheduler_output.total_num_scheduled_tokens)
        runner_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if timer is not None:
            timer.lap(UPDATE_FROM_OUTPUT)
        return outputs

    def shutdown(self) -> None:
        """With a disk tier: write every cached block of the device and host tiers there, so that a restarted engine
        finds the whole prefix cache warm (between steps only; a running request's cached blocks count too)."""
        manager = self.kv_cache_manager
        if manager.disk_tier is None:
            return
        start = time.perf_counter()
        manager.plan_disk_flush()
        output = SchedulerOutput.make_empty()
        output.kv_disk = manager.take_disk_plans()
        if output.kv_disk:
            self.executor.execute_model(output)
        logger.info(
            "KV disk tier: %d blocks written at shutdown in %.2f s; %d blocks on disk",
            len(output.kv_disk.stores),
            time.perf_counter() - start,
            len(manager.disk_tier),
        )

"""EngineCore: one step = schedule -> execute -> update_from_output. No tokenizer here."""

from __future__ import annotations

from folio.config import EngineConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.sched_output import EngineCoreOutput
from folio.core.scheduler import Scheduler
from folio.executor.uniproc import UniProcExecutor
from folio.request import Request
from folio.step_timer import SCHEDULE, UPDATE_FROM_OUTPUT, StepTimer


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
            cache.num_blocks, cache.block_size, cache.enable_prefix_caching, num_host_blocks=cache.num_host_blocks
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

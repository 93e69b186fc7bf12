"""EngineCore: one step = schedule -> execute -> update_from_output. No tokenizer here, except the one the
structured-output manager loads (on its own thread) at the first constrained request, for the grammar library."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from folio.config import EngineConfig
from folio.core.kv_cache_manager import KVCacheManager
from folio.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from folio.core.scheduler import Scheduler, SchedulerStats
from folio.core.spec_decode import Lookahead
from folio.engine.batch_queue import BatchQueue, attach_scheduled_token_ids
from folio.executor import Executor
from folio.kv_transfer.connector import CoreKVConnector
from folio.request import FinishReason, Request
from folio.step_timer import SCHEDULE, UPDATE_FROM_OUTPUT, StepTimer
from folio.structured.manager import StructuredOutputManager

logger = logging.getLogger("folio")


class EngineCore:
    def __init__(
        self, config: EngineConfig, executor: Executor, load_tokenizer: Callable[[], Any] | None = None
    ) -> None:
        """``load_tokenizer``: for the grammar library (default: load the model's tokenizer when first needed)."""
        self.config = config
        self.executor = executor
        cache = config.cache_config
        if cache.num_blocks * cache.block_size < config.scheduler_config.max_model_len:
            raise ValueError(
                f"the KV cache holds {cache.num_blocks * cache.block_size} tokens, fewer than max_model_len "
                f"{config.scheduler_config.max_model_len}: raise kv_cache_memory_bytes or lower max_model_len"
            )
        # disaggregated prefill: a consumer's receiver and store, a producer's send plans (folio/kv_transfer/)
        kv_transfer = config.kv_transfer_config
        self.kv_connector = CoreKVConnector(kv_transfer, cache.block_size) if kv_transfer is not None else None
        self.kv_cache_manager = KVCacheManager(
            cache.num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            num_host_blocks=cache.num_host_blocks,
            num_disk_blocks=cache.num_disk_blocks,
            disk_block_hashes=cache.disk_block_hashes,
            lookahead=Lookahead.for_config(config.speculative_config, config.scheduler_config.max_model_len),
            remote_kv_store=self.kv_connector.store if self.kv_connector is not None else None,
        )
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)
        # pipeline parallelism: the stages that do not sample get the sampled tokens with the next step
        self.pipeline = config.parallel_config.pipeline_parallel_size > 1
        # up to pp batches in flight so that the stages overlap (folio/engine/batch_queue.py); None: one at a time
        max_batches = executor.max_concurrent_batches
        self.batch_queue = BatchQueue(max_batches) if max_batches > 1 else None
        self.step_timer: StepTimer | None = None  # set only by profiling benchmarks (folio.step_timer)
        self.structured_output_manager = StructuredOutputManager(
            config.structured_outputs_config.backend,
            executor.model_spec.vocab_size,
            list(executor.model_spec.eos_token_ids),
            load_tokenizer or _tokenizer_loader(config),
        )

    def add_request(self, request: Request) -> None:
        """A constrained request waits in the structured-output manager until its grammar is compiled."""
        if StructuredOutputManager.is_constrained(request):
            self.scheduler.check_new_request(request)
            self.structured_output_manager.submit(request)
        else:
            self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.structured_output_manager.remove(request_ids)
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Batches still in flight count too (their outputs are read before the engine goes idle)."""
        in_flight = self.batch_queue is not None and len(self.batch_queue) > 0
        return self.scheduler.has_unfinished_requests() or self.structured_output_manager.num_waiting > 0 or in_flight

    def get_stats(self) -> SchedulerStats:
        """The scheduler's snapshot; requests waiting for their grammar count as waiting."""
        stats = self.scheduler.get_stats()
        stats.num_waiting += self.structured_output_manager.num_waiting
        if self.kv_connector is not None:
            stats.kv_transfer = self.kv_connector.stats(self.kv_cache_manager.remote_tier)
        return stats

    def step(self) -> list[EngineCoreOutput]:
        structured = self.structured_output_manager
        failed = self._admit_compiled_requests() if structured.num_waiting else []
        if self.batch_queue is not None:
            return failed + self.batch_queue.step(self)
        if not self.scheduler.has_unfinished_requests():
            return failed
        timer = self.step_timer
        scheduler_output = self.scheduler.schedule()
        structured.fill_bitmask(self.scheduler.requests, scheduler_output)
        if self.pipeline:
            attach_scheduled_token_ids(scheduler_output, self.scheduler.requests)
        if timer is not None:
            timer.lap(SCHEDULE)
            timer.set_batch(len(scheduler_output.num_scheduled_tokens), scheduler_output.total_num_scheduled_tokens)
        if self.kv_connector is not None:
            self.kv_connector.plan_sends(scheduler_output, self.scheduler.requests, self.kv_cache_manager.get_block_ids)
        runner_output = self.executor.execute_model(scheduler_output)
        if self.kv_connector is not None:
            self.kv_connector.record(runner_output.kv_transfer)
        return failed + self.finish_step(scheduler_output, runner_output)

    def finish_step(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """The scheduler takes a step's output; the grammars advance by the accepted tokens."""
        structured, timer = self.structured_output_manager, self.step_timer
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if structured.matchers:
            self._abort_grammar_violations(outputs, structured.accept(outputs))
            structured.validate_drafts(self.scheduler.requests)  # only drafts the grammar accepts are scheduled
        if timer is not None:
            timer.lap(UPDATE_FROM_OUTPUT)
        return outputs

    def _admit_compiled_requests(self) -> list[EngineCoreOutput]:
        """Requests whose grammar is ready go to the scheduler; those whose grammar failed to compile finish
        (aborted, with the compiler's message in the log). Waits briefly when nothing else could run."""
        ready, failed = self.structured_output_manager.take_ready(wait=not self.scheduler.has_unfinished_requests())
        for request in ready:
            self.scheduler.add_request(request)
        outputs = []
        for request, error in failed:
            logger.error("request %s: its grammar did not compile: %s", request.request_id, error)
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT))
        return outputs

    def shutdown(self) -> None:
        """With a disk tier: write every cached block of the device and host tiers there, so that a restarted engine
        finds the whole prefix cache warm (between steps only; a running request's cached blocks count too). Then
        stops the executor's worker processes, if it has any."""
        try:
            self._flush_to_disk()
        finally:
            if self.kv_connector is not None:
                self.kv_connector.shutdown()
            self.executor.shutdown()

    def _flush_to_disk(self) -> None:
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

    def _abort_grammar_violations(self, outputs: list[EngineCoreOutput], rejected: list[str]) -> None:
        """End requests that sampled a token their grammar forbids: other constraints banned every token it allows
        (min_tokens while only EOS may follow, an allowed_token_ids list outside the grammar). finish_reason abort."""
        if not rejected:
            return
        logger.error("requests %s sampled a token their grammar forbids (conflicting constraints): aborted", rejected)
        self.abort_requests(rejected)
        for output in outputs:
            if output.request_id in rejected:  # the forbidden token is not handed out
                output.new_token_ids, output.new_logprobs = [], None
                output.finish_reason = FinishReason.ABORT
                output.stop_reason = None


def _tokenizer_loader(config: EngineConfig) -> Callable[[], Any]:
    def load() -> Any:
        from folio.model.loader import load_tokenizer

        return load_tokenizer(config.model_config.tokenizer or config.model_config.model)

    return load

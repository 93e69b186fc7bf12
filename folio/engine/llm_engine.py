"""LLMEngine: add_request / abort_request / step() for offline use, on an in-process EngineCore."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

from folio.config import EngineArgs, EngineConfig
from folio.core.scheduler import SchedulerStats
from folio.engine.core import EngineCore
from folio.engine.input_processor import InputProcessor, PromptType
from folio.engine.output_processor import OutputProcessor, RequestOutputKind
from folio.executor import make_executor
from folio.model.loader import default_model_path, load_tokenizer, read_model_spec
from folio.outputs import RequestOutput
from folio.sampling_params import SamplingParams
from folio.step_timer import OUTPUT_PROCESSING, StepTimer

logger = logging.getLogger("folio")


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.executor = make_executor(config)
        self.model_spec = self.executor.model_spec
        self.engine_core = EngineCore(config, self.executor, load_tokenizer=lambda: tokenizer)
        self.input_processor = InputProcessor(
            tokenizer,
            vocab_size=self.model_spec.vocab_size,
            max_model_len=config.scheduler_config.max_model_len,
            eos_token_ids=self.model_spec.eos_token_ids,
            structured_outputs_backend=config.structured_outputs_config.backend,
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._request_counter = itertools.count()
        self.step_timer: StepTimer | None = None
        # Called with the scheduler's snapshot after every step when set (benchmarks: KV occupancy over a run).
        self.stats_observer: Callable[[SchedulerStats], None] | None = None

    def set_step_timer(self, timer: StepTimer | None) -> None:
        """Attach (or with None detach) per-phase step timings at every call site of an in-process step."""
        self.step_timer = timer
        self.engine_core.step_timer = timer
        self.executor.set_step_timer(timer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        model_path = args.model or default_model_path()
        spec = read_model_spec(model_path)
        config = args.create_engine_config(model_path, spec.max_position_embeddings)
        tokenizer = load_tokenizer(args.tokenizer or model_path)
        return cls(config, tokenizer)

    @property
    def scheduler(self) -> Any:
        return self.engine_core.scheduler

    @property
    def kv_cache_manager(self) -> Any:
        return self.engine_core.kv_cache_manager

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix in every KV tier (vLLM's name); False, changing nothing, while a request
        holds blocks."""
        return bool(self.engine_core.kv_cache_manager.reset_prefix_cache())

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        """Validates and queues a request; raises ValueError (naming the field and limit) and queues nothing."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        processed = self.input_processor.tokenize_prompt(prompt)
        requests = self.input_processor.make_requests(request_id, processed, params, priority=priority)
        self.output_processor.add_request(request_id, processed, params, output_kind)
        for request in requests:
            self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        child_ids = [c for r in request_ids for c in self.output_processor.child_ids(r)]
        self.engine_core.abort_requests(child_ids)
        self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        timer = self.step_timer
        if timer is not None:
            timer.begin()
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.child_ids_to_abort:
            self.engine_core.abort_requests(processed.child_ids_to_abort)
        if timer is not None:
            timer.lap(OUTPUT_PROCESSING)
            timer.end()
        if self.stats_observer is not None:
            self.stats_observer(self.engine_core.get_stats())
        return processed.request_outputs

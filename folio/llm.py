"""LLM: offline generate() / chat() over many prompts with a progress bar; a thin shell over LLMEngine."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm.auto import tqdm

from folio.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    check_fits,
    check_prefix_caching,
    first_row,
    run_beam_search,
)
from folio.config import EngineArgs
from folio.engine.input_processor import PromptType
from folio.engine.llm_engine import LLMEngine
from folio.engine.output_processor import RequestOutputKind
from folio.logger import init_logger
from folio.outputs import RequestOutput
from folio.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """``LLM()`` serves the default SmolLM2-135M-Instruct; keyword arguments are EngineArgs (vLLM names)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments {unknown}; known: {sorted(known)}")
        init_logger()
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's name): benchmarks that repeat a request set start each round cold."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in the order of the prompts.

        A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]}. All prompts are validated before
        any is queued, so one bad prompt raises and leaves nothing running.
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast(sampling_params or SamplingParams(), len(prompt_list), "sampling_params")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompt_list)} prompts")
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt, params, prio in zip(prompt_list, params_list, priorities, strict=True):
                request_id = engine.next_request_id()
                engine.add_request(request_id, prompt, params, prio, RequestOutputKind.FINAL_ONLY)
                request_ids.append(request_id)
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            engine.abort_request(request_ids)
            raise

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Applies the tokenizer's chat template to each conversation, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            token_ids = self.get_tokenizer().apply_chat_template(
                conversation, tokenize=True, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
            )
            if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):
                token_ids = token_ids["input_ids"]
            prompts.append({"prompt_token_ids": list(token_ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (folio/beam_search.py): per prompt, the best ``params.beam_width`` sequences, best
        first. Each step runs every live beam as a one-token request; prefix caching shares their prefix."""
        engine = self.llm_engine
        check_prefix_caching(engine.config.cache_config.enable_prefix_caching)
        token_ids = [engine.input_processor.tokenize_prompt(p).prompt_token_ids for p in _as_prompt_list(prompts)]
        for ids in token_ids:
            check_fits(len(ids), params.max_tokens, engine.input_processor.max_model_len)

        def run_step(beams: list[list[int]], step_params: SamplingParams) -> list[Any]:
            outputs = self.generate([{"prompt_token_ids": b} for b in beams], step_params, use_tqdm=False)
            return [first_row(out) for out in outputs]

        eos_ids = set(engine.input_processor.eos_token_ids)
        return run_beam_search(token_ids, params, eos_ids, run_step, self.get_tokenizer().decode)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True
        )
        start = time.perf_counter()
        num_prompt_tokens = num_output_tokens = 0
        with bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    finished[output.request_id] = output
                    num_prompt_tokens += len(output.prompt_token_ids)
                    num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = time.perf_counter() - start
                    speed_in, speed_out = num_prompt_tokens / elapsed, num_output_tokens / elapsed
                    bar.set_postfix_str(f"input: {speed_in:.1f} tok/s, output: {speed_out:.1f} tok/s")
                    bar.update(1)
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompt_list: list[Any] = list(prompts)
    if prompt_list and all(isinstance(p, int) for p in prompt_list):
        return [prompt_list]  # one prompt given as token ids
    if not prompt_list:
        raise ValueError("prompts must not be empty")
    return prompt_list


def _broadcast(value: SamplingParams | Sequence[SamplingParams], count: int, name: str) -> list[SamplingParams]:
    if isinstance(value, SamplingParams):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} entries for {count} prompts")
    return values

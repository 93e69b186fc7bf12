"""InputProcessor: text / chat messages / token ids -> engine Requests, validated against the model's limits.

Everything that needs the tokenizer or the model's shape is checked here, so that a bad request fails at
``add_request`` with a ValueError naming the field and the limit, before any KV block is touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from folio.request import Request
from folio.sampling_params import SamplingParams
from folio.structured.backend import validate_grammar_spec

PromptType = str | list[int] | dict[str, Any]


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: list[int],
        structured_outputs_backend: str = "auto",
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.structured_outputs_backend = structured_outputs_backend

    def tokenize_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Accepts a string, a list of token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self._from_token_ids(list(prompt["prompt_token_ids"]), prompt.get("prompt"))
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("prompt dict must have a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return ProcessedPrompt(prompt, self._encode(prompt, "prompt"))
        if isinstance(prompt, list | tuple):
            return self._from_token_ids(list(prompt), None)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _from_token_ids(self, token_ids: list[int], text: str | None) -> ProcessedPrompt:
        if not token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        for t in token_ids:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids contains {t!r}, outside the vocabulary [0, {self.vocab_size})")
        return ProcessedPrompt(text, token_ids)

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> list[Request]:
        """One Request per sample (n > 1 fans out); siblings fork from the first one's prompt blocks."""
        params = self._resolve_params(params)
        num_prompt = len(prompt.prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt is {num_prompt} tokens, which leaves no room for output under max_model_len "
                f"{self.max_model_len}"
            )
        room = self.max_model_len - num_prompt
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(
                f"max_tokens {params.max_tokens} plus the prompt's {num_prompt} tokens exceeds max_model_len "
                f"{self.max_model_len} (at most {room} new tokens fit)"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        requests = []
        for index in range(params.n):
            child_params = params if params.n == 1 else _child_params(params, index)
            requests.append(
                Request(
                    request_id=child_request_id(request_id, index, params.n),
                    prompt_token_ids=prompt.prompt_token_ids,
                    sampling_params=child_params,
                    max_tokens=max_tokens,
                    arrival_time=arrival,
                    priority=priority,
                    fork_of=None if index == 0 else child_request_id(request_id, 0, params.n),
                )
            )
        return requests

    def _resolve_params(self, params: SamplingParams) -> SamplingParams:
        params = params.clone()
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or []),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            for t in ids:
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"{name} contains {t}, outside the vocabulary [0, {self.vocab_size})")
        for t in params.logit_bias or {}:
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"logit_bias has token id {t}, outside the vocabulary [0, {self.vocab_size})")
        params.all_stop_token_ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            params.all_stop_token_ids |= set(self.eos_token_ids)
        params.bad_words_token_ids = self._bad_words_to_ids(params.bad_words or [])
        if params.structured_outputs is not None:  # compiles here (cached), so a bad grammar queues nothing
            validate_grammar_spec(self.structured_outputs_backend, params.structured_outputs.grammar_spec())
        return params

    def _bad_words_to_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word is banned both as written and with a leading space, as vLLM does."""
        sequences: list[list[int]] = []
        for i, word in enumerate(bad_words):
            for variant in {word, " " + word.lstrip()}:
                ids = self._encode(variant, f"bad_words[{i}]")
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _encode(self, text: str, field: str) -> list[int]:
        """The tokenizer's ids; its failure on the text (e.g. a lone surrogate) is the caller's, a ValueError."""
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        except Exception as e:
            raise ValueError(f"{field} could not be tokenized: {type(e).__name__}: {e}") from e


def child_request_id(request_id: str, index: int, n: int) -> str:
    """n == 1 keeps the user's id; siblings of n > 1 are '{index}_{id}' as in vLLM."""
    return request_id if n == 1 else f"{index}_{request_id}"


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each sibling samples one sequence; a seeded parent gives sibling i the seed + i (vLLM's rule)."""
    child = params.clone()
    child.n = 1
    if child.seed is not None:
        child.seed = params.seed + index if params.seed is not None else None
    return child

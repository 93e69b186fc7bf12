"""What both OpenAI endpoints share: the served model's identity, prompt tokenization, the context-length rule,
and turning engine failures into enveloped errors.

The server tokenizes prompts itself (as vLLM's frontend does) so that it knows the prompt length before the
engine sees the request: that is what fills ``max_tokens`` when it is null and what the 400 for an oversized
request states. Tokenizing and chat templating run off the event loop (folio/server/async_tokenizer.py).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from folio.outputs import CompletionOutput, Logprob, RequestOutput
from folio.sampling_params import SamplingParams
from folio.server.admission import Admission
from folio.server.async_tokenizer import AsyncTokenizer, TokenizerInputError
from folio.server.errors import APIError, bad_request, from_value_error
from folio.server.input_hygiene import quote_text
from folio.server.limits import DEFAULT_MAX_N_SEQUENCES
from folio.server.protocol import UsageInfo

if TYPE_CHECKING:
    from folio.engine.async_llm import AsyncLLM

logger = logging.getLogger("folio")

# Fields a SamplingParams / InputProcessor ValueError may name first; that name becomes the error's ``param``.
SAMPLING_FIELDS = frozenset(
    {
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "max_tokens", "stop",
        "stop_token_ids", "logprobs", "prompt", "top_logprobs",
    }
)  # fmt: skip


@dataclass
class ChoiceState:
    """One choice of a response, accumulated from the engine's DELTA outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # streaming completions: where the next token's text starts
    finish_sent: bool = False  # streaming: the chunk with the finish reason went out

    def add(self, delta: CompletionOutput) -> None:
        """Non-streaming: append a delta."""
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def make_usage(num_prompt_tokens: int, choices: list[ChoiceState]) -> UsageInfo:
    """Usage as OpenAI counts it: completion tokens over every choice."""
    num_completion_tokens = sum(len(choice.token_ids) for choice in choices)
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ServingContext:
    """The engine plus the facts about the served model that request handling needs."""

    engine: AsyncLLM
    model_name: str
    max_model_len: int
    admission: Admission = field(default_factory=Admission)  # the server's own count of requests in flight
    max_n_sequences: int = DEFAULT_MAX_N_SEQUENCES
    async_tokenizer: AsyncTokenizer = field(init=False)

    def __post_init__(self) -> None:
        self.async_tokenizer = AsyncTokenizer(self.engine.tokenizer)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def check_model(self, requested: str | None) -> None:
        """404 for a model name this server does not serve (None means the served model)."""
        if requested is not None and requested != self.model_name:
            raise APIError(
                404,
                f"The model {quote_text(requested)} does not exist; this server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        """A prompt's token ids exactly as the engine's InputProcessor makes them (no special tokens added)."""
        if not text:
            raise bad_request(f"{param} must not be empty", param=param)
        return await self.tokenize(text, param=param)

    async def tokenize(self, text: str, param: str = "prompt", add_special_tokens: bool = False) -> list[int]:
        """Token ids made on the tokenizer thread; a tokenizer error on the text is the client's (400)."""
        try:
            return await self.async_tokenizer.encode(text, param, add_special_tokens)
        except TokenizerInputError as e:
            raise bad_request(str(e), param=e.param) from e

    async def detokenize(self, token_ids: list[int]) -> str:
        try:
            return await self.async_tokenizer.decode(token_ids)
        except TokenizerInputError as e:
            raise bad_request(str(e), param=e.param) from e

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        """The tokenizer's chat template, as ``LLM.chat`` applies it; template errors are the client's (400)."""
        try:
            return await self.async_tokenizer.apply_chat_template(messages, add_generation_prompt)
        except TokenizerInputError as e:
            raise bad_request(str(e), param=e.param) from e

    def check_n(self, n: int) -> None:
        """400 for more sequences than --max-n-sequences allows in one request."""
        if n > self.max_n_sequences:
            raise bad_request(
                f"n must be at most {self.max_n_sequences} (this server's --max-n-sequences), got {n}", param="n"
            )

    def resolve_max_tokens(
        self, requested: int | None, num_prompt_tokens: int, field: str = "max_tokens", prompt_field: str = "prompt"
    ) -> int:
        """The number of tokens to generate: ``requested``, or all the room left in the context when None.

        Raises a 400 stating both numbers when the prompt plus ``requested`` exceeds max_model_len.
        """
        room = self.max_model_len - num_prompt_tokens
        if room <= 0:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt is "
                f"{num_prompt_tokens} tokens, which leaves no room for the completion. Please shorten the prompt.",
                param=prompt_field,
                code="context_length_exceeded",
            )
        if requested is None:
            return room
        if isinstance(requested, int) and requested > room:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for the "
                f"completion). Please reduce the prompt or {field}.",
                param=field,
                code="context_length_exceeded",
            )
        return requested

    def make_sampling_params(self, build: Any, field_renames: dict[str, str] | None = None) -> SamplingParams:
        """Calls ``build()`` (which constructs SamplingParams) and turns its ValueError into a 400 naming the field."""
        try:
            params: SamplingParams = build()
        except ValueError as e:
            error = from_value_error(e, SAMPLING_FIELDS)
            if error.param and field_renames:
                error.param = field_renames.get(error.param, error.param)
            raise error from e
        self.check_n(params.n)
        return params

    def generate(
        self, prompt: dict[str, Any], params: SamplingParams, request_id: str, priority: int
    ) -> AsyncGenerator[RequestOutput, None]:
        return self.engine.generate(prompt, params, request_id, priority=priority)


def engine_error(error: BaseException) -> APIError:
    """What a client sees when the engine, not its request, failed (500); ValueErrors are the request's (400)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return from_value_error(error, SAMPLING_FIELDS)
    name = type(error).__name__
    if name == "EngineDeadError":
        return APIError(500, f"The engine core died; this server is shutting down ({error})", code="engine_dead")
    logger.error("request failed in the engine: %s: %s", name, error)
    return APIError(500, f"The engine failed while serving the request: {name}: {error}", code="engine_error")

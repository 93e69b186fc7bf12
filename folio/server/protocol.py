"""OpenAI request and response shapes (pydantic) for /v1/completions and /v1/chat/completions.

Request models forbid unknown fields: a misspelt parameter is a 400 that names it, not a silent default (a known
pain of vLLM users). vLLM's extra sampling fields (top_k, min_p, ...) are accepted as vLLM accepts them. Range
checks live in ``SamplingParams`` (one place); these models check only types and the OpenAI-only rules, plus two
that hold for every request: each integer is a signed 64-bit one (``Int64``, as vLLM bounds ``seed``), and all
text is valid Unicode (``RequestBody``, through folio/server/input_hygiene.py).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from folio.sampling_params import SamplingParams
from folio.server.input_hygiene import check_text
from folio.server.kv_transfer_params import KVTransferParams
from folio.server.limits import MAX_TEMPERATURE
from folio.server.structured_outputs import ResponseFormat, StructuredOutputsField

# A signed 64-bit integer: what the engine, torch and every client language can hold. Both bounds are powers of two
# so that the OpenAPI document, whose numbers are floats, states them exactly (2**63 - 1 would round up to 2**63).
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class StrictModel(BaseModel):
    """Unknown fields are errors: pydantic reports them as ``extra_forbidden``, which becomes a 400."""

    model_config = ConfigDict(extra="forbid")


class RequestBody(StrictModel):
    """A whole request body: all its text, keys included, is checked to be valid Unicode before any field is
    validated, so that no lone surrogate reaches the tokenizer or an error message (400 naming the field)."""

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data: Any) -> Any:
        check_text(data)
        return data


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(RequestBody):
    """The fields both endpoints share: OpenAI's plus vLLM's extras."""

    model: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    n: Int64 = 1
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    user: str | None = None  # accepted and ignored, as vLLM does
    # vLLM's extra sampling parameters
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int64 = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: Int64 = 0
    use_beam_search: bool = False  # vLLM's: n is the beam width (folio/server/beam_search.py)
    length_penalty: float = 1.0
    # structured outputs (folio/server/structured_outputs.py): OpenAI's field, or vLLM's extra one
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    kv_transfer_params: KVTransferParams | None = None  # vLLM's: disaggregated prefill (folio/kv_transfer/)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range (SamplingParams validates, plus OpenAI's
        temperature bound)."""
        if self.temperature is not None and not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            min_tokens=self.min_tokens,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logprobs=logprobs,
        )

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# ---------------------------------------------------------------------------------------------- completions

CompletionPrompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: CompletionPrompt
    max_tokens: Int64 | None = 16  # OpenAI's and vLLM's default; null fills the context
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: where a prefill's blocks went


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------- chat


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required for every role: OpenAI lets only an assistant message with tool_calls (or a function_call) go
    # without content, and this server accepts neither.
    content: str | list[TextContentPart]
    name: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """Text parts are joined: the chat template takes plain strings."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both accepted
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True  # vLLM's extra

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: where a prefill's blocks went


class DeltaMessage(BaseModel):
    """Unset parts of a delta are left out, as OpenAI sends them (``{"content": "x"}``, not a null role)."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------- utility endpoints


class TokenizeRequest(RequestBody):
    """Either ``prompt`` (tokenized as /v1/completions does) or ``messages`` (through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # False: the same ids /v1/completions feeds the engine


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "folio"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

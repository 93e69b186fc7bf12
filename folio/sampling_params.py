"""SamplingParams: what a user asks of one request's decoding, with vLLM's field names.

Validated on construction so that a bad value fails at the call site with the field named, never deep in the
engine. Limits that need the model (vocabulary size, max_model_len) are checked by the InputProcessor.
Pure Python: the scheduler reads these fields and must not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from folio.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _check(cond: bool, name: str, limit: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"{name} must be {limit}, got {value!r}")


@dataclass
class SamplingParams:
    """Per-request decoding parameters (vLLM names and ranges).

    temperature 0 means greedy. top_k 0 or -1 means no top-k. logprobs / prompt_logprobs are the number of top
    alternatives returned besides the chosen token.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = 0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    # A grammar the output must follow (JSON schema, regex, choice, EBNF grammar, any JSON object); a dict of
    # StructuredOutputsParams' fields is accepted too.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's catch-all for extensions; Folio reads "kv_transfer_params" (disaggregated prefill, folio/kv_transfer/).
    extra_args: dict[str, Any] | None = None
    # Filled by the InputProcessor (needs the tokenizer): bad_words as token-id sequences, and the model's EOS ids.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    all_stop_token_ids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()
        self.all_stop_token_ids = set(self.stop_token_ids) | set(self.all_stop_token_ids)

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        # finite: every float field has a closed range, so inf and NaN fail (the OpenAI server bounds it at 2)
        _check(0.0 <= self.temperature < math.inf, "temperature", "a finite number >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "0 or -1 (disabled) or >= 1", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "in (0, 2]", self.repetition_penalty)
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens={self.max_tokens}", self.min_tokens
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= 20), name, "in [0, 20]", value)
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                _check(-100.0 <= bias <= 100.0, f"logit_bias[{token_id}]", "in [-100, 100]", bias)
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids",
            "a non-empty list",
            self.allowed_token_ids,
        )
        assert isinstance(self.stop, list)
        for s in self.stop:
            _check(isinstance(s, str) and len(s) > 0, "stop", "a list of non-empty strings", self.stop)
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "a StructuredOutputsParams",
            self.structured_outputs,
        )
        if self.seed is not None:
            _check(
                isinstance(self.seed, int) and _INT64_MIN <= self.seed <= _INT64_MAX,
                "seed",
                "a signed 64-bit integer",
                self.seed,
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalty(self) -> bool:
        """Presence, frequency or repetition penalty: the sampler reads the token history."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def reads_output_history(self) -> bool:
        """Whether sampling depends on the output so far: penalties, bad words, min_tokens."""
        return self.has_penalty or bool(self.bad_words_token_ids) or self.min_tokens > 0

    @property
    def changes_logits(self) -> bool:
        """Whether the sampler changes the raw logits before picking (the one list of such settings: the sampler's
        batched check and speculative verification both follow it)."""
        return self.reads_output_history or bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def stop_strings(self) -> list[str]:
        assert isinstance(self.stop, list)
        return self.stop

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)

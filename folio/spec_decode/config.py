"""SpeculativeConfig: vLLM's ``speculative_config`` fields, validated, with vLLM's n-gram defaults.

Pure Python (the engine core and the CLI read it). Every error is a ValueError that names the field, as
``speculative_config.<field>``, so the CLI and the server can say which part of the JSON is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from folio.config_dict import config_kwargs

SPECULATIVE_METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram default for both bounds when neither is given


@dataclass
class SpeculativeConfig:
    """How drafts are proposed (docs/speculative_decoding.md).

    method "ngram": prompt lookup; ``prompt_lookup_min`` .. ``prompt_lookup_max`` are the n-gram lengths tried
    (neither given: both 5; one given: the other equals it). method "draft_model": a second model at ``model``.
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None  # k: drafts per request per step (required)
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # the draft model's path (method "draft_model")

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config.num_speculative_tokens is required (drafts per step, >= 1)")
        _check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.method == "ngram":
            self._resolve_prompt_lookup()
            if self.model is not None:
                raise ValueError("speculative_config.model is for method 'draft_model'; method 'ngram' takes none")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model (the draft model's path) is required for 'draft_model'")
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method 'ngram', not 'draft_model'")

    def _resolve_prompt_lookup(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):  # the given ones first: the error names them
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = DEFAULT_PROMPT_LOOKUP
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )

    @staticmethod
    def from_value(value: SpeculativeConfig | dict[str, object] | None) -> SpeculativeConfig | None:
        """From EngineArgs' field: a config, a dict of its fields (as the CLI's JSON gives), or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        kwargs = config_kwargs("speculative_config", value, SpeculativeConfig)
        if "method" in kwargs and not isinstance(kwargs["method"], str):
            raise ValueError(f"speculative_config.method must be a string, got {kwargs['method']!r}")
        return SpeculativeConfig(**kwargs)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{name} must be an integer >= 1, got {value!r}")

"""StructuredOutputsParams (vLLM's name and fields) and GrammarSpec, the hashable form a backend compiles.

Pure Python: SamplingParams carries these into the scheduler, which must not import torch or a grammar library.
The checks here are the shape of the request (exactly one kind, the right types); whether the schema, regex or
grammar compiles is the backend's answer (``folio.structured.backend.validate_grammar_spec``).
"""

from __future__ import annotations

import json as json_module
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: ``kind`` is one of KINDS; ``text`` the canonical text (a JSON schema dumped compactly, its
    key order kept; a JSON list for choice; "" for json_object). Equal specs share one compiled grammar (the cache
    key)."""

    kind: str
    text: str


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields is set: ``json`` (a JSON schema, dict or string), ``regex``, ``choice`` (a list of
    strings), ``grammar`` (EBNF / GBNF; Lark too with the guidance backend) or ``json_object=True`` (any JSON
    object). Raises ValueError naming the field otherwise."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in KINDS if _is_set(name, getattr(self, name))]
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}; got {got}"
                if chosen
                else f"structured_outputs must set one of {', '.join(KINDS)}; got none"
            )
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json_module.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if _is_set(name, getattr(self, name)))

    def grammar_spec(self) -> GrammarSpec:
        """The canonical, hashable spec: two requests with the same schema (dict or string, any spacing) share one
        grammar. Key order counts: it is the order in which the output lists the properties."""
        kind = self.kind
        if kind == "json":
            schema = json_module.loads(self.json) if isinstance(self.json, str) else self.json
            # Key order is kept: properties are generated in the order the schema lists them.
            return GrammarSpec(kind, json_module.dumps(schema, separators=(",", ":")))
        if kind == "choice":
            return GrammarSpec(kind, json_module.dumps(self.choice))
        if kind == "json_object":
            return GrammarSpec(kind, "")
        text = getattr(self, kind)
        assert isinstance(text, str)
        return GrammarSpec(kind, text)


def _is_set(name: str, value: Any) -> bool:
    return value is not None and not (name == "json_object" and value is False)

"""One interface over the grammar libraries (xgrammar, llguidance): compile a GrammarSpec for a vocabulary, make a
matcher per request, fill a batch of bitmask rows in one call.

Bitmasks are numpy int32 arrays [rows, ceil(V / 32)], bit j of word w set = token 32 w + j allowed (both libraries'
layout), so they cross from the core to the worker as plain data. ``backend="auto"`` is llguidance where it is
installed: docs/performance.md has the measurements that chose it (compile latency, per-step mask time), and it
refuses schema keywords it cannot enforce where xgrammar ignores them.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Protocol

import numpy as np

from folio.structured.params import GrammarSpec

BACKENDS = ("auto", "guidance", "xgrammar")
_MODULE_OF = {"guidance": "llguidance", "xgrammar": "xgrammar"}
_AUTO_ORDER = ("guidance", "xgrammar")  # by measurement: docs/performance.md, "Structured outputs"


class GrammarError(ValueError):
    """The schema, regex or grammar does not compile, or uses a feature the backend cannot enforce.

    str() is "structured_outputs.<kind>: <the compiler's message>"; ``detail`` is the compiler's message alone.
    """

    def __init__(self, spec: GrammarSpec, detail: str) -> None:
        super().__init__(f"{field_of(spec)}: {detail}")
        self.detail = detail


class Matcher(Protocol):
    """One request's position in its grammar."""

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False (and the matcher unusable) at the first one the grammar forbids."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def validate_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of ``token_ids`` the grammar accepts from here; the matcher ends where it
        started (speculative decoding checks drafts with it before they are scheduled)."""

    def is_terminated(self) -> bool:
        """Nothing but a stop token may follow (llguidance: from when the grammar is complete; xgrammar: once
        the stop token is accepted)."""


class StructuredOutputBackend(Protocol):
    name: str
    vocab_size: int

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar for this vocabulary (slow: run off the step loop); raises GrammarError."""

    def new_matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of ``compiled`` (cheap)."""

    def fill_bitmask(self, rows: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """For each (matcher, row), write the tokens the matcher allows next into ``bitmask[row]``; one call."""

    def fill_bitmask_with_drafts(self, rows: list[tuple[Matcher, int, list[int]]], bitmask: np.ndarray) -> None:
        """For each (matcher, row, drafts) with d drafts the grammar accepts: ``bitmask[row + j]`` for j = 0..d
        is the mask after drafts[:j] (the rows speculative decoding verifies); every matcher ends where it
        started. One call."""


def allocate_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """[num_rows, ceil(V / 32)] int32, every token allowed (-1 = all 32 bits set)."""
    return np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


def fill_bitmask_by_rounds(
    backend: StructuredOutputBackend, rows: list[tuple[Matcher, int, list[int]]], bitmask: np.ndarray
) -> None:
    """fill_bitmask_with_drafts from fill_bitmask: round j fills row + j of every matcher with >= j drafts in one
    batched call, then advances those by drafts[j]; at the end each matcher is rolled back by its advances.
    Example: drafts [a, b] and [c] -> rounds fill (m1, r1), (m2, r2); (m1, r1 + 1), (m2, r2 + 1); (m1, r1 + 2)."""
    advanced = [0] * len(rows)
    try:
        for j in range(1 + max((len(drafts) for _, _, drafts in rows), default=0)):
            active = [i for i, (_, _, drafts) in enumerate(rows) if j <= len(drafts)]
            backend.fill_bitmask([(rows[i][0], rows[i][1] + j) for i in active], bitmask)
            for i in active:
                matcher, _, drafts = rows[i]
                if j < len(drafts):
                    if not matcher.accept_tokens([drafts[j]]):
                        raise AssertionError(f"a draft the grammar refuses was scheduled: {drafts}")
                    advanced[i] += 1
    finally:
        for (matcher, _, _), count in zip(rows, advanced, strict=True):
            if count:
                matcher.rollback(count)


def resolve_backend_name(name: str) -> str:
    """ "auto" -> the first installed of _AUTO_ORDER; a named backend must be installed. Raises ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_config.backend must be one of {BACKENDS}, got {name!r}")
    candidates = _AUTO_ORDER if name == "auto" else (name,)
    for candidate in candidates:
        if importlib.util.find_spec(_MODULE_OF[candidate]) is not None:
            return candidate
    wanted = " or ".join(_MODULE_OF[c] for c in candidates)
    raise ValueError(f"structured outputs backend {name!r} needs the {wanted} package, which is not installed")


def create_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], num_threads: int = 1
) -> StructuredOutputBackend:
    """The backend ``name`` ("auto" resolved) for ``tokenizer`` (a Hugging Face tokenizer) and the model's
    ``vocab_size`` (logits width, may exceed the tokenizer's); ``stop_token_ids`` end a complete grammar."""
    name = resolve_backend_name(name)
    if name == "guidance":
        from folio.structured.guidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, stop_token_ids, num_threads)
    from folio.structured.xgrammar_backend import XgrammarBackend

    return XgrammarBackend(tokenizer, vocab_size, stop_token_ids, num_threads)


@functools.lru_cache(maxsize=256)  # only successes are cached: a bad spec raises again, with its message
def validate_grammar_spec(name: str, spec: GrammarSpec) -> None:
    """Check that ``spec`` compiles with backend ``name``, without a tokenizer (the frontend's check, so a bad
    request fails at add_request with nothing allocated). Raises GrammarError with the compiler's message."""
    name = resolve_backend_name(name)
    if name == "guidance":
        from folio.structured.guidance_backend import validate

        validate(spec)
    else:
        from folio.structured.xgrammar_backend import validate

        validate(spec)


def field_of(spec: GrammarSpec) -> str:
    """The request field a spec came from, for error messages: structured_outputs.json, ..."""
    return f"structured_outputs.{spec.kind}"

"""xgrammar: a GrammarCompiler per vocabulary compiles each spec (its adaptive token-mask cache is the slow part);
a GrammarMatcher per request; one BatchGrammarMatcher call fills a batch of bitmask rows.

Installed with ``pip install --no-deps`` (scripts/setup.sh): its declared dependencies pull triton, which it does
not need on the CPU. xgrammar ignores JSON schema keywords it does not implement, so schemas are first checked
against ``UNSUPPORTED_JSON_KEYWORDS`` (vLLM's list) and refused rather than silently loosened.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import xgrammar

from folio.structured.backend import GrammarError, fill_bitmask_by_rounds
from folio.structured.params import GrammarSpec
from folio.structured.token_bytes import check_token_bytes

_MAX_JSON_WHITESPACE = 4  # as the guidance backend: a model cannot pad JSON with whitespace forever
# Keywords xgrammar accepts but does not enforce (as vLLM's has_xgrammar_unsupported_json_features).
UNSUPPORTED_JSON_KEYWORDS = frozenset(
    {"multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "not", "patternProperties",
     "propertyNames", "if", "then", "else", "dependentSchemas", "dependentRequired", "unevaluatedItems",
     "minProperties", "maxProperties"}
)  # fmt: skip


def _unsupported_keyword(schema: Any) -> str | None:
    """The first keyword of UNSUPPORTED_JSON_KEYWORDS anywhere in the schema, or None. Property names, enum and
    const values are data, not keywords."""
    if isinstance(schema, list):
        return next((k for k in map(_unsupported_keyword, schema) if k is not None), None)
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in UNSUPPORTED_JSON_KEYWORDS:
            return key
        if key in ("enum", "const", "default", "examples"):
            continue
        is_name_map = key in ("properties", "$defs", "definitions") and isinstance(value, dict)
        values = value.values() if is_name_map else [value]
        found = next((k for k in map(_unsupported_keyword, values) if k is not None), None)
        if found is not None:
            return found
    return None


def _choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"`` with each choice as an EBNF string literal (JSON escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _grammar(spec: GrammarSpec) -> Any:
    """The xgrammar.Grammar of ``spec`` (no tokenizer); raises GrammarError with the compiler's message."""
    try:
        if spec.kind == "json":
            keyword = _unsupported_keyword(json.loads(spec.text))
            if keyword is not None:
                raise GrammarError(spec, f"the xgrammar backend cannot enforce {keyword!r}")
            return xgrammar.Grammar.from_json_schema(spec.text, max_whitespace_cnt=_MAX_JSON_WHITESPACE)
        if spec.kind == "json_object":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', max_whitespace_cnt=_MAX_JSON_WHITESPACE)
        if spec.kind == "regex":
            return xgrammar.Grammar.from_regex(spec.text)
        if spec.kind == "choice":
            return xgrammar.Grammar.from_ebnf(_choice_ebnf(json.loads(spec.text)))
        return xgrammar.Grammar.from_ebnf(spec.text)
    except GrammarError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with the parser's message
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GrammarError(spec, _strip_source_location(message)) from None


def _strip_source_location(message: str) -> str:
    """'[12:00:00] /project/cpp/x.cc:83: Regex parsing error...' -> 'Regex parsing error...'."""
    parts = message.split(": ", 1)
    return parts[1] if len(parts) == 2 and ".cc:" in parts[0] else message


def validate(spec: GrammarSpec) -> None:
    _grammar(spec)


class XgrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return all(self.matcher.accept_token(t) for t in token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """Advance while accepted (a refused token leaves xgrammar's state as it was), then roll back."""
        count = 0
        for token_id in token_ids:
            if not self.matcher.accept_token(token_id):
                break
            count += 1
        if count:
            self.matcher.rollback(count)
        return count

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], num_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        decoded_vocab = info.decoded_vocab  # a property that builds the whole list anew (~0.1 s for 49k tokens)
        check_token_bytes(self.name, tokenizer, lambda ids: b"".join(decoded_vocab[i] for i in ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=num_threads)

    def compile(self, spec: GrammarSpec) -> Any:
        return self.compiler.compile_grammar(_grammar(spec))

    def new_matcher(self, compiled: Any) -> XgrammarMatcher:
        return XgrammarMatcher(xgrammar.GrammarMatcher(compiled))

    def fill_bitmask(self, rows: list[tuple[Any, int]], bitmask: np.ndarray) -> None:
        matchers = [m.matcher for m, _ in rows]
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask, [row for _, row in rows])

    def fill_bitmask_with_drafts(self, rows: list[tuple[Any, int, list[int]]], bitmask: np.ndarray) -> None:
        fill_bitmask_by_rounds(self, rows, bitmask)  # one batched fill per draft position (no batched draft call)

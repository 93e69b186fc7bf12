"""llguidance: a grammar is a string; the first LLMatcher built from it does the compile (lexer, token trie),
and later requests deep-copy that one (cheap). Masks for a batch come from one LLExecutor call.

JSON schemas are compiled strictly: a keyword llguidance cannot enforce (``not``, ``uniqueItems``, ...) is an
error, never silently ignored. Whitespace between JSON tokens is at most one space or newline run of
``_MAX_JSON_WHITESPACE`` characters, so a model cannot pad forever (the JSON stays valid either way).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import numpy as np

from folio.structured.backend import GrammarError
from folio.structured.params import GrammarSpec
from folio.structured.token_bytes import check_token_bytes

_MAX_JSON_WHITESPACE = 4
_JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{_MAX_JSON_WHITESPACE}}}"}


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar (a JSON string) for ``spec``; raises GrammarError for text that cannot convert."""
    try:
        if spec.kind == "json":
            return str(llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=dict(_JSON_OPTIONS)))
        if spec.kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS))
        if spec.kind == "choice":
            choices = json.loads(spec.text)
            return str(llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices)))
        if spec.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(spec.text))
        return str(llguidance.grammar_from("grammar", spec.text))  # GBNF or Lark
    except Exception as e:  # ValueError from the converters; anything else is still the input's fault
        raise GrammarError(spec, str(e) or type(e).__name__) from None


def validate(spec: GrammarSpec, tokenizer: Any = None) -> str:
    """The grammar text for ``spec``, checked (with ``tokenizer`` when given); raises GrammarError."""
    text = grammar_text(spec)
    error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
    if error:
        raise GrammarError(spec, error.strip())
    return text


class GuidanceMatcher:
    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for token_id in token_ids:
            if self.matcher.is_stopped():  # complete: llguidance takes no more tokens; a stop token is the end
                return token_id in self.stop_token_ids
            if not self.matcher.consume_token(token_id):
                return False
        return not self.matcher.is_error()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def validate_tokens(self, token_ids: list[int]) -> int:
        return int(self.matcher.validate_tokens(token_ids))  # llguidance's own check: the state does not move

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], num_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        # Every stop id ends a complete grammar (models with several EOS ids).
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids))
        check_token_bytes(self.name, tokenizer, self.tokenizer.decode_bytes)
        self.executor = llguidance.LLExecutor(num_threads=num_threads)

    def compile(self, spec: GrammarSpec) -> Any:
        """A template LLMatcher at the grammar's start; new_matcher deep-copies it."""
        text = validate(spec, self.tokenizer)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise GrammarError(spec, str(matcher.get_error()))
        return matcher

    def new_matcher(self, compiled: Any) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.deep_copy(), self.stop_token_ids)

    def fill_bitmask(self, rows: list[tuple[Any, int]], bitmask: np.ndarray) -> None:
        assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"]
        pairs = [(m.matcher, row) for m, row in rows]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])

    def fill_bitmask_with_drafts(self, rows: list[tuple[Any, int, list[int]]], bitmask: np.ndarray) -> None:
        """llguidance's own batched call for the matchers with drafts (it advances each through its drafts, masks
        every row, rolls back; it refuses an empty draft list), the plain one for the others."""
        assert bitmask.dtype == np.int32 and bitmask.flags["C_CONTIGUOUS"]
        triples = [(m.matcher, row, list(drafts)) for m, row, drafts in rows if drafts]
        self.executor.unsafe_compute_mask_ptr_with_draft_token(
            triples, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        )
        if len(triples) < len(rows):
            self.fill_bitmask([(m, row) for m, row, drafts in rows if not drafts], bitmask)

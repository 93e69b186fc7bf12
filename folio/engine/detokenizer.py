"""Incremental detokenization: output token ids -> text, a few tokens at a time, in O(1) work per token.

Why not decode the whole output every step: that is O(n) per token, O(n^2) per request. Why not decode each
token alone: byte-level BPE splits one UTF-8 character over several tokens (an emoji is often 2-4 tokens), and
tokenizers that strip a leading space need the previous token as context. vLLM's answer, used here, keeps the
token strings and two offsets into them:

    tokens:  [... prompt tail ...][ output tokens ... ]
                   ^prefix_offset     ^read_offset
    prefix_text = string(tokens[prefix_offset:read_offset])  # already emitted; decoded again only for context
    new_text    = string(tokens[prefix_offset:])             # context + the not yet emitted tokens
    emitted     = new_text[len(prefix_text):]

When ``new_text`` ends in U+FFFD a character is still incomplete: nothing is emitted and the offsets stay, so the
next token decodes together with the held bytes. Otherwise both offsets move forward, keeping the window short.
"""

from __future__ import annotations

from typing import Any

# How many prompt tokens to keep as decoding context for the first output token (vLLM's value).
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one sequence's output; ``update`` returns only the text that became final with the new ids.

    Invariant: ``output_text`` == everything ``update`` and ``flush`` returned, concatenated.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self._skip_ids = special_token_ids(tokenizer) if skip_special_tokens else frozenset()
        # The prompt's last tokens give the first output token its context (e.g. a leading space).
        self._tokens: list[str] = self._to_tokens(context_ids(prompt_token_ids))
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _INITIAL_CONTEXT_TOKENS, 0)

    def update(self, new_token_ids: list[int]) -> str:
        """Append ``new_token_ids``; return the newly final text (possibly "" while a character is incomplete)."""
        pieces: list[str] = []
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            self._tokens.extend(self._to_tokens([token_id]))
            pieces.append(self._emit())
        text = "".join(pieces)
        self.output_text += text
        return text

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character, as U+FFFD) when the sequence is finished."""
        prefix_text = self._tokens_to_string(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._tokens_to_string(self._tokens[self._prefix_offset :])
        text = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self.output_text += text
        return text

    def _emit(self) -> str:
        """Decode the window; move the offsets and return the new text unless it ends mid-character."""
        prefix_text = self._tokens_to_string(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._tokens_to_string(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return new_text[len(prefix_text) :]

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        kept = [t for t in token_ids if t not in self._skip_ids]
        tokens = self.tokenizer.convert_ids_to_tokens(kept)
        if isinstance(tokens, str):
            tokens = [tokens]
        return [t if t is not None else "" for t in tokens]  # ids outside the vocabulary decode to nothing

    def _tokens_to_string(self, tokens: list[str]) -> str:
        """Fast tokenizers decode added tokens themselves; slow ones need them joined by hand (as vLLM does),
        which is the only place ``spaces_between_special_tokens`` matters."""
        if not tokens:
            return ""
        if self.tokenizer.is_fast or not self.tokenizer.get_added_vocab():
            return str(self.tokenizer.convert_tokens_to_string(tokens))
        return _slow_tokens_to_string(self.tokenizer, tokens, self.spaces_between_special_tokens)


class StreamDetokenizer:
    """IncrementalDetokenizer's contract on a fast tokenizer, through the Rust tokenizers' own DecodeStream (the
    same prefix / read offsets, kept in Rust): one call per token where the Python offsets cost three
    (convert_ids_to_tokens and two convert_tokens_to_string). 8192 W1-sized tokens: 26.3 -> 7.3 ms
    (benchmarks/detokenizer.py)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer._tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=context_ids(prompt_token_ids), skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []  # ids since the last text the stream gave: an incomplete character
        self.output_text = ""
        self.output_token_ids: list[int] = []

    def update(self, new_token_ids: list[int]) -> str:
        """Append ``new_token_ids``; return the newly final text (possibly "" while a character is incomplete)."""
        pieces: list[str] = []
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            chunk = self._stream.step(self._backend, token_id)
            if chunk is None:
                self._held.append(token_id)
            else:
                self._held.clear()
                pieces.append(chunk)
        text = "".join(pieces)
        self.output_text += text
        return text

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character, as U+FFFD) when the sequence is finished."""
        text = (
            str(self._backend.decode(self._held, skip_special_tokens=self._skip_special_tokens)) if self._held else ""
        )
        self._held.clear()
        self.output_text += text
        return text


def make_detokenizer(
    tokenizer: Any,
    prompt_token_ids: list[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> IncrementalDetokenizer | StreamDetokenizer:
    """The Rust DecodeStream where the tokenizer is a fast one (spaces_between_special_tokens only matters to slow
    tokenizers) and the prompt's context tokens decode to whole characters, else the Python offsets: a stream
    primed with half a character gave the prompt's text back with the first output token."""
    fast = getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "_tokenizer")
    if fast and _REPLACEMENT_CHAR not in tokenizer._tokenizer.decode(context_ids(prompt_token_ids), False):
        return StreamDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens)


def context_ids(prompt_token_ids: list[int]) -> list[int]:
    """The prompt's last tokens, which give the first output token its context (e.g. a leading space)."""
    return prompt_token_ids[-(_INITIAL_CONTEXT_TOKENS + 2) :]


def _slow_tokens_to_string(tokenizer: Any, tokens: list[str], spaces_between_special_tokens: bool) -> str:
    """Decode runs of ordinary tokens separately from added tokens, then join (slow tokenizers only)."""
    added_vocab = tokenizer.get_added_vocab()
    sub_texts: list[str] = []
    run: list[str] = []
    for token in tokens:
        if token in added_vocab:
            if run:
                sub_texts.append(tokenizer.convert_tokens_to_string(run))
                run = []
            sub_texts.append(token)
        else:
            run.append(token)
    if run:
        sub_texts.append(tokenizer.convert_tokens_to_string(run))
    return (" " if spaces_between_special_tokens else "").join(sub_texts)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that skip_special_tokens hides: the tokenizer's special ids plus every added token marked special.

    transformers' GGUF tokenizers disagree across versions on which ids ``all_special_ids`` lists (5.17 omits
    <|im_end|> of SmolLM2, while ``decode`` still hides it), so the added tokens' own flag is read too.
    """
    ids = set(getattr(tokenizer, "all_special_ids", []))
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One token's text for a logprob entry (``decoded_token``); special tokens are shown, a partial UTF-8
    character shows as U+FFFD (as in vLLM)."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return str(text) if text is not None else ""

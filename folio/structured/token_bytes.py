"""A start-up check that a grammar library reads the vocabulary as transformers does.

A grammar library builds each token's bytes from the tokenizer's own description. Where that description misleads
it, every mask is wrong and valid text is refused. transformers 5.17 converted byte-level GGUF vocabularies with
byte_fallback and a sentencepiece decoder, so llguidance read SmolLM2's "Ġ" as the bytes c4 a0, not a space;
requests then ended with "sampled a token their grammar forbids". The backend now refuses to start instead, with
the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Spaces, quotes, brackets, digits, letters: the bytes JSON and most grammars are made of.
PROBE = '{"key": [1, 2.5, true], "b": "x y"}'


def check_token_bytes(backend_name: str, tokenizer: Any, token_bytes: Callable[[list[int]], bytes]) -> None:
    """Raises ValueError where ``token_bytes`` (the library's bytes of a token sequence) spells PROBE's tokens
    otherwise than the tokenizer decodes them. A tokenizer that cannot spell PROBE itself (a word-level test
    vocabulary) is not checked. Leading spaces are ignored (sentencepiece decoding drops the first one)."""
    ids = tokenizer.encode(PROBE, add_special_tokens=False)
    expected = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    if expected.strip() != PROBE:
        return
    got = token_bytes(ids)
    if got.lstrip(b" ") != expected.lstrip(" ").encode():
        raise ValueError(
            f"structured outputs backend {backend_name!r} reads this tokenizer's tokens as other bytes than "
            f"transformers decodes them ({got!r} for {PROBE!r}), so its grammars would refuse valid text; "
            "transformers 5.17 converts GGUF tokenizers this way: install transformers>=5.18"
        )

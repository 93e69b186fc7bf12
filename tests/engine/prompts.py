"""Prompts of varied length for end-to-end comparisons (plain text and chat-templated)."""

from __future__ import annotations

from typing import Any

_STORY = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker named "
    "Elias. Every morning he opened his shop, wound the hundred clocks on his walls, and waited for customers "
    "who rarely came. One winter evening a girl knocked on his door holding a broken pocket watch. "
)

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Here is a list of the planets of the solar system:",
    "1, 2, 3, 4,",
    _STORY + "Elias looked at the watch and said",
    (_STORY * 3) + "The girl asked him",
    "Translate to French: I would like a cup of coffee, please.",
    "The three primary colors are",
    "A haiku about the sea:\n",
]

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
]


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    out = []
    for q in CHAT_QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def all_prompt_token_ids(tokenizer: Any) -> list[list[int]]:
    plain = [list(tokenizer.encode(p, add_special_tokens=False)) for p in PLAIN_PROMPTS]
    return plain + chat_prompts(tokenizer)

"""The ``copy_edit`` dataset: chat prompts that ask the model to repeat or lightly edit a passage or a piece of
code they contain (issue 19's copy-heavy workload, where n-gram speculation finds its drafts in the prompt).

Each request is one passage under one instruction, rendered with the model's chat template; requests cycle
through every (instruction, passage) pair in an order the seed fixes. Generation stops at EOS (a copy ends where
the passage does) or at ``--copy-edit-output-len`` tokens. The passages are written for this benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from folio.bench.datasets import SampleRequest

PROSE = (
    "The city council met on Tuesday evening to discuss the new budget. After three hours of debate, the members "
    "voted to increase funding for public libraries and to repair the old bridge over the river. The mayor said "
    "that the decision reflected the wishes of the residents, who had asked for better services for many years.",
    "To make bread at home, mix flour, water, salt and a little yeast in a large bowl. Knead the dough for ten "
    "minutes until it is smooth, then leave it covered in a warm place for two hours. Shape the loaf, let it rise "
    "again for forty minutes, and bake it in a hot oven until the crust is brown and sounds hollow when tapped.",
    "Our team will release the new version of the application next Monday. It fixes the crash that some users saw "
    "when they opened large files, makes the search page twice as fast, and adds a dark theme. Please back up your "
    "settings before you upgrade, and report any problem to the support address listed on the website.",
    "The museum is open every day except Monday, from nine in the morning until six in the evening. Tickets cost "
    "twelve dollars for adults and are free for children under twelve. Guided tours start every hour at the main "
    "entrance, and the cafe on the second floor serves lunch and coffee until half past five.",
)

CODE = (
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n",
    "def binary_search(items, target):\n    low, high = 0, len(items) - 1\n    while low <= high:\n"
    "        mid = (low + high) // 2\n        if items[mid] == target:\n            return mid\n"
    "        if items[mid] < target:\n            low = mid + 1\n        else:\n            high = mid - 1\n"
    "    return -1\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, word):\n"
    "        self.counts[word] = self.counts.get(word, 0) + 1\n\n    def most_common(self, n):\n"
    "        ranked = sorted(self.counts.items(), key=lambda kv: kv[1], reverse=True)\n        return ranked[:n]\n",
    "def read_config(path):\n    config = {}\n    with open(path) as f:\n        for line in f:\n"
    "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"
    "            key, value = line.split('=', 1)\n            config[key.strip()] = value.strip()\n    return config\n",
)

# (instruction, passage kind): the passage follows the instruction after a blank line.
INSTRUCTIONS = (
    ("Repeat the following paragraph word for word:", "prose"),
    ("Correct the spelling mistakes in this paragraph and return the whole paragraph:", "prose_typos"),
    ("Copy this code exactly:", "code"),
    ("Rewrite this Python code with the first variable renamed to `value`. Output only the code.", "code"),
)

_TYPOS = (("the ", "teh "), ("and ", "adn "), ("until", "untill"), ("which", "wich"))


def _with_typos(text: str) -> str:
    """The paragraph with a few common misspellings (every third occurrence of each), for the correction task."""
    for right, wrong in _TYPOS:
        parts = text.split(right)
        text = "".join(p + (wrong if i % 3 == 1 else right) for i, p in enumerate(parts[:-1])) + parts[-1]
    return text


@dataclass(frozen=True)
class CopyEditPrompt:
    instruction: str
    passage: str

    def message(self) -> str:
        return f"{self.instruction}\n\n{self.passage}"


def copy_edit_prompts() -> list[CopyEditPrompt]:
    """Every (instruction, passage) pair, in a fixed order."""
    prompts = []
    for instruction, kind in INSTRUCTIONS:
        passages = CODE if kind == "code" else PROSE
        for passage in passages:
            prompts.append(CopyEditPrompt(instruction, _with_typos(passage) if kind == "prose_typos" else passage))
    return prompts


def sample_copy_edit(
    num_prompts: int, output_len: int, seed: int, render_chat: Callable[[str], list[int]]
) -> list[SampleRequest]:
    """``num_prompts`` requests cycling through a seeded permutation of the pairs; ``render_chat`` turns one user
    message into prompt ids (the model's chat template with the generation prompt)."""
    pairs = copy_edit_prompts()
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [
        SampleRequest(render_chat(pairs[order[i % len(pairs)]].message()), output_len, ignore_eos=False)
        for i in range(num_prompts)
    ]


def chat_renderer(tokenizer: Any) -> Callable[[str], list[int]]:
    """One user message -> prompt ids through the tokenizer's chat template, as `LLM.chat` renders it."""

    def render(message: str) -> list[int]:
        messages = [{"role": "user", "content": message}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return render


def render_chat_for(dataset_name: str, tokenizer_path: str | None) -> Callable[[str], list[int]] | None:
    """The chat renderer copy_edit needs for an HTTP benchmark (the tokenizer at ``tokenizer_path``, default
    Folio's default model); None for every other dataset."""
    if dataset_name != "copy_edit":
        return None
    from folio.model.model_files import default_model_path, load_tokenizer

    return chat_renderer(load_tokenizer(tokenizer_path or default_model_path()))

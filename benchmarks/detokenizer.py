"""Incremental detokenization of a W1-sized run: the Python offsets against the Rust DecodeStream.

    .venv/bin/python benchmarks/detokenizer.py

64 W1 prompts, 128 random output ids each, one id per update as the engine feeds them; best of 5 per kind.
Prints each kind's milliseconds for the 8192 tokens and the ratio, and whether the texts are identical.
"""

from __future__ import annotations

import random
import time
from typing import Any

from folio.bench.datasets import DEFAULT_W1_PATH, load_w1
from folio.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer
from folio.model.loader import default_model_path, load_tokenizer


def run(cls: Any, tokenizer: Any, prompts: list[list[int]], outputs: list[list[int]]) -> tuple[float, list[str]]:
    start = time.perf_counter()
    texts = []
    for prompt, output in zip(prompts, outputs, strict=True):
        detok = cls(tokenizer, prompt, skip_special_tokens=True)
        for token_id in output:
            detok.update([token_id])
        detok.flush()
        texts.append(detok.output_text)
    return time.perf_counter() - start, texts


def main() -> None:
    tokenizer = load_tokenizer(default_model_path())
    prompts = [r.prompt_token_ids for r in load_w1(str(DEFAULT_W1_PATH), 64, 128)]
    rng = random.Random(0)
    outputs = [[rng.randrange(len(tokenizer)) for _ in range(128)] for _ in prompts]
    best: dict[str, float] = {}
    texts: dict[str, list[str]] = {}
    for _ in range(5):
        for cls in (IncrementalDetokenizer, StreamDetokenizer):
            seconds, texts[cls.__name__] = run(cls, tokenizer, prompts, outputs)
            best[cls.__name__] = min(best.get(cls.__name__, seconds), seconds)
    python, rust = best["IncrementalDetokenizer"], best["StreamDetokenizer"]
    ratio = python / rust
    print(f"{64 * 128} tokens: Python offsets {python * 1e3:.1f} ms, DecodeStream {rust * 1e3:.1f} ms, {ratio:.1f}x")
    same = sum(a == b for a, b in zip(texts["IncrementalDetokenizer"], texts["StreamDetokenizer"], strict=True))
    print(f"identical texts: {same} of {len(prompts)}")


if __name__ == "__main__":
    main()

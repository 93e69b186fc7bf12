"""The tokenizer of a GGUF file, converted once and kept on disk as a Hugging Face tokenizer directory.

transformers builds a GGUF's tokenizer by parsing the whole header with ``gguf.GGUFReader`` (49k vocabulary
strings and 49k merges for SmolLM2, element by element): about 3 s of CPU at every ``folio serve``, ``LLM()`` or
``bench serve`` start. The converted tokenizer saves to a few files that load in about 0.3 s. The cache key is a
hash of the GGUF header (every metadata byte the conversion reads) and the transformers and tokenizers versions,
so an edited file or an upgraded converter never loads a stale entry. Any failure to read or write the cache
falls back to the conversion; a cache entry is written to a temporary directory and renamed into place, so a
reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from folio.model.gguf_file import GGUFFile

if TYPE_CHECKING:  # transformers is imported where a tokenizer is loaded: the engine core often never needs one
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("folio")

_FORMAT = b"folio-gguf-tokenizer-v1"
_COMPLETE_MARKER = ".complete"  # written last into the temporary directory, before the rename
# Constructor flags save_pretrained leaves out; passed back on load, the tokenizer's state is the converted one's.
_EXTRA_KWARGS_FILE = "folio_init_kwargs.json"
_EXTRA_KWARGS = ("add_bos_token", "add_eos_token")


def default_tokenizer_cache_dir() -> Path:
    """Next to the compiled kernels' cache (folio/kernels/cpu_build.py)."""
    return Path.home() / ".cache" / "folio" / "tokenizers"


def tokenizer_cache_key(gguf: GGUFFile) -> str:
    """A hash of the GGUF header and the converter's versions: equal keys convert to equal tokenizers."""
    import tokenizers
    import transformers

    key = hashlib.sha256(_FORMAT)
    key.update(f"transformers={transformers.__version__} tokenizers={tokenizers.__version__}".encode())
    key.update(gguf.mmap[: min(gguf.data_offset, len(gguf.mmap))].tobytes())  # a few MB
    return key.hexdigest()[:32]


def load_cached_tokenizer(
    gguf: GGUFFile, convert: Callable[[], PreTrainedTokenizerBase], cache_dir: Path
) -> PreTrainedTokenizerBase:
    """The tokenizer of ``gguf`` from ``cache_dir`` if an entry for its key is there, else ``convert()``'s, which
    is then saved there for the next start. The result is the converted tokenizer as the caller would have had
    it, name_or_path included (the directory of the GGUF file)."""
    entry = cache_dir / tokenizer_cache_key(gguf)
    name_or_path = os.path.dirname(os.path.abspath(gguf.path))
    damaged = False
    if (entry / _COMPLETE_MARKER).is_file():
        try:
            extra = json.loads((entry / _EXTRA_KWARGS_FILE).read_text())
            cached: PreTrainedTokenizerBase = _tokenizer_class(entry).from_pretrained(entry, **extra)
        except Exception as e:  # whatever is wrong with the entry: convert again (and replace it below)
            logger.warning("tokenizer cache entry %s unreadable (%s): converting the GGUF tokenizer again", entry, e)
            damaged = True
        else:
            cached.name_or_path = name_or_path
            return cached
    tokenizer = convert()
    _save(tokenizer, entry, replace=damaged)
    return tokenizer


# The classes a converted GGUF tokenizer saves as, loaded directly: AutoTokenizer's import pulls in torch (about a
# second of a server's start), which the API server process otherwise never needs.
_DIRECT_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(entry: Path) -> Any:
    """The class to load an entry with: its saved tokenizer_class where that is a fast tokenizer, else AutoTokenizer."""
    import transformers

    name = json.loads((entry / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if name in _DIRECT_CLASSES and hasattr(transformers, name):
        return getattr(transformers, name)
    from transformers import AutoTokenizer

    return AutoTokenizer


def _save(tokenizer: PreTrainedTokenizerBase, entry: Path, replace: bool) -> None:
    """Writes the entry unless a complete one appeared meanwhile (another process converting at the same time),
    which others may be reading; one without its marker, or the damaged one the caller found, is replaced."""
    staging: str | None = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent)
        tokenizer.save_pretrained(staging)
        extra = {name: getattr(tokenizer, name) for name in _EXTRA_KWARGS if hasattr(tokenizer, name)}
        Path(staging, _EXTRA_KWARGS_FILE).write_text(json.dumps(extra))
        Path(staging, _COMPLETE_MARKER).write_text("ok\n")
        if entry.exists():
            if (entry / _COMPLETE_MARKER).is_file() and not replace:
                return  # the finally below drops ours
            shutil.rmtree(entry)
        os.rename(staging, entry)
        staging = None
    except Exception as e:  # noqa: BLE001 - e.g. a read-only home, or a tokenizer that cannot save: converts again
        logger.debug("could not save the tokenizer cache entry %s: %s", entry, e)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)

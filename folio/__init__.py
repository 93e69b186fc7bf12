"""Folio: a paged-KV-cache LLM inference and serving engine.

The public names load lazily, so that ``import folio.core`` (pure Python) never pulls in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from folio.beam_search import BeamSearchOutput, BeamSearchParams
    from folio.config import EngineArgs
    from folio.llm import LLM
    from folio.outputs import CompletionOutput, RequestOutput
    from folio.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineArgs",
    "BeamSearchParams",
    "BeamSearchOutput",
]
__version__ = "0.1.0"

_PUBLIC = {
    "LLM": "folio.llm",
    "SamplingParams": "folio.sampling_params",
    "RequestOutput": "folio.outputs",
    "CompletionOutput": "folio.outputs",
    "EngineArgs": "folio.config",
    "BeamSearchParams": "folio.beam_search",
    "BeamSearchOutput": "folio.beam_search",
}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'folio' has no attribute {name!r}")

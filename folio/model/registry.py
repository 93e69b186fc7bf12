"""Architecture name -> model class. One family class serves several Hugging Face architectures.

Hugging Face names come from config.json "architectures"; GGUF names from "general.architecture" and are
first mapped to a Hugging Face name, so the rest of the loader speaks one vocabulary. The names are checked
without torch (the API server reads model specs too); the class is imported where a model is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from folio.model.llama import LlamaForCausalLM

# Every supported architecture is Llama-shaped today; a second family would share LlamaForCausalLM's
# interface (forward, compute_logits, load_weights) and this map would name its class too.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# GGUF general.architecture -> Hugging Face architecture. Only "llama" stores q/k in llama.cpp's permuted
# rotary layout that the GGUF loader knows how to undo.
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM"}


def check_architecture(architecture: str) -> None:
    """Raises ValueError naming the architecture and the supported ones if it is unknown."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """Raises ValueError naming the architecture and the supported ones if it is unknown."""
    check_architecture(architecture)
    from folio.model.llama import LlamaForCausalLM  # torch: only where a model is built

    return LlamaForCausalLM


def hf_architecture_for_gguf(gguf_architecture: str, path: str) -> str:
    """GGUF arch name -> Hugging Face name; ValueError naming the file and the supported GGUF archs if unknown."""
    if gguf_architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {gguf_architecture!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return GGUF_ARCHITECTURES[gguf_architecture]

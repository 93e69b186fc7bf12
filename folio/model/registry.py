"""Architecture name -> model class. One family class serves several Hugging Face architectures.

Hugging Face names come from config.json "architectures"; GGUF names from "general.architecture" and are
first mapped to a Hugging Face name, so the rest of the loader speaks one vocabulary.
"""

from __future__ import annotations

from folio.model.llama import LlamaForCausalLM

# Every supported architecture is Llama-shaped today; a second family would share LlamaForCausalLM's
# interface (forward, compute_logits, load_weights) and this type would become a Protocol.
_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

# GGUF general.architecture -> Hugging Face architecture. Only "llama" stores q/k in llama.cpp's permuted
# rotary layout that the GGUF loader knows how to undo.
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM"}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODEL_CLASSES)


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """Raises ValueError naming the architecture and the supported ones if it is unknown."""
    if architecture not in _MODEL_CLASSES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return _MODEL_CLASSES[architecture]


def hf_architecture_for_gguf(gguf_architecture: str, path: str) -> str:
    """GGUF arch name -> Hugging Face name; ValueError naming the file and the supported GGUF archs if unknown."""
    if gguf_architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {gguf_architecture!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return GGUF_ARCHITECTURES[gguf_architecture]

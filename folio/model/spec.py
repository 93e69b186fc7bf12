"""ModelSpec: the shapes and constants of a checkpoint, in one format-independent record.

Read from a GGUF header or a Hugging Face config.json without touching weights, so the engine can size the
KV cache and validate max_model_len before (or without) loading the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelSpec:
    architecture: str  # Hugging Face class name, e.g. "LlamaForCausalLM"; the registry key
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None, or HF rope_scaling with "rope_type" (only "llama3" is supported)
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None
    eos_token_ids: list[int] = field(default_factory=list)
    checkpoint_dtype: str = "float32"  # "float32" / "bfloat16" / "float16"; GGUF dequantizes to "float32"

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") != "llama3":
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling!r} (supported: None, rope_type 'llama3')")

    @property
    def q_size(self) -> int:
        """Width of the query projection: num_attention_heads * head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projections: num_key_value_heads * head_dim."""
        return self.num_key_value_heads * self.head_dim

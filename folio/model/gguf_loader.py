"""GGUF files (llama.cpp): quantized tensors -> float32 weights with HF names (the header -> ModelSpec: gguf_spec.py).

Two translations happen here so the model sees exactly what a Hugging Face checkpoint holds:
- names: "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight" (table below);
- q/k row order: llama.cpp's converter permutes the rows of attn_q / attn_k within each head so that rotary
  rotates adjacent pairs (x0, x1), (x2, x3), ...; Hugging Face rotates halves (x_i, x_{i+64/2}). We undo it
  per head: rows of one head [a0 b0 a1 b1 ...] (pair-interleaved) -> [a0 a1 ... b0 b1 ...].
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from tqdm import tqdm

from folio.model.gguf_dequant import NativeDequantizer, dequantize_to_float32
from folio.model.gguf_file import GGUFFile
from folio.model.spec import ModelSpec

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name_for_gguf(gguf_name: str) -> str | None:
    """ "blk.3.ffn_up.weight" -> "model.layers.3.mlp.up_proj.weight"; None for a name with no mapping."""
    base, _, suffix = gguf_name.rpartition(".")  # suffix "weight" or "bias"
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}" if kind in _LAYER_NAMES else None
    return f"{_GLOBAL_NAMES[base]}.{suffix}" if base in _GLOBAL_NAMES else None


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, pair-interleaved rows -> half-split rows.

    A head of 4 rows stored [r0, r2, r1, r3] (llama.cpp) becomes [r0, r1, r2, r3] (Hugging Face).
    Works for weights [rows, cols] and biases [rows].
    """
    rows = w.shape[0]
    w2 = w.reshape(rows, -1)
    cols = w2.shape[1]
    return w2.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(
    gguf: GGUFFile, spec: ModelSpec, show_progress: bool = True, native: NativeDequantizer | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, float32 tensor) per GGUF tensor, dequantized one at a time (by ``native``, the
    CPU kernels' loop, where given).

    Raises ValueError naming the file and tensor for a tensor this loader does not know.
    """
    desc = f"Loading {os.path.basename(gguf.path)}"
    for gguf_name, info in tqdm(gguf.tensors.items(), desc=desc, unit="tensor", disable=not show_progress):
        hf_name = hf_name_for_gguf(gguf_name)
        if hf_name is None:
            raise ValueError(f"{gguf.path}: GGUF tensor {gguf_name!r} has no known Hugging Face name")
        tensor = dequantize_to_float32(gguf.tensor_bytes(info), info.ggml_type, info.shape, native)
        if ".attn_q." in gguf_name:
            tensor = unpermute_rotary_rows(tensor, spec.num_attention_heads)
        elif ".attn_k." in gguf_name:
            tensor = unpermute_rotary_rows(tensor, spec.num_key_value_heads)
        yield hf_name, tensor

"""GGUF files (llama.cpp): header metadata -> ModelSpec, quantized tensors -> float32 weights with HF names.

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

from folio.model.gguf_dequant import dequantize_to_float32
from folio.model.gguf_file import GGUFFile, SkippedArray
from folio.model.registry import hf_architecture_for_gguf
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


def _get(gguf: GGUFFile, key: str, default: object = None) -> object:
    value = gguf.metadata.get(key, default)
    if value is None:
        raise ValueError(f"{gguf.path}: GGUF metadata has no {key!r}")
    return value


def _get_int(gguf: GGUFFile, key: str, default: int | None = None) -> int:
    value = _get(gguf, key, default)
    if not isinstance(value, int):
        raise ValueError(f"{gguf.path}: GGUF metadata {key!r} is {value!r}, expected an integer")
    return value


def _get_float(gguf: GGUFFile, key: str, default: float | None = None) -> float:
    value = _get(gguf, key, default)
    if not isinstance(value, (int, float)):
        raise ValueError(f"{gguf.path}: GGUF metadata {key!r} is {value!r}, expected a number")
    return float(value)


def read_gguf_spec(gguf: GGUFFile) -> ModelSpec:
    """ModelSpec from the GGUF header. Raises ValueError for an unknown architecture or unsupported RoPE."""
    arch = str(_get(gguf, "general.architecture"))
    architecture = hf_architecture_for_gguf(arch, gguf.path)
    hidden_size = _get_int(gguf, f"{arch}.embedding_length")
    num_heads = _get_int(gguf, f"{arch}.attention.head_count")
    head_dim = _get_int(gguf, f"{arch}.attention.key_length", hidden_size // num_heads)
    rope_dims = _get_int(gguf, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"{gguf.path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    if str(gguf.metadata.get(f"{arch}.rope.scaling.type", "none")) != "none" or "rope_freqs.weight" in gguf.tensors:
        raise ValueError(f"{gguf.path}: GGUF RoPE scaling (rope.scaling.type / rope_freqs) is not supported")
    tokens = gguf.metadata.get("tokenizer.ggml.tokens")
    vocab_default = tokens.length if isinstance(tokens, SkippedArray) else None
    eos_ids = [_get_int(gguf, "tokenizer.ggml.eos_token_id")]
    eot_id = gguf.metadata.get("tokenizer.ggml.eot_token_id")
    if isinstance(eot_id, int) and eot_id not in eos_ids:
        eos_ids.append(eot_id)
    bos_id = gguf.metadata.get("tokenizer.ggml.bos_token_id")
    return ModelSpec(
        architecture=architecture,
        vocab_size=_get_int(gguf, f"{arch}.vocab_size", vocab_default),
        hidden_size=hidden_size,
        intermediate_size=_get_int(gguf, f"{arch}.feed_forward_length"),
        num_hidden_layers=_get_int(gguf, f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=_get_int(gguf, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=_get_float(gguf, f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=_get_float(gguf, f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=None,
        max_position_embeddings=_get_int(gguf, f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        bos_token_id=bos_id if isinstance(bos_id, int) else None,
        eos_token_ids=eos_ids,
        checkpoint_dtype="float32",
    )


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
    gguf: GGUFFile, spec: ModelSpec, show_progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, float32 tensor) per GGUF tensor, dequantized one at a time.

    Raises ValueError naming the file and tensor for a tensor this loader does not know.
    """
    desc = f"Loading {os.path.basename(gguf.path)}"
    for gguf_name, info in tqdm(gguf.tensors.items(), desc=desc, unit="tensor", disable=not show_progress):
        hf_name = hf_name_for_gguf(gguf_name)
        if hf_name is None:
            raise ValueError(f"{gguf.path}: GGUF tensor {gguf_name!r} has no known Hugging Face name")
        tensor = dequantize_to_float32(gguf.tensor_bytes(info), info.ggml_type, info.shape)
        if ".attn_q." in gguf_name:
            tensor = unpermute_rotary_rows(tensor, spec.num_attention_heads)
        elif ".attn_k." in gguf_name:
            tensor = unpermute_rotary_rows(tensor, spec.num_key_value_heads)
        yield hf_name, tensor

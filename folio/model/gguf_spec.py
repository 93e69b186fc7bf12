"""A GGUF file's header -> ModelSpec, without torch (the API server reads it too; folio/model/gguf_loader.py reads
the weights)."""

from __future__ import annotations

from folio.model.gguf_file import GGUFFile, SkippedArray
from folio.model.registry import hf_architecture_for_gguf
from folio.model.spec import ModelSpec


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

"""A Hugging Face model directory's config.json -> ModelSpec, without torch (the API server reads it too;
folio/model/hf_loader.py reads the weights)."""

from __future__ import annotations

import json
import os
from typing import Any

from folio.model.registry import check_architecture
from folio.model.spec import ModelSpec

_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def read_hf_config(model_dir: str) -> dict[str, Any]:
    """config.json of a model directory; FileNotFoundError naming the directory if there is none."""
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"{model_dir}: no config.json; expected a Hugging Face model directory (config.json + *.safetensors) "
            "or a .gguf file"
        )
    return read_json(config_path)


def read_hf_spec(model_dir: str) -> ModelSpec:
    """ModelSpec from config.json (and generation_config.json's EOS ids if present); reads no weights."""
    config = read_hf_config(model_dir)
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError(f"{model_dir}/config.json: no 'architectures' entry")
    architecture = architectures[0]
    check_architecture(architecture)  # unknown architecture -> ValueError listing the supported ones
    if config.get("mlp_bias"):
        raise ValueError(f"{model_dir}/config.json: mlp_bias=true is not supported")
    if config.get("use_sliding_window"):
        raise ValueError(f"{model_dir}/config.json: use_sliding_window=true is not supported")
    num_heads = config["num_attention_heads"]
    rope_theta, rope_scaling = _read_rope(config)
    max_positions = config.get("max_position_embeddings", 2048)
    # Mistral-style sliding window: attention within the window equals full attention, so cap the context there.
    if config.get("sliding_window") and architecture == "MistralForCausalLM":
        max_positions = min(max_positions, config["sliding_window"])
    dtype_name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return ModelSpec(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", architecture == "Qwen2ForCausalLM")),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_read_eos_ids(model_dir, config),
        checkpoint_dtype=_DTYPE_NAMES.get(dtype_name, "float32"),
    )


def _read_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either transformers 5 "rope_parameters" or the older top-level keys."""
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or params
    scaling = dict(scaling)
    if "rope_type" not in scaling and "type" in scaling:  # old name of the key
        scaling["rope_type"] = scaling["type"]
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _read_eos_ids(model_dir: str, config: dict[str, Any]) -> list[int]:
    """EOS ids from config.json then generation_config.json (Llama 3 lists several there), deduplicated."""
    sources = [config.get("eos_token_id")]
    generation_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(generation_path):
        sources.append(read_json(generation_path).get("eos_token_id"))
    eos_ids: list[int] = []
    for source in sources:
        for token_id in source if isinstance(source, list) else [source]:
            if isinstance(token_id, int) and token_id not in eos_ids:
                eos_ids.append(token_id)
    return eos_ids

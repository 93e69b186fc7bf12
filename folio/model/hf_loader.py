"""Hugging Face model directories: config.json -> ModelSpec, *.safetensors (single or sharded) -> weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from folio.model.registry import get_model_class
from folio.model.spec import ModelSpec

_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}
_INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: str) -> dict[str, Any]:
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
    return _read_json(config_path)


def read_hf_spec(model_dir: str) -> ModelSpec:
    """ModelSpec from config.json (and generation_config.json's EOS ids if present); reads no weights."""
    config = read_hf_config(model_dir)
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError(f"{model_dir}/config.json: no 'architectures' entry")
    architecture = architectures[0]
    get_model_class(architecture)  # unknown architecture -> ValueError listing the supported ones
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
        sources.append(_read_json(generation_path).get("eos_token_id"))
    eos_ids: list[int] = []
    for source in sources:
        for token_id in source if isinstance(source, list) else [source]:
            if isinstance(token_id, int) and token_id not in eos_ids:
                eos_ids.append(token_id)
    return eos_ids


def find_safetensors_files(model_dir: str) -> list[str]:
    """The weight files: those named by model.safetensors.index.json if present, else every *.safetensors."""
    index_path = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map", {})
        files = sorted({os.path.join(model_dir, name) for name in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shards listed in {_INDEX_FILE} are missing: {missing}")
    else:
        files = sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weight files")
    return files


def iter_safetensors_weights(model_dir: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of every shard, one at a time (CPU, checkpoint dtype)."""
    files = find_safetensors_files(model_dir)
    handles = []
    for path in files:
        try:
            handles.append(safe_open(path, framework="pt", device="cpu"))
        except Exception as e:  # safetensors raises its own SafetensorError for bad headers
            raise ValueError(f"{path}: corrupt or truncated safetensors file ({e})") from None
    total = sum(len(list(h.keys())) for h in handles)
    with tqdm(
        total=total, desc=f"Loading {os.path.basename(model_dir.rstrip('/'))}", unit="tensor", disable=not show_progress
    ) as progress:
        for path, handle in zip(files, handles, strict=True):
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                try:
                    tensor = handle.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"{path}: cannot read tensor {name!r} ({e})") from None
                yield name, tensor
                progress.update(1)

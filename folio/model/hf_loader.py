"""Hugging Face model directories: *.safetensors (single or sharded) -> weights (config.json -> ModelSpec: hf_spec)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

from folio.model.hf_spec import read_json

_INDEX_FILE = "model.safetensors.index.json"


def find_safetensors_files(model_dir: str) -> list[str]:
    """The weight files: those named by model.safetensors.index.json if present, else every *.safetensors."""
    index_path = os.path.join(model_dir, _INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path).get("weight_map", {})
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

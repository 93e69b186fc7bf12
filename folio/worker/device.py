"""Which torch device and dtype a configuration names ("auto" resolved), for the worker and the processes that
start workers (the executors, the data-parallel client) without building one."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (the fast type without AMX), the checkpoint's type on CUDA (float32 -> bfloat16)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(checkpoint_dtype, torch.bfloat16) if checkpoint_dtype != "float32" else torch.bfloat16


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The K/V cache's element type for kv_cache_dtype ``name``: the model's ("auto", or the same type), else the
    named one. A float32 model over a bfloat16 cache runs on the CPU only for now: the CUDA path (Triton kernels,
    graphs) has not been checked with it, so it is refused there rather than guessed."""
    if name == "auto" or _DTYPES[name] == model_dtype:
        return model_dtype
    if device.type != "cpu":
        raise ValueError(
            f"kv_cache_dtype {name!r} under a {str(model_dtype).removeprefix('torch.')} model runs on the CPU only "
            f"for now, not on {device.type}: use kv_cache_dtype 'auto'"
        )
    return _DTYPES[name]

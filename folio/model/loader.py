"""Model loading entry points: a path (GGUF file or Hugging Face directory) -> spec, model, tokenizer.

A path that is a directory is a Hugging Face checkpoint (config.json + *.safetensors); a file is GGUF.
The model is built on the meta device (no memory, no random init), materialized empty on the target
device in the target dtype, then every parameter is filled from the checkpoint, one tensor at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch

from folio.attention.backends.base import AttentionBackend
from folio.attention.selector import get_attention_backend
from folio.kernels.cpu_kernels import CPU_KERNEL_DTYPES, CpuKernels, load_cpu_kernels
from folio.model.cpu_binding import prepare_for_cpu
from folio.model.gguf_dequant import NativeDequantizer
from folio.model.gguf_file import open_gguf
from folio.model.gguf_loader import iter_gguf_weights
from folio.model.gguf_spec import read_gguf_spec
from folio.model.hf_loader import iter_safetensors_weights
from folio.model.hf_spec import read_hf_spec
from folio.model.llama import LlamaForCausalLM
from folio.model.model_files import check_exists, default_model_path, load_tokenizer, read_model_spec
from folio.model.registry import get_model_class
from folio.model.spec import ModelSpec

__all__ = ["ModelSpec", "default_model_path", "load_model", "load_tokenizer", "read_model_spec"]


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend: AttentionBackend | None = None,
    show_progress: bool = True,
    enforce_eager: bool = False,
    cpu_kernels: CpuKernels | None = None,
    cpu_kv_prefetch_bytes: int | None = None,
    shard_model: Callable[[LlamaForCausalLM], None] | None = None,
    before_each_tensor: Callable[[], None] | None = None,
) -> tuple[LlamaForCausalLM, ModelSpec]:
    """Builds the model for ``path`` and fills its weights. attn_backend defaults to the one chosen for device.
    On the CPU, ``cpu_kernels`` (default: this CPU's best tier) says which kernels run: the weights are packed
    for the plan's GEMM and, unless enforce_eager, the decoder layers run fused (folio/model/cpu_binding.py).
    ``before_each_tensor`` runs before each checkpoint tensor is read (the worker's thread governor).

    Raises FileNotFoundError / ValueError naming the path for a missing or malformed checkpoint, an
    unsupported architecture, or missing tensors. ``shard_model`` (tensor parallelism) runs on the loaded weights,
    before the CPU packing.
    """
    check_exists(path)
    device = torch.device(device)
    if cpu_kernels is None and device.type == "cpu" and dtype in CPU_KERNEL_DTYPES:
        cpu_kernels = load_cpu_kernels(None, dtype)
    if os.path.isdir(path):
        spec = read_hf_spec(path)
        weights = iter_safetensors_weights(path, show_progress)
    else:
        gguf = open_gguf(path)
        spec = read_gguf_spec(gguf)
        lib = cpu_kernels.lib if cpu_kernels is not None else None
        weights = iter_gguf_weights(gguf, spec, show_progress, NativeDequantizer(lib) if lib is not None else None)
    if before_each_tensor is not None:
        weights = _calling_before_each(before_each_tensor, weights)
    model_class = get_model_class(spec.architecture)
    with torch.device("meta"):
        model = model_class(spec, attn_backend or get_attention_backend(device, dtype, cpu_kernels))
    _materialize_empty(model, dtype, device)
    try:
        model.load_weights(weights)
    except ValueError as e:  # errors from the weight readers already name the file
        raise ValueError(str(e) if path in str(e) else f"{path}: {e}") from None
    if shard_model is not None:
        shard_model(model)
    if cpu_kernels is not None and device.type == "cpu":
        prepare_for_cpu(model, cpu_kernels, enforce_eager, cpu_kv_prefetch_bytes)
    return model.eval(), spec


def _calling_before_each(
    hook: Callable[[], None], weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    while True:
        hook()
        item = next(weights, None)
        if item is None:
            return
        yield item


def _materialize_empty(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replaces every meta parameter with an uninitialized one on device; floating params take dtype.

    (Module.to_empty does the same but its first call imports torch._refs, about a second.)
    """
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            param_dtype = dtype if param.is_floating_point() else param.dtype
            empty = torch.empty(param.shape, dtype=param_dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=False))

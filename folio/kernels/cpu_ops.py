"""Python entry points of the fused CPU element-wise ops in ``cpu_ops.c``.

A ``CpuOps`` wraps one tier's library for one dtype; the layers in ``folio.model.layers`` get it from the
engine's ``CpuKernels`` (folio/kernels/cpu_kernels.py) where the plan chose it, and otherwise run their torch ops,
so CUDA and other dtypes are untouched. ``--cpu-isa generic`` runs the torch ops on the CPU too (to compare).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_SIGNATURES: dict[str, list[Any]] = {
    # x, x_stride, residual, weight, out, residual_out, rows, hidden, eps, threads
    "rms_norm": [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int],
    # gate_up, its row stride, out, rows, intermediate size, threads
    "silu_and_mul": [_ptr, _i64, _ptr, _i64, _i64, _int],
    # x, row stride, cos, sin, rows, heads, head_dim, threads
    "rotary": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _int],
    # key, key row stride, value, value row stride, key cache, value cache, slots, rows, block size,
    # block / head / position strides of the caches, KV heads, head_dim
    "write_kv": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64],
}
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}


class CpuOps:
    """The fused ops for one element type. Inputs must have a contiguous last dim; outputs are new tensors
    except where the name ends in ``_`` (in place)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self._fns = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, f"folio_{name}_{_SUFFIXES[dtype]}")
            fn.argtypes = argtypes
            fn.restype = None
            self._fns[name] = fn

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, H] -> (normed [T, H], None), or with a residual (normed(x + residual), x + residual)."""
        rows, hidden = x.shape
        out = torch.empty((rows, hidden), dtype=x.dtype)
        residual_out = None
        if residual is not None:
            residual = residual.contiguous()
            residual_out = torch.empty_like(out)
        self._fns["rms_norm"](
            x.data_ptr(),
            x.stride(0),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            None if residual_out is None else residual_out.data_ptr(),
            rows,
            hidden,
            eps,
            torch.get_num_threads(),
        )
        return out, residual_out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        self._fns["silu_and_mul"](
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, torch.get_num_threads()
        )
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [T, heads, D] (heads packed: stride(1) == D) in place; cos/sin [T, D] contiguous."""
        rows, heads, head_dim = x.shape
        self._fns["rotary"](
            x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), rows, heads, head_dim, torch.get_num_threads()
        )
        return x

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """key/value [T, KV, D] (heads packed) into kv_cache [2, NB, BS, KV, D] at slots [T] int64; the cache may be
        position-major (contiguous) or a head-major transposed view: only its last dim must be contiguous."""
        rows, num_kv_heads, head_dim = key.shape
        self._fns["write_kv"](
            key.data_ptr(),
            key.stride(0),
            value.data_ptr(),
            value.stride(0),
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            slots.data_ptr(),
            rows,
            kv_cache.shape[2],  # block size
            kv_cache.stride(1),  # block
            kv_cache.stride(3),  # KV head
            kv_cache.stride(2),  # position in the block
            num_kv_heads,
            head_dim,
        )


def heads_packed(x: torch.Tensor) -> bool:
    """x [T, heads, D] whose heads sit side by side in each row (a view of a fused projection's output is)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]

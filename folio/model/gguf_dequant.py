"""Dequantize GGUF tensors to float32 torch tensors.

Why our own fast paths: ``gguf.quants.dequantize`` is single-threaded numpy with several temporaries; the
common llama.cpp types (F32/F16/BF16, Q8_0, Q4_0, Q4_1) are a few multithreaded torch ops. The arithmetic is
the same as gguf's and ggml's (scale f16 -> f32, then ``d * q`` and ``+ m`` as separate float32 ops, no fused
multiply-add), so results are bit-identical; ``tests/model/test_gguf_dequant.py`` checks it. Every other type
(K-quants, IQ*) falls back to gguf's numpy implementation. Where Folio's CPU kernel library is loaded, Q4_0, Q4_1
and Q8_0 go through its one-pass loop instead (folio/kernels/gguf_dequant.c: the same bits, a third of the CPU time of
a model's load on one core), ``NativeDequantizer``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

_BLOCK = 32  # elements per block of Q4_0 / Q4_1 / Q8_0
# The kernel's kind argument (folio_dequantize_blocks) and its block bytes, per type it dequantizes.
_NATIVE_KINDS = {
    GGMLQuantizationType.Q4_0: (0, 18),
    GGMLQuantizationType.Q4_1: (1, 20),
    GGMLQuantizationType.Q8_0: (2, 34),
}


class NativeDequantizer:
    """folio_dequantize_blocks of a loaded CPU kernel library (any tier: the generic one too)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.folio_dequantize_blocks
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
        self._fn.restype = ctypes.c_int

    def __call__(self, raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The float32 tensor of ``shape``, or None for a type the kernel does not take."""
        if ggml_type not in _NATIVE_KINDS:
            return None
        kind, block_bytes = _NATIVE_KINDS[ggml_type]
        raw = np.ascontiguousarray(raw)
        if raw.nbytes % block_bytes:
            raise ValueError(f"{ggml_type.name} data of {raw.nbytes} bytes is not whole {block_bytes}-byte blocks")
        num_blocks = raw.nbytes // block_bytes
        out = torch.empty(num_blocks * _BLOCK, dtype=torch.float32)
        if self._fn(raw.ctypes.data, num_blocks, kind, out.data_ptr()) != 0:
            return None
        return out.reshape(shape)


def dequantize_to_float32(
    raw: np.ndarray,
    ggml_type: GGMLQuantizationType,
    shape: tuple[int, ...],
    native: NativeDequantizer | None = None,
) -> torch.Tensor:
    """raw: uint8 [rows, bytes per row] as stored in the file -> float32 tensor of ``shape``; through ``native``
    where given and it takes the type."""
    if native is not None and (out := native(raw, ggml_type, shape)) is not None:
        return out
    data = torch.from_numpy(raw)
    if ggml_type == GGMLQuantizationType.F32:
        out = data.view(torch.float32)
    elif ggml_type == GGMLQuantizationType.F16:
        out = data.view(torch.float16).float()
    elif ggml_type == GGMLQuantizationType.BF16:
        out = data.view(torch.bfloat16).float()
    elif ggml_type == GGMLQuantizationType.Q8_0:
        out = _dequantize_q8_0(data)
    elif ggml_type == GGMLQuantizationType.Q4_0:
        out = _dequantize_q4(data, has_min=False)
    elif ggml_type == GGMLQuantizationType.Q4_1:
        out = _dequantize_q4(data, has_min=True)
    else:
        out = torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, ggml_type), dtype=np.float32))
    return out.reshape(shape)


def _dequantize_q8_0(data: torch.Tensor) -> torch.Tensor:
    """Q8_0 block (34 bytes): d f16 | 32 x int8 q. Value = q * d."""
    blocks = data.reshape(-1, 34)
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # [n_blocks, 1]
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n_blocks, 32]
    return q * d


def _dequantize_q4(data: torch.Tensor, has_min: bool) -> torch.Tensor:
    """Q4_0 block (18 bytes): d f16 | 16 bytes of nibbles. Value = (q - 8) * d.
    Q4_1 block (20 bytes): d f16 | m f16 | 16 bytes of nibbles. Value = q * d + m.
    Byte j holds element j in its low nibble and element j + 16 in its high nibble.
    """
    header = 4 if has_min else 2
    blocks = data.reshape(-1, header + _BLOCK // 2)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n_blocks, 1]
    packed = blocks[:, header:]  # [n_blocks, 16]
    q = torch.cat([packed & 0x0F, packed >> 4], dim=1)  # [n_blocks, 32]: low nibbles then high nibbles
    # In place after the widening: one [n_blocks, 32] float32 tensor instead of three (the same two roundings).
    if not has_min:
        return (q.to(torch.int8) - 8).float().mul_(d)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return q.float().mul_(d).add_(m)

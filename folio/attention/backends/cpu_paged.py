"""CpuPagedBackend: paged attention on the CPU through a C kernel that reads K/V blocks in place.

The cache may hold float32 or bfloat16; the kernel computes in float32 either way.

Every query row whose context is (partly) in the cache — decodes, and prefill chunks after cached or earlier
tokens — goes to ``folio/kernels/paged_attention_cpu.c`` in one call per layer: no gather of the context into a
padded copy (the cost that dominated TorchBatchedBackend, see docs/performance.md). A fresh prefill, whose
context is exactly its own new K/V, runs through torch's scaled_dot_product_attention as before.
Tested against TorchReferenceBackend on random paged batches.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from folio.attention.backends.paged_cache import write_kv
from folio.attention.backends.torch_batched import prefill_attention
from folio.attention.metadata import AttnMetadata
from folio.kernels.cpu_build import load_kernel_library

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
# (q, out, k_cache, v_cache, block/head/position strides, block_table, its row stride, rows, row_req, row_ctx,
#  num_rows, num_heads, num_kv_heads, head_dim, block_size, scale, num_threads): see the C source.
_KERNEL_ARGTYPES: list[Any] = [_ptr] * 4 + [_i64] * 3 + [_ptr, _i64] + [_ptr] * 3 + [_i64] * 5 + [_f32, _int]


# K/V cache dtype -> the kernel's entry point for it
_ENTRY_POINTS = {torch.float32: "folio_paged_attention_f32", torch.bfloat16: "folio_paged_attention_bf16"}
SUPPORTED_KV_DTYPES = tuple(_ENTRY_POINTS)


def load_paged_attention_kernel() -> dict[torch.dtype, Any] | None:
    """The C entry points by K/V cache dtype, or None where no compiler is available (the selector then picks
    the torch backend)."""
    lib = load_kernel_library("paged_attention_cpu")
    if lib is None:
        return None
    kernels = {}
    for dtype, symbol in _ENTRY_POINTS.items():
        fn = getattr(lib, symbol)
        fn.argtypes = _KERNEL_ARGTYPES
        fn.restype = ctypes.c_int
        kernels[dtype] = fn
    return kernels


@dataclass
class _KernelRows:
    """The kernel's per-row index arrays for one step (built once, shared by every layer)."""

    rows: torch.Tensor  # [N] int64 query rows the kernel computes
    row_req: torch.Tensor  # [N] int32 request of each row (its block-table row)
    row_ctx: torch.Tensor  # [N] int32 visible positions of each row
    block_table: torch.Tensor  # [R, max_blocks] int32, contiguous
    fresh_prefills: list[int]  # requests whose whole context is this step's own tokens (SDPA)


class CpuPagedBackend:
    def __init__(self, kernels: dict[torch.dtype, Any]) -> None:
        self._kernels = kernels
        self._rows_for: AttnMetadata | None = None
        self._rows: _KernelRows | None = None

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttnMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Writes key/value at attn.slot_mapping, then causal attention of each query over its context."""
        kernel = self._kernels.get(kv_cache.dtype)
        if kernel is None or query.device.type != "cpu":
            raise ValueError(
                f"CpuPagedBackend needs a CPU K/V cache of {SUPPORTED_KV_DTYPES}, "
                f"got {kv_cache.dtype} on {query.device}"
            )
        write_kv(key, value, kv_cache, attn.slot_mapping)
        plan = self._kernel_rows(attn)
        query32 = query.float().contiguous()  # the kernel computes in float32 whatever the cache holds
        out = torch.empty_like(query32)
        num_rows = plan.rows.numel()
        if num_rows:
            _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
            status = kernel(
                query32.data_ptr(),
                out.data_ptr(),
                kv_cache[0].data_ptr(),
                kv_cache[1].data_ptr(),
                kv_cache.stride(1),  # block
                kv_cache.stride(3),  # KV head
                kv_cache.stride(2),  # position in the block
                plan.block_table.data_ptr(),
                plan.block_table.shape[1],
                plan.rows.data_ptr(),
                plan.row_req.data_ptr(),
                plan.row_ctx.data_ptr(),
                num_rows,
                query32.shape[1],
                num_kv_heads,
                head_dim,
                block_size,
                scale,
                torch.get_num_threads(),
            )
            if status != 0:
                raise MemoryError("paged attention kernel could not allocate its score buffers")
        for i in plan.fresh_prefills:
            start, end = attn.query_start_loc_cpu[i], attn.query_start_loc_cpu[i + 1]
            out[start:end] = prefill_attention(query[start:end], key[start:end], value[start:end], scale)
        return out.to(query.dtype)

    def _kernel_rows(self, attn: AttnMetadata) -> _KernelRows:
        if self._rows_for is attn and self._rows is not None:
            return self._rows
        rows: list[int] = []
        row_req: list[int] = []
        row_ctx: list[int] = []
        fresh: list[int] = []
        qsl, seq_lens = attn.query_start_loc_cpu, attn.seq_lens_cpu
        for i in range(attn.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            query_len = end - start
            if query_len > 1 and query_len == seq_len:
                fresh.append(i)
                continue
            # query rows start..end-1 sit at positions seq_len-query_len .. seq_len-1 and see one more each:
            # start 4, end 7, seq_len 9 -> rows [4, 5, 6], contexts [7, 8, 9]
            rows.extend(range(start, end))
            row_req.extend([i] * query_len)
            row_ctx.extend(range(seq_len - query_len + 1, seq_len + 1))
        self._rows = _KernelRows(
            rows=torch.tensor(rows, dtype=torch.int64),
            row_req=torch.tensor(row_req, dtype=torch.int32),
            row_ctx=torch.tensor(row_ctx, dtype=torch.int32),
            block_table=attn.block_table.to(device="cpu", dtype=torch.int32).contiguous(),
            fresh_prefills=fresh,
        )
        self._rows_for = attn
        return self._rows

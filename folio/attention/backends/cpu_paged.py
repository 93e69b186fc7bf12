"""CpuPagedBackend: paged attention on the CPU through C kernels that read K/V blocks in place.

The cache may hold float32 or bfloat16; the kernels compute in float32 either way, and read q (float32 or
bfloat16, rows strided as a view of the fused q|k|v output) in place.

``folio/kernels/paged_attention_cpu.c`` has two entry points, each called once per layer:
- single-token queries (decodes): one work item per row and KV head, the row's blocks walked twice (scores, V);
- multi-token queries (fresh prefills, prefill chunks after cached tokens): flash-style tiles of 16 rows that
  share each converted chunk of 16 K/V rows and keep an online softmax. This replaced torch's SDPA, which
  cost 0.5-0.7 ms per request-layer at W1's prompt lengths (docs/performance.md).
No gather of the context into a padded copy (the cost that dominated TorchBatchedBackend). Tested against
TorchReferenceBackend on random paged batches.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from folio.attention.backends.paged_cache import store_kv
from folio.attention.metadata import AttnMetadata
from folio.kernels.cpu_build import load_kernel_library
from folio.kernels.cpu_kernels import CpuKernels
from folio.kernels.cpu_ops import heads_packed
from folio.kernels.isa import IsaTier

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
# Both entry points start (q, q row stride, q is bf16, out, out is bf16, k_cache, v_cache, block/head/position
# strides, block_table, its row stride) and end (num_heads, num_kv_heads, head_dim, block_size, scale,
# num_threads); in between, decode takes (rows, row_req, row_ctx, num_rows) and prefill (seg_req, seg_row,
# seg_ctx, seg_len, num_segs). See the C source.
_COMMON_HEAD: list[Any] = [_ptr, _i64, _int, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64]
_COMMON_TAIL: list[Any] = [_i64] * 4 + [_f32, _int]
_ARGTYPES: dict[str, list[Any]] = {
    "paged": _COMMON_HEAD + [_ptr] * 3 + [_i64] + _COMMON_TAIL,
    "prefill": _COMMON_HEAD + [_ptr] * 4 + [_i64] + _COMMON_TAIL,
}
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
SUPPORTED_KV_DTYPES = tuple(_SUFFIXES)


@dataclass(frozen=True)
class PagedKernels:
    """The two C entry points for one K/V cache dtype."""

    decode: Any  # folio_paged_attention_<dtype>
    prefill: Any  # folio_prefill_attention_<dtype>


def load_paged_attention_kernel(tier: IsaTier | None = None) -> dict[torch.dtype, PagedKernels] | None:
    """The C entry points of the ``tier`` library (None: this CPU's best) by K/V cache dtype, or None where no
    compiler is available."""
    lib = load_kernel_library("cpu_kernels", tier)
    return None if lib is None else paged_kernels_of(lib)


def paged_kernels_of(lib: ctypes.CDLL) -> dict[torch.dtype, PagedKernels]:
    """The entry points of a loaded kernel library (benchmarks load other builds of it side by side)."""
    kernels = {}
    for dtype, suffix in _SUFFIXES.items():
        fns = []
        for kind in ("paged", "prefill"):
            fn = getattr(lib, f"folio_{kind}_attention_{suffix}")
            fn.argtypes = _ARGTYPES[kind]
            fn.restype = ctypes.c_int
            fns.append(fn)
        kernels[dtype] = PagedKernels(decode=fns[0], prefill=fns[1])
    return kernels


@dataclass
class StepPlan:
    """The kernels' index arrays for one step (built once, shared by every layer)."""

    block_table: torch.Tensor  # [R, max_blocks] int32, contiguous
    # single-token queries
    rows: torch.Tensor  # [N] int64 query rows
    row_req: torch.Tensor  # [N] int32 request of each row (its block-table row)
    row_ctx: torch.Tensor  # [N] int32 visible positions of each row
    # multi-token queries, one segment per request: rows seg_row .. seg_row + seg_len - 1
    seg_req: torch.Tensor  # [S] int32
    seg_row: torch.Tensor  # [S] int64 first query row
    seg_ctx: torch.Tensor  # [S] int32 visible positions of the first row (each next row sees one more)
    seg_len: torch.Tensor  # [S] int32


class CpuPagedBackend:
    # Head-major storage: the decode kernel then reads each KV head's positions of a block as one contiguous run
    # (W1 decode attention 23-25 -> 14-18 ms per step, docs/performance.md). Position-major caches work too.
    kv_cache_head_major = True

    def __init__(self, kernels: dict[torch.dtype, PagedKernels], cpu_kernels: CpuKernels | None = None) -> None:
        """kernels: the attention entry points; cpu_kernels: the K/V write's fused op where the plan chose it."""
        self._kernels = kernels
        self._cpu_kernels = cpu_kernels
        self._plan_for: AttnMetadata | None = None
        self._plan: StepPlan | None = None

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
        kernels = self._kernels.get(kv_cache.dtype)
        if kernels is None or query.device.type != "cpu":
            raise ValueError(
                f"CpuPagedBackend needs a CPU K/V cache of {SUPPORTED_KV_DTYPES}, "
                f"got {kv_cache.dtype} on {query.device}"
            )
        self._write_kv(key, value, kv_cache, attn.slot_mapping)
        plan = self.step_plan(attn)
        query_dtype = query.dtype
        if query.dtype not in SUPPORTED_KV_DTYPES or not heads_packed(query):
            query = query.float().contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)  # every row with a query is written by a kernel
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        head = [
            query.data_ptr(),
            query.stride(0),
            query.dtype == torch.bfloat16,
            out.data_ptr(),
            out.dtype == torch.bfloat16,
            kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(),
            kv_cache.stride(1),  # block
            kv_cache.stride(3),  # KV head
            kv_cache.stride(2),  # position in the block
            plan.block_table.data_ptr(),
            plan.block_table.shape[1],
        ]
        tail = [query.shape[1], num_kv_heads, head_dim, block_size, scale, torch.get_num_threads()]
        status = 0
        if plan.rows.numel():
            row_arrays = (plan.rows, plan.row_req, plan.row_ctx)
            status |= kernels.decode(*head, *(t.data_ptr() for t in row_arrays), plan.rows.numel(), *tail)
        if plan.seg_req.numel():
            seg_arrays = (plan.seg_req, plan.seg_row, plan.seg_ctx, plan.seg_len)
            status |= kernels.prefill(*head, *(t.data_ptr() for t in seg_arrays), plan.seg_req.numel(), *tail)
        if status != 0:
            raise MemoryError("paged attention kernel could not allocate its buffers")
        return out.to(query_dtype)

    def _write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """One C call for both caches when the layouts allow it, else the shared torch write."""
        ops = None if self._cpu_kernels is None else self._cpu_kernels.ops_for(key, value, kv_cache)
        if ops is not None and heads_packed(key) and heads_packed(value) and slots.dtype == torch.int64:
            ops.write_kv(key, value, kv_cache, slots.contiguous())
        else:
            store_kv(key, value, kv_cache, slots)

    def step_plan(self, attn: AttnMetadata) -> StepPlan:
        """The kernels' index arrays for a step; built on the first layer's call, reused by the others."""
        if self._plan_for is attn and self._plan is not None:
            return self._plan
        rows: list[int] = []
        row_req: list[int] = []
        row_ctx: list[int] = []
        segs: list[tuple[int, int, int, int]] = []  # (request, first row, first row's context, length)
        qsl, seq_lens = attn.query_start_loc_cpu, attn.seq_lens_cpu
        for i in range(attn.num_reqs):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            query_len = end - start
            # query rows start..end-1 sit at positions seq_len-query_len .. seq_len-1 and see one more each:
            # start 4, end 7, seq_len 9 -> rows [4, 5, 6], contexts [7, 8, 9]
            if query_len == 1:
                rows.append(start)
                row_req.append(i)
                row_ctx.append(seq_len)
            elif query_len > 1:
                segs.append((i, start, seq_len - query_len + 1, query_len))
        seg_cols = list(zip(*segs, strict=True)) if segs else [(), (), (), ()]
        self._plan = StepPlan(
            block_table=attn.block_table.to(device="cpu", dtype=torch.int32).contiguous(),
            rows=torch.tensor(rows, dtype=torch.int64),
            row_req=torch.tensor(row_req, dtype=torch.int32),
            row_ctx=torch.tensor(row_ctx, dtype=torch.int32),
            seg_req=torch.tensor(seg_cols[0], dtype=torch.int32),
            seg_row=torch.tensor(seg_cols[1], dtype=torch.int64),
            seg_ctx=torch.tensor(seg_cols[2], dtype=torch.int32),
            seg_len=torch.tensor(seg_cols[3], dtype=torch.int32),
        )
        self._plan_for = attn
        return self._plan

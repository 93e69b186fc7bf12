"""The fused CPU decoder: all decoder layers of a Llama-family model in one C call per step.

``folio/kernels/llama_cpu.c`` runs the same kernels as the layer-by-layer path (the packed GEMM, the fused
element-wise ops, the paged attention) inside one OpenMP region, with the same roundings, so its output is
bit-identical; what it removes is the per-op Python dispatch and thread fork/join, about 1 s of a 14 s W1 run
(docs/performance.md). It is to the CPU what CUDA-graph capture is to vLLM on a GPU, and ``enforce_eager``
turns it off the same way. The layer-by-layer model in folio/model/llama.py stays the reference and the path of
every other device and dtype.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from folio.attention.backends.cpu_paged import CpuPagedBackend
from folio.attention.metadata import AttnMetadata
from folio.kernels.cpu_gemm import PackedWeight
from folio.kernels.cpu_kernels import CpuKernels

if TYPE_CHECKING:
    from folio.model.llama import LlamaModel

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
# The entry points by (the model's dtype, the K/V cache's): each dtype over a cache of its own, and float32 over a
# bfloat16 cache (kv_cache_dtype="bfloat16"), whose writes round K/V to bfloat16 as the layer-by-layer path does.
_ENTRY_POINTS = {
    (torch.float32, torch.float32): "folio_llama_forward_f32",
    (torch.bfloat16, torch.bfloat16): "folio_llama_forward_bf16",
    (torch.float32, torch.bfloat16): "folio_llama_forward_f32_kvbf16",
}
# The phases llama_cpu.c times (its enum, in order) when phase timing is on.
PHASES = (
    "rms_norm",
    "qkv_proj",
    "rotary+kv_write",
    "decode_attention",
    "prefill_attention",
    "o_proj",
    "gate_up_proj",
    "silu_and_mul",
    "down_proj",
    "all_reduce",  # tensor parallelism: the row-parallel projections' sums over the ranks
)
_ALL_REDUCE_PROJ = ctypes.CFUNCTYPE(ctypes.c_int)


class _LayerParams(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _ptr),
        ("o", _ptr),
        ("gate_up", _ptr),
        ("down", _ptr),
        ("qkv_bias", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("codes4", _int),
    ]


class _ModelParams(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("layers", ctypes.POINTER(_LayerParams)),
        ("final_norm", _ptr),
        ("block_size", _i64),
        ("block_stride", _i64),
        ("head_stride", _i64),
        ("pos_stride", _i64),
        ("kv_prefetch_bytes", _i64),
        ("all_reduce_proj", _ALL_REDUCE_PROJ),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("num_tokens", _i64),
        ("hidden", _ptr),
        ("out", _ptr),
        ("cos", _ptr),
        ("sin", _ptr),
        ("slots", _ptr),
        ("block_table", _ptr),
        ("bt_stride", _i64),
        ("rows", _ptr),
        ("row_req", _ptr),
        ("row_ctx", _ptr),
        ("num_rows", _i64),
        ("seg_req", _ptr),
        ("seg_row", _ptr),
        ("seg_ctx", _ptr),
        ("seg_len", _ptr),
        ("num_segs", _i64),
        ("qkv", _ptr),
        ("attn_out", _ptr),
        ("proj", _ptr),
        ("gate_up", _ptr),
        ("act", _ptr),
        ("num_threads", _int),
        ("phase_seconds", _ptr),
        ("out_rows", _ptr),
        ("num_out_rows", _i64),
    ]


_CODES4_BITS = (1, 2, 4, 8)  # LlamaLayerParams.codes4: q|k|v, o, gate|up, down kept as 4-bit codes (llama_cpu.c)
_CODES4_AMX = 16  # ... and their GEMMs above a vector tile of rows on AMX (gemm_codes4_amx.h)
_CODES4_VNNI = 32  # ... or through vpdpbusd (gemm_codes4_vnni.h)


def _packed(module: Any) -> PackedWeight:
    packed = module.packed_weight
    assert isinstance(packed, PackedWeight)
    return packed


def _row_parallel_all_reduce(layers: list[Any]) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Tensor parallelism: the all-reduce the row-parallel o and down projections end with (each carries its rank
    group: folio/parallel/tensor_parallel.py RowParallelLinear), which the fused decoder then calls itself after
    its own GEMMs; None for a model on one rank."""
    groups = {
        id(g): g
        for layer in layers
        for m in (layer.self_attn.o_proj, layer.mlp.down_proj)
        if (g := getattr(m, "group", None)) is not None
    }
    if not groups:
        return None
    (group,) = groups.values()  # every layer reduces over the same ranks
    return group.all_reduce  # type: ignore[no-any-return]


class FusedCpuDecoder:
    """Runs ``LlamaModel``'s decoder layers and final norm for one step (``forward``); build with ``create``.
    Under tensor parallelism the C side calls back here after each row-parallel projection, to sum the step's
    ``proj`` buffer over the ranks with the group's all-reduce (the shared-memory one on the CPU)."""

    def __init__(self, model: LlamaModel, backend: CpuPagedBackend, lib: Any, kv_prefetch_bytes: int | None) -> None:
        self._backend = backend
        self._lib = lib
        self._fn: Any = None  # the entry point for the model's and the cache's dtypes, chosen when caches are bound
        self._keep: list[torch.Tensor] = []  # float32 bias copies the C side points at
        layers: list[Any] = list(model.layers)
        first = layers[0]
        attn = first.self_attn
        self._dtype: torch.dtype = first.input_layernorm.weight.dtype
        self._sizes = (int(attn.num_heads * attn.head_dim), int(attn.num_kv_heads * attn.head_dim))
        self._inter = _packed(first.mlp.gate_up_proj).n // 2
        mlp_rows = lib.folio_llama_mlp_rows
        mlp_rows.argtypes, mlp_rows.restype = [], ctypes.c_int64
        self.mlp_rows: int = mlp_rows()  # the MLP's rows at a time, and its scratch's rows (llama_cpu.c)
        self._hidden = _packed(attn.o_proj).n
        self._layers = (_LayerParams * len(layers))()
        for params, layer in zip(self._layers, layers, strict=True):
            params.input_norm = layer.input_layernorm.weight.data_ptr()
            params.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            params.qkv = _packed(layer.self_attn.qkv_proj).data.data_ptr()
            params.o = _packed(layer.self_attn.o_proj).data.data_ptr()
            params.gate_up = _packed(layer.mlp.gate_up_proj).data.data_ptr()
            params.down = _packed(layer.mlp.down_proj).data.data_ptr()
            projections = (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            params.codes4 = sum(bit for bit, m in zip(_CODES4_BITS, projections, strict=True) if _packed(m).codes4)
            if any(_packed(m).codes4_amx for m in projections):
                params.codes4 |= _CODES4_AMX
            if any(_packed(m).codes4_vnni for m in projections):
                params.codes4 |= _CODES4_VNNI
            bias = layer.self_attn.qkv_proj.bias
            if bias is not None:
                self._keep.append(bias.detach().float().contiguous())
                params.qkv_bias = self._keep[-1].data_ptr()
        self._params = _ModelParams(
            num_layers=len(layers),
            hidden=self._hidden,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate=self._inter,
            eps=first.input_layernorm.eps,
            scale=attn.scale,
            layers=self._layers,
            final_norm=model.norm.weight.data_ptr(),
            kv_prefetch_bytes=-1 if kv_prefetch_bytes is None else kv_prefetch_bytes,
        )
        self._all_reduce = _row_parallel_all_reduce(layers)
        self._proj: torch.Tensor | None = None  # the running step's proj buffer (what the callback sums)
        self._reduce_error: BaseException | None = None  # the callback's exception, raised after the C call
        if self._all_reduce is not None:
            self._callback = _ALL_REDUCE_PROJ(self._all_reduce_proj)  # kept: the C side holds its address
            self._params.all_reduce_proj = self._callback
        self._model = model  # the weights the pointers above refer to stay alive with it
        self._caches_bound: list[torch.Tensor] | None = None
        # while timing (set_phase_timing): one record per forward, (decode rows, prefill segments, seconds per phase)
        self.phase_records: list[tuple[int, int, list[float]]] | None = None
        self._phase_seconds = torch.zeros(len(PHASES), dtype=torch.float64)

    def _all_reduce_proj(self) -> int:
        """Called from the C forward (thread 0, between barriers): 0 once proj holds the sum over the ranks; 1 on an
        error (kept for forward to raise: an exception cannot cross the C frames)."""
        assert self._all_reduce is not None and self._proj is not None
        try:
            self._all_reduce(self._proj)
        except BaseException as error:  # noqa: BLE001 - re-raised by forward
            self._reduce_error = error
            return 1
        return 0

    @property
    def kv_prefetch_bytes(self) -> int:
        """The next layer's decode K/V the GEMMs prefetch: bytes, 0 for none, negative for half the L3 cache."""
        return int(self._params.kv_prefetch_bytes)

    def set_kv_prefetch_bytes(self, budget: int) -> None:
        """How much of the next layer's decode K/V the GEMMs of a layer prefetch (llama_cpu.c, SidePrefetch): a
        negative budget is half the L3 cache (the default; the engine argument cpu_kv_prefetch_bytes sets it at
        load), 0 is off.
        For A/B runs in one process (benchmarks/ab_offline.py)."""
        self._params.kv_prefetch_bytes = budget

    def set_phase_timing(self, on: bool) -> None:
        """Starts (with no records) or stops recording the wall time of each phase of every forward, as PHASES
        names them; for the latency benchmark's profile. Off, a step pays one NULL test per phase."""
        self.phase_records = [] if on else None

    @classmethod
    def create(
        cls, model: LlamaModel, kernels: CpuKernels, kv_prefetch_bytes: int | None = None
    ) -> FusedCpuDecoder | None:
        """The fused decoder for ``model``, or None where it does not apply (the plan did not choose it, not the
        CPU paged backend, weights not packed by Folio's GEMM, another dtype): the model then runs layer by
        layer. ``kv_prefetch_bytes``: see set_kv_prefetch_bytes (None: the plan's choice, half the L3 cache or
        none)."""
        backend = model.layers[0].self_attn.attn_backend
        dtype = model.norm.weight.dtype
        if kernels.plan.fused_decoder != "folio" or kernels.lib is None or dtype != kernels.dtype:
            return None
        if (
            not isinstance(backend, CpuPagedBackend)
            or (dtype, dtype) not in _ENTRY_POINTS
            or model.norm.weight.device.type != "cpu"
        ):
            return None
        linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)]
        linears += [m for layer in model.layers for m in (layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if not all(isinstance(m.packed_weight, PackedWeight) for m in linears):
            return None
        if kv_prefetch_bytes is None and kernels.plan.kv_side_prefetch == "off":
            kv_prefetch_bytes = 0
        return cls(model, backend, kernels.lib, kv_prefetch_bytes)

    def _bind_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Points every layer at its cache; the caches live as long as the engine, so this runs once."""
        cache_dtype = kv_caches[0].dtype
        name = _ENTRY_POINTS.get((self._dtype, cache_dtype))
        if name is None or any(cache.dtype != cache_dtype for cache in kv_caches):
            raise ValueError(
                f"fused CPU decoder: no entry point for a {self._dtype} model over a {cache_dtype} K/V cache"
            )
        self._fn = getattr(self._lib, name)
        self._fn.argtypes = [ctypes.POINTER(_ModelParams), ctypes.POINTER(_Step)]
        self._fn.restype = ctypes.c_int
        for params, cache in zip(self._layers, kv_caches, strict=True):
            params.k_cache, params.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
        first = kv_caches[0]  # [2, num_blocks, block_size, num_kv_heads, head_dim], maybe a head-major view
        self._params.block_size = first.shape[2]
        self._params.block_stride = first.stride(1)
        self._params.head_stride = first.stride(3)
        self._params.pos_stride = first.stride(2)
        self._caches_bound = list(kv_caches)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the embeddings (overwritten: the residual stream)
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        kv_caches: list[torch.Tensor],
        attn: AttnMetadata,
        output_rows: torch.Tensor | None = None,  # [R] int64: the rows the caller reads (None: all)
    ) -> torch.Tensor:  # [R, hidden] (or [T, hidden]), final norm applied
        """The decoder over a step's T rows; with ``output_rows`` the last layer runs past its attention only for
        those rows (llama_cpu.c LlamaStep.out_rows), which come back in the order asked."""
        bound = self._caches_bound
        if bound is None or len(bound) != len(kv_caches) or any(a is not b for a, b in zip(bound, kv_caches)):  # noqa: B905
            self._bind_caches(kv_caches)
        num_tokens = hidden.shape[0]
        plan = self._backend.step_plan(attn)
        slots = attn.slot_mapping if attn.slot_mapping.dtype == torch.int64 else attn.slot_mapping.long()
        slots = slots.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        hidden = hidden.contiguous()
        q_size, kv_size = self._sizes

        def scratch(width: int, rows: int = num_tokens) -> torch.Tensor:
            return torch.empty((rows, width), dtype=self._dtype)

        out, qkv, attn_out = scratch(self._hidden), scratch(q_size + 2 * kv_size), scratch(q_size)
        kept, order = _kept_rows(output_rows, num_tokens)
        mlp_rows = min(num_tokens, self.mlp_rows)
        proj, gate_up, act = scratch(self._hidden), scratch(2 * self._inter, mlp_rows), scratch(self._inter, mlp_rows)
        step = _Step(
            num_tokens=num_tokens,
            hidden=hidden.data_ptr(),
            out=out.data_ptr(),
            cos=cos.data_ptr(),
            sin=sin.data_ptr(),
            slots=slots.data_ptr(),
            block_table=plan.block_table.data_ptr(),
            bt_stride=plan.block_table.shape[1],
            rows=plan.rows.data_ptr(),
            row_req=plan.row_req.data_ptr(),
            row_ctx=plan.row_ctx.data_ptr(),
            num_rows=plan.rows.numel(),
            seg_req=plan.seg_req.data_ptr(),
            seg_row=plan.seg_row.data_ptr(),
            seg_ctx=plan.seg_ctx.data_ptr(),
            seg_len=plan.seg_len.data_ptr(),
            num_segs=plan.seg_req.numel(),
            qkv=qkv.data_ptr(),
            attn_out=attn_out.data_ptr(),
            proj=proj.data_ptr(),
            gate_up=gate_up.data_ptr(),
            act=act.data_ptr(),
            num_threads=torch.get_num_threads(),
            phase_seconds=None if self.phase_records is None else self._phase_seconds.zero_().data_ptr(),
            out_rows=None if kept is None else kept.data_ptr(),
            num_out_rows=num_tokens if kept is None else kept.numel(),
        )
        self._proj = proj
        status = self._fn(ctypes.byref(self._params), ctypes.byref(step))
        self._proj = None
        if status == -2:
            error, self._reduce_error = self._reduce_error, None
            assert error is not None
            raise error
        if status != 0:
            raise MemoryError("fused CPU decoder could not allocate its buffers")
        if self.phase_records is not None:
            self.phase_records.append((step.num_rows, step.num_segs, self._phase_seconds.tolist()))
        if order is not None:
            return out[order] if kept is None else out[: kept.numel()][order]
        return out


def _kept_rows(output_rows: torch.Tensor | None, num_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the distinct rows in ascending order, as the C side keeps them, or None where that is every row; the index
    of each asked row in what the forward then returns, or None for all rows in order)."""
    if output_rows is None:
        return None, None
    if output_rows.numel() >= num_tokens:  # a decode step: (about) every row, straight from the full output
        return None, output_rows
    kept, order = torch.unique(output_rows.to(torch.int64), sorted=True, return_inverse=True)
    return kept.contiguous(), order

"""Python entry points of Folio's CPU GEMM (``cpu_gemm.c``): pack a linear layer's weight once, then multiply.

A ``CpuGemm`` wraps one tier's library (folio/kernels/cpu_kernels.py); each packed weight keeps the ``CpuGemm``
that packed it, since the packed layout belongs to that library.
Packed weights of a whole model go into one arena backed by transparent huge pages where the kernel allows it
(folio.kernels.hugepages): a decode step of a few requests streams every weight from memory once, and with 4 KiB
pages the bandwidth it reached was 25-32 GB/s against 31-52 GB/s with 2 MiB pages (docs/performance.md).
A float32 weight whose every group of 32 k is exactly an offset plus 4-bit multiples of a step (a GGUF's Q4_1,
dequantized) can be packed as those codes instead (``gemm_codes4.h``): the same products and sums, so the same
bits out, from 6 bits a weight instead of 32. On the amx tier its GEMMs of more than a vector tile of rows can run
on AMX instead (``gemm_codes4_amx.h``, ``PackedWeight.codes4_amx``), in a library built with AVX512-VNNI and without
AMX through vpdpbusd (``gemm_codes4_vnni.h``, ``PackedWeight.codes4_vnni``): float32 accuracy, not the same bits.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import torch

from folio.kernels.hugepages import empty_hugepage_backed

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_SCREEN_NORM_ROWS = 4096  # rows widened to float64 at a time for the screen's norms
_ALIGN_BYTES = 256  # each packed weight starts on a 256-byte boundary of the arena (64 float32 elements)


def _bind(lib: ctypes.CDLL, name: str, argtypes: list[Any], restype: Any) -> Any:
    """The library's function ``name`` with its ctypes signature set."""
    function = getattr(lib, name)
    function.argtypes, function.restype = argtypes, restype
    return function


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: 2-D [T, k] with unit stride along k (a copy only where it is not already)."""
    return x if x.stride(-1) == 1 and x.dim() == 2 else x.reshape(-1, x.shape[-1]).contiguous()


def _abs_max_rounded_up(weight: torch.Tensor) -> float | None:
    """At least max |w| (the screens' bound), or None where some entry is not finite. One pass, no temporaries (an
    LM head is 100+ MB): min and max propagate NaN and are finite only where every entry is; the largest magnitude
    is then exact in float32."""
    lowest, highest = (float(v) for v in torch.aminmax(weight))
    if not (math.isfinite(lowest) and math.isfinite(highest)):
        return None
    return max(-lowest, highest) * (1 + 1e-6)


def _row_norms_rounded_up(weight: torch.Tensor, norm: Any) -> torch.Tensor:
    """norm(rows) (float64 per row, or per row and group) over a slice of rows at a time (the whole weight widened
    was 226 MB for SmolLM2's LM head), rounded up to float32 [n, ...]: the screens' bound must hold for the norms the
    kernel is given."""
    norms = torch.cat([norm(rows) for rows in weight.split(_SCREEN_NORM_ROWS)])
    return (norms * (1 + 1e-6)).float().contiguous()


def _try_codes(w: torch.Tensor, packed_bytes: Any, pack: Any) -> torch.Tensor | None:
    """``w`` [n, k] packed by one of the codes' packers (uint8), or None where it is not exactly such codes."""
    n, k = w.shape
    nbytes = int(packed_bytes(n, k))
    if nbytes < 0:
        return None
    w = w.contiguous()
    out = torch.empty(nbytes, dtype=torch.uint8)
    return out if pack(w.data_ptr(), k, n, k, out.data_ptr()) == 0 else None


@dataclass(frozen=True)
class PackedWeight:
    """A weight [n, k] in the kernel's blocked layout (cpu_gemm.c); only ``CpuGemm.linear`` reads ``data``."""

    data: torch.Tensor  # 1-D, the packed elements (a slice of an arena): uint8 bytes where ``codes4``
    n: int  # output features
    k: int  # input features
    gemm: CpuGemm  # the library that packed it, and so the one that multiplies it
    codes4: bool = False  # a float32 weight kept as its exact 4-bit codes (gemm_codes4.h)
    codes4_amx: bool = False  # ... whose GEMMs above one vector tile of rows run on AMX (gemm_codes4_amx.h)
    codes4_vnni: bool = False  # ... or through vpdpbusd (gemm_codes4_vnni.h)


@dataclass(frozen=True)
class ArgmaxScreen:
    """A float32 LM head's bfloat16 twin, for the greedy arg-max that screens in bfloat16 and rescores the few
    columns that could win in float32 (gemm_argmax_screen.h): the same token as the float32 arg-max, faster."""

    packed: PackedWeight  # the weight packed for bfloat16
    w_norm: torch.Tensor  # [n] float32, at least each row's L2 norm
    w_abs_max: float  # at least max |w|


@dataclass(frozen=True)
class Codes8Head:
    """A float32 LM head whose values are exactly 8-bit codes times a step per 32 inputs (a GGUF's Q8_0), kept as
    those codes for the greedy arg-max of a few rows (gemm_codes4.h): the float32 logits' token from 9 bits a
    weight."""

    data: torch.Tensor  # uint8, folio_gemm_pack_codes8's layout
    n: int
    k: int
    col_abs_sum: torch.Tensor  # [n] float32, at least each row's L1 norm (the int16 screen's bound)
    w_abs_max: float  # at least max |w|
    # where the library has the int8 screen (AVX512-VNNI, gemm_codes8_screen_vnni.h): the codes in its quads layout,
    # and [k / 32, blocks' columns] float32, at least each row's L1 norm over each group of 32 (zero past n)
    quads: torch.Tensor | None = None
    group_abs_sum: torch.Tensor | None = None


class CpuGemm:
    """The kernel's entry points for float32 and bfloat16."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._numel: dict[torch.dtype, Any] = {}
        self._pack: dict[torch.dtype, Any] = {}
        self._gemm: dict[torch.dtype, Any] = {}
        self._argmax: dict[torch.dtype, Any] = {}
        for dtype, suffix in _SUFFIXES.items():
            numel = getattr(lib, f"folio_gemm_packed_numel_{suffix}")
            numel.argtypes, numel.restype = [_i64, _i64], _i64
            pack = getattr(lib, f"folio_gemm_pack_{suffix}")
            # w, ldw, n, k, packed
            pack.argtypes, pack.restype = [_ptr, _i64, _i64, _i64, _ptr], None
            gemm = getattr(lib, f"folio_gemm_{suffix}")
            # x, lda, packed, bias, out, out_is_bf16, ldc, m, n, k, num_threads
            gemm.argtypes, gemm.restype = [_ptr, _i64, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64, _int], None
            argmax = getattr(lib, f"folio_gemm_argmax_{suffix}")
            # x, lda, packed, m, n, k, out_ids, num_threads
            argmax.argtypes, argmax.restype = [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _int], _int
            self._numel[dtype], self._pack[dtype], self._gemm[dtype] = numel, pack, gemm
            self._argmax[dtype] = argmax
        screened = lib.folio_gemm_argmax_screened_f32
        # x, lda, packed_f32, packed_bf16, w_norm, w_abs_max, m, n, k, out_ids, num_threads
        screened.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, ctypes.c_float, _i64, _i64, _i64, _ptr, _int]
        screened.restype = _int
        self._argmax_screened = screened
        # the codes' entry points (gemm_codes4.h): sizes, packing (0: exact codes), the GEMM and the LM head's arg-max
        self._codes4_bytes = _bind(lib, "folio_gemm_packed_bytes_codes4", [_i64, _i64], _i64)
        self._pack_codes4 = _bind(lib, "folio_gemm_pack_codes4", [_ptr, _i64, _i64, _i64, _ptr], _int)
        self._gemm_codes4 = _bind(lib, "folio_gemm_codes4", self._gemm[torch.float32].argtypes, None)
        self._gemm_codes4_amx = _bind(lib, "folio_gemm_codes4_amx", self._gemm[torch.float32].argtypes, None)
        self.codes4_has_amx = bool(_bind(lib, "folio_gemm_codes4_has_amx", [], _int)())
        self._gemm_codes4_vnni = _bind(lib, "folio_gemm_codes4_vnni", self._gemm[torch.float32].argtypes, None)
        self.codes4_has_vnni = bool(_bind(lib, "folio_gemm_codes4_has_vnni", [], _int)())
        self._codes8_bytes = _bind(lib, "folio_gemm_packed_bytes_codes8", [_i64, _i64], _i64)
        self._pack_codes8 = _bind(lib, "folio_gemm_pack_codes8", [_ptr, _i64, _i64, _i64, _ptr], _int)
        # x, lda, packed, m, n, k, widened, out_ids, num_threads
        self._argmax_codes8 = _bind(
            lib, "folio_gemm_argmax_codes8", [_ptr, _i64, _ptr, _i64, _i64, _i64, _int, _ptr, _int], _int
        )
        # x, lda, packed, col_abs_sum, w_abs_max, m, n, k, out_ids, num_threads
        self._argmax_codes8_screened = _bind(
            lib,
            "folio_gemm_argmax_codes8_screened",
            [_ptr, _i64, _ptr, _ptr, ctypes.c_float, _i64, _i64, _i64, _ptr, _int],
            _int,
        )
        # the int8 screen (gemm_codes8_screen_vnni.h): x, lda, packed, quads, packed_f32, col_abs_sum, group_abs_sum,
        # w_abs_max, m, n, k, out_ids, num_threads
        self.codes8_has_i8_screen = bool(_bind(lib, "folio_gemm_codes8_has_i8_screen", [], _int)())
        self._pack_codes8_quads = _bind(lib, "folio_gemm_pack_codes8_quads", [_ptr, _i64, _i64, _ptr], None)
        self._argmax_codes8_screened_i8 = _bind(
            lib,
            "folio_gemm_argmax_codes8_screened_i8",
            [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_float, _i64, _i64, _i64, _ptr, _int],
            _int,
        )
        self._block_n = int(_bind(lib, "folio_gemm_block_n", [], _int)())

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """A 2-D CPU float32 / bfloat16 weight (bfloat16 with an even K: the kernel reads x in pairs of k)."""
        return (
            weight.dim() == 2
            and weight.device.type == "cpu"
            and weight.dtype in _SUFFIXES
            and (weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0)
        )

    def pack_all(
        self,
        weights: list[torch.Tensor],
        huge_pages: bool = True,
        compact: list[bool] | None = None,
        amx_float32: bool = False,
        vnni_float32: bool = False,
    ) -> list[PackedWeight]:
        """Packs every weight [n, k] (one dtype) into one arena, backed by huge pages where ``huge_pages``. A
        float32 weight whose ``compact`` entry is True is kept as 4-bit codes where it is exactly such codes
        (``PackedWeight.codes4``), else packed as float32 like the others. With ``amx_float32``, on a library
        with AMX, the codes' GEMMs of more rows than a vector tile run on AMX (``PackedWeight.codes4_amx``); with
        ``vnni_float32``, on a library with VNNI (and no AMX), through vpdpbusd (``PackedWeight.codes4_vnni``)."""
        if not weights:
            return []
        dtype = weights[0].dtype
        compact = compact or [False] * len(weights)
        codes: list[torch.Tensor | None] = []  # each weight's codes, packed on the side, where they are exact
        offsets, total = [], 0
        for w, may_compact in zip(weights, compact, strict=True):
            if w.dtype != dtype or not self.supports(w):
                raise ValueError(f"cannot pack a {w.dtype} weight of shape {tuple(w.shape)} with {dtype} weights")
            codes.append(self._try_codes4(w) if may_compact and dtype == torch.float32 else None)
            offsets.append(total)
            total += -(-self._packed_bytes(w, codes[-1]) // _ALIGN_BYTES) * _ALIGN_BYTES
        arena = empty_hugepage_backed(total, torch.uint8, huge_pages)
        amx_on = amx_float32 and self.codes4_has_amx
        vnni_on = vnni_float32 and self.codes4_has_vnni
        packed = []
        for w, w_codes, offset in zip(weights, codes, offsets, strict=True):
            n, k = w.shape
            data = arena[offset : offset + self._packed_bytes(w, w_codes)]
            if w_codes is not None:
                data.copy_(w_codes)
                packed.append(PackedWeight(data, n, k, self, codes4=True, codes4_amx=amx_on, codes4_vnni=vnni_on))
                continue
            data = data.view(dtype)
            w = w.contiguous()
            self._pack[dtype](w.data_ptr(), k, n, k, data.data_ptr())
            packed.append(PackedWeight(data, n, k, self))
        return packed

    def _packed_bytes(self, w: torch.Tensor, codes: torch.Tensor | None) -> int:
        if codes is not None:
            return codes.numel()
        return int(self._numel[w.dtype](w.shape[0], w.shape[1])) * w.dtype.itemsize

    def _try_codes4(self, w: torch.Tensor) -> torch.Tensor | None:
        """``w``'s codes (uint8, gemm_codes4.h's layout), or None where some group is not exactly 4-bit codes."""
        return _try_codes(w, self._codes4_bytes, self._pack_codes4)

    def linear(
        self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x [T, k] -> x @ W.T (+ bias) [T, n] in out_dtype (default x's; float32 or bfloat16), float32 sums."""
        x = _as_rows(x)
        out_dtype = out_dtype or x.dtype
        out = torch.empty((x.shape[0], weight.n), dtype=out_dtype)
        bias32 = None if bias is None else bias.float().contiguous()
        if weight.codes4 and x.dtype != torch.float32:
            raise ValueError(f"a weight kept as 4-bit codes multiplies float32 activations, not {x.dtype}")
        if weight.codes4:
            gemm = self._gemm_codes4_amx if weight.codes4_amx else self._gemm_codes4
            gemm = self._gemm_codes4_vnni if weight.codes4_vnni else gemm
        else:
            gemm = self._gemm[x.dtype]
        gemm(
            x.data_ptr(),
            x.stride(0),
            weight.data.data_ptr(),
            None if bias32 is None else bias32.data_ptr(),
            out.data_ptr(),
            int(out_dtype == torch.bfloat16),
            weight.n,
            x.shape[0],
            weight.n,
            weight.k,
            torch.get_num_threads(),
        )
        return out

    def argmax(self, x: torch.Tensor, weight: PackedWeight, screen: ArgmaxScreen | None = None) -> torch.Tensor | None:
        """x [T, k] -> [T] int64, the column of each row's largest entry of x @ W.T (the first of equals), without
        writing the [T, n] product; None for T > 256 or a weight kept as codes (the caller computes the product
        instead). With a ``screen`` (float32 x), the same answer through the bfloat16 screen."""
        if weight.codes4:
            return None
        if screen is not None and x.dtype == torch.float32:
            out, status = self.screened_argmax(x, weight, screen)
            if status != -2:
                return out
        x = _as_rows(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        status = self._argmax[x.dtype](
            x.data_ptr(),
            x.stride(0),
            weight.data.data_ptr(),
            x.shape[0],
            weight.n,
            weight.k,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out if status == 0 else None

    def pack_codes8(self, weight: torch.Tensor, with_quads: bool = True) -> Codes8Head | None:
        """``weight`` [n, k] float32 as 8-bit codes, or None where some group of 32 is not exactly such codes; with
        ``with_quads``, also the int8 screen's layout and bounds where this library has that screen."""
        if weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        data = _try_codes(weight, self._codes8_bytes, self._pack_codes8)
        if data is None:
            return None
        w_abs_max = _abs_max_rounded_up(weight)
        assert w_abs_max is not None  # exact codes are finite
        col_abs_sum = _row_norms_rounded_up(weight, lambda rows: rows.abs().sum(dim=1, dtype=torch.float64))
        n, k = weight.shape
        if not (with_quads and self.codes8_has_i8_screen):
            return Codes8Head(data, n, k, col_abs_sum, w_abs_max)
        quads = torch.empty_like(data)
        self._pack_codes8_quads(data.data_ptr(), n, k, quads.data_ptr())
        n_pad = -(-n // self._block_n) * self._block_n
        group_abs_sum = torch.zeros(k // 32, n_pad, dtype=torch.float32)
        group_abs_sum[:, :n] = _row_norms_rounded_up(
            weight, lambda rows: rows.abs().view(-1, k // 32, 32).sum(dim=2, dtype=torch.float64)
        ).T
        return Codes8Head(data, n, k, col_abs_sum, w_abs_max, quads, group_abs_sum)

    def argmax_codes8(self, x: torch.Tensor, head: Codes8Head, widened: bool = True) -> torch.Tensor | None:
        """``argmax`` of float32 x [T, k] over the head's codes (the float32 logits' token, the first of equals);
        None where the kernel does not run (the generic tier; more than 256 rows, or with ``widened`` False more
        than one row tile: blocks widened once for several tiles are then left to a faster path)."""
        if x.dtype != torch.float32:
            return None
        x = _as_rows(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        status = self._argmax_codes8(
            x.data_ptr(), x.stride(0), head.data.data_ptr(), x.shape[0], head.n, head.k, int(widened),
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out if status == 0 else None

    def argmax_codes8_screened(
        self, x: torch.Tensor, head: Codes8Head, plain: PackedWeight | None = None
    ) -> tuple[torch.Tensor | None, int]:
        """``argmax_codes8`` of float32 x [T, k] through the int8 screen where the head has its layout
        (gemm_codes8_screen_vnni.h: AVX512-VNNI without AMX), else the int16 one (gemm_codes8_screen.h: AVX2): the
        same token; also the kernel's status: 0 screened, 1 the exact path taken instead (non-finite, huge or tiny
        rows, too many candidates), -1 not run (T > 256; the int8 screen also T <= 8, one row tile, where
        ``argmax_codes8`` is faster), -2 not in this library. ``plain``: the same weight in the float32 layout,
        which the int8 screen's rescore then reads instead of widening the codes' blocks."""
        if x.dtype != torch.float32:
            return None, -1
        x = _as_rows(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if head.quads is not None and head.group_abs_sum is not None:  # the int8 screen, where the library has it
            float32_layout = plain is not None and not plain.codes4 and plain.data.dtype == torch.float32
            status = int(
                self._argmax_codes8_screened_i8(
                    x.data_ptr(), x.stride(0), head.data.data_ptr(), head.quads.data_ptr(),
                    plain.data.data_ptr() if plain is not None and float32_layout else None,
                    head.col_abs_sum.data_ptr(), head.group_abs_sum.data_ptr(), head.w_abs_max, x.shape[0], head.n,
                    head.k, out.data_ptr(), torch.get_num_threads(),
                )
            )  # fmt: skip
            return (out if status in (0, 1) else None), status
        status = int(
            self._argmax_codes8_screened(
                x.data_ptr(), x.stride(0), head.data.data_ptr(), head.col_abs_sum.data_ptr(), head.w_abs_max,
                x.shape[0], head.n, head.k, out.data_ptr(), torch.get_num_threads(),
            )
        )  # fmt: skip
        return (out if status in (0, 1) else None), status

    def build_screen(self, weight: torch.Tensor, huge_pages: bool = True) -> ArgmaxScreen | None:
        """The bfloat16 screen of a float32 weight [n, k] for ``argmax`` (packed as ``pack_all`` packs); None
        where it cannot apply (not float32, an odd k, or a weight that is not finite)."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % 2 or weight.numel() == 0:
            return None
        w_abs_max = _abs_max_rounded_up(weight)
        if w_abs_max is None:
            return None
        w_norm = _row_norms_rounded_up(weight, lambda rows: torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64))
        (packed,) = self.pack_all([weight.to(torch.bfloat16)], huge_pages)
        return ArgmaxScreen(packed, w_norm, w_abs_max)

    def screened_argmax(
        self, x: torch.Tensor, weight: PackedWeight, screen: ArgmaxScreen
    ) -> tuple[torch.Tensor | None, int]:
        """``argmax`` of float32 x through the screen; also the kernel's status: 0 screened, 1 the exact path
        taken instead (non-finite or huge x, too many candidates), -1 not run (T > 256), -2 not in this library
        (no vdpbf16ps)."""
        x = _as_rows(x)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        status = int(
            self._argmax_screened(
                x.data_ptr(),
                x.stride(0),
                weight.data.data_ptr(),
                screen.packed.data.data_ptr(),
                screen.w_norm.data_ptr(),
                screen.w_abs_max,
                x.shape[0],
                weight.n,
                weight.k,
                out.data_ptr(),
                torch.get_num_threads(),
            )
        )
        return (out if status in (0, 1) else None), status

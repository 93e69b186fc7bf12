"""Folio's CPU GEMM, built for each ISA tier, against oneDNN's packed linear at the default model's shapes.

    .venv/bin/python benchmarks/cpu_gemm.py                                   # every tier this CPU runs
    .venv/bin/python benchmarks/cpu_gemm.py --tiers avx2 --dtypes float32 --rows 1,64
    .venv/bin/python benchmarks/cpu_gemm.py --onednn-max-isa AVX2             # oneDNN limited to AVX2 too
    .venv/bin/python benchmarks/cpu_gemm.py --dtypes float32,codes4 --rows 1,8,64
    .venv/bin/python benchmarks/cpu_gemm.py --dtypes float32,codes4,codes4_amx --tiers amx --rows 16,64,256,2048
    .venv/bin/python benchmarks/cpu_gemm.py --dtypes codes4,codes4_vnni --rows 64,2048 --no-onednn
    .venv/bin/python benchmarks/cpu_gemm.py --dtypes codes4,codes4_vnni --tiers avx2+avx_vnni --no-onednn

``codes4``: float32 weights that are exactly what a GGUF's Q4_1 tensors dequantize to (gguf's quantizer on random
weights, then Folio's dequantizer), which Folio's GEMM keeps as their 4-bit codes (folio/kernels/gemm_codes4.h,
the engine's cpu_compact_weights) and oneDNN multiplies in float32: the same products (Folio's bits equal its
float32 layout's), from a sixth of the weight bytes. ``codes4_amx``: the same weights with the engine's
cpu_amx_float32 (folio/kernels/gemm_codes4_amx.h): more rows than one vector tile on the amx tier's AMX tiles, x
split into three exact bfloat16 parts (float32 accuracy, not the float32 layout's bits); other tiers as codes4.
``codes4_vnni``: the same with cpu_vnni_float32 (folio/kernels/gemm_codes4_vnni.h): more rows than one vector tile
through vpdpbusd where the tier's library has AVX512-VNNI (this CPU's own AVX-512 tier: -march=native); as codes4
elsewhere.

The projections of SmolLM2-135M (q|k|v, gate|up, down; o and the tied LM head with --shapes) at several row
counts M (1-4: decode of a few requests, 64: W1's decode batch, 256-2048: prefill chunks). For M <= 64 thirty
copies of each weight are cycled through, as a decode step walks 30 layers, so the weights come from memory as
they do in the engine; larger M is compute-bound and cycles through two. Each tier's library is Folio's GEMM
body for that tier (tested on every tier, whether or not the engine's plan chooses it there); oneDNN is measured
in the same run, with whatever ISA it picks (``--onednn-max-isa`` caps it through ONEDNN_MAX_CPU_ISA, which
oneDNN reads on its first use). Prints GFLOP/s of the fastest call (`--median`: the median one); nothing is asserted.
Where codes4 and codes4_amx / codes4_vnni both ran, a last table gives each unit's rate over the FMA tiles' on the
same tier, row count and shape: a unit path exists only to beat them (session 50 found the VNNI entry point at
0.6x after a change that only the fused decoder's A/B had timed).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from folio.kernels.cpu_build import load_cpu_isa_library, native_tier
from folio.kernels.cpu_gemm import CpuGemm
from folio.kernels.isa import IsaTier, cpu_info
from folio.model.gguf_dequant import dequantize_to_float32

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def call_seconds(
    runners: list[list[Callable[[], None]]],
    rounds: int,
    clock: Callable[[], float] = time.perf_counter,
    statistic: Callable[[list[float]], float] = min,
) -> list[float]:
    """Each implementation's single call by ``statistic`` of its timed calls (default: the fastest): ``rounds``
    rounds, each calling every implementation on every weight copy in turn (after one warm-up round). Calls are
    timed one by one, so that on a shared machine a call interrupted by another process does not count and every
    implementation gets the same chances at a quiet moment; the weights still cycle through all copies, so they
    come from memory."""
    times: list[list[float]] = [[] for _ in runners]
    for r in range(rounds + 1):
        for i, calls in enumerate(runners):
            for call in calls:
                start = clock()
                call()
                if r > 0:
                    times[i].append(clock() - start)
    return [statistic(t) for t in times]


def folio_calls(
    gemm: CpuGemm, weights: list[torch.Tensor], x: torch.Tensor, codes: bool = False, dot: str = ""
) -> list[Callable[[], None]]:
    """One call per weight; ``dot`` "amx" or "vnni": the codes' GEMMs on that unit where the library has it."""
    packed = gemm.pack_all(
        weights, compact=[codes] * len(weights), amx_float32=dot == "amx", vnni_float32=dot == "vnni"
    )
    if codes and not all(p.codes4 for p in packed):
        raise SystemExit("codes4: a weight was not kept as codes")
    return [functools.partial(gemm.linear, x, p, None) for p in packed]


def q4_1_weight(n: int, k: int) -> torch.Tensor:
    """A random float32 [n, k] weight as a GGUF's Q4_1 tensor dequantizes (exactly 4-bit codes per 32 inputs)."""
    raw = quantize(torch.randn(n, k).numpy(), GGMLQuantizationType.Q4_1)
    return dequantize_to_float32(raw, GGMLQuantizationType.Q4_1, (n, k)).contiguous()


def onednn_calls(weights: list[torch.Tensor], x: torch.Tensor) -> list[Callable[[], None]] | None:
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
        torch.ops.mkldnn._linear_pointwise(x, packed[0], None, "none", [], "")
    except RuntimeError:  # e.g. bfloat16 below AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: oneDNN refuses
        return None
    return [functools.partial(torch.ops.mkldnn._linear_pointwise, x, p, None, "none", [], "") for p in packed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="comma-separated: float32, bfloat16, codes4, codes4_amx, codes4_vnni",
    )
    parser.add_argument(
        "--tiers",
        default="",
        help="comma-separated --cpu-isa tiers (default: avx2 up to this CPU's); a tier may name extensions this CPU "
        "has after '+' (avx2+avx_vnni: the avx2 library with AVX-VNNI, as Intel's client cores build it natively)",
    )
    parser.add_argument("--rows", default="1,4,16,64,256,2048", help="comma-separated M values")
    parser.add_argument("--shapes", default="qkv,gate_up,down", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--onednn-max-isa", default="", help="sets ONEDNN_MAX_CPU_ISA (e.g. AVX2, AVX512_CORE)")
    parser.add_argument("--no-onednn", action="store_true", help="Folio's GEMM only")
    parser.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (default: torch's)")
    parser.add_argument(
        "--cpu-time", action="store_true", help="with --threads 1: time calls by the thread's CPU time, not the wall"
    )
    parser.add_argument("--rounds", type=int, default=7, help="timed calls of each implementation (rounds)")
    parser.add_argument(
        "--median",
        action="store_true",
        help="the median call instead of the fastest: where the machine's speed swings from call to call, the "
        "fastest hides how often an implementation runs slow (a Zen 3 VM, docs/performance.md session 40)",
    )
    ns = parser.parse_args()
    if ns.onednn_max_isa:
        os.environ["ONEDNN_MAX_CPU_ISA"] = ns.onednn_max_isa  # before oneDNN's first primitive reads it
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.cpu_time and torch.get_num_threads() != 1:
        raise SystemExit("--cpu-time needs --threads 1: the calling thread must do all the work")
    # One thread's CPU time leaves out the time other processes held its core: steady figures on a shared machine.
    clock = time.thread_time if ns.cpu_time else time.perf_counter
    native = native_tier()
    names = ns.tiers.split(",") if ns.tiers else [t.flag_name for t in IsaTier if IsaTier.AVX2 <= t <= native]
    gemms = {}
    for name in names:
        lib = load_cpu_isa_library(name)
        if lib is None:
            raise SystemExit("no C compiler: the kernels are not built")
        gemms[name] = CpuGemm(lib)
    onednn_isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "its best")
    threads = torch.get_num_threads()
    timing = "CPU time" if ns.cpu_time else "wall time"
    print(f"CPU {cpu_info()[0]} (best tier {native.flag_name}), {threads} threads, {timing}; oneDNN ISA: {onednn_isa}")
    print("GFLOP/s per shape: " + " / ".join([*names, "onednn"]))
    torch.manual_seed(0)
    rates: dict[tuple[str, int, str], list[float]] = {}  # (dtype, M, shape) -> Folio's GFLOP/s per tier
    for dtype_name in ns.dtypes.split(","):
        codes = dtype_name.startswith("codes4")
        dot = dtype_name.removeprefix("codes4").removeprefix("_")
        dtype = torch.float32 if codes else getattr(torch, dtype_name)
        for m in (int(v) for v in ns.rows.split(",")):
            cells = []
            for shape in ns.shapes.split(","):
                n, k = SHAPES[shape]
                copies = 1 if shape == "lm_head" else (30 if m <= 64 else 2)
                if codes:  # one quantized weight, copied: the copies still come from memory one by one
                    first = q4_1_weight(n, k)
                    weights = [first.clone() for _ in range(copies)]
                else:
                    weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
                x = torch.randn(m, k).to(dtype)
                flops = 2 * m * n * k  # one call
                runners = [folio_calls(gemm, weights, x, codes, dot) for gemm in gemms.values()]
                onednn = None if ns.no_onednn else onednn_calls(weights, x)
                implementations = [*runners, *([onednn] if onednn is not None else [])]
                seconds = call_seconds(implementations, ns.rounds, clock, statistics.median if ns.median else min)
                rates[dtype_name, m, shape] = [flops / t / 1e9 for t in seconds[: len(runners)]]
                figures = [f"{flops / t / 1e9:4.0f}" for t in seconds] + (["   -"] if onednn is None else [])
                text = " / ".join(figures)
                cells.append(f"{shape} {text}")
            print(f"{dtype_name:8s} M={m:5d}  " + "   ".join(cells), flush=True)
    print_unit_ratios(rates, names)


def print_unit_ratios(rates: dict[tuple[str, int, str], list[float]], tiers: list[str]) -> None:
    """Each dot-product unit's GFLOP/s over the FMA tiles' (codes4) for the same tier, M and shape."""
    units = sorted({d for d, _, _ in rates if d in ("codes4_amx", "codes4_vnni")})
    if "codes4" not in {d for d, _, _ in rates} or not units:
        return
    print("unit / FMA tiles (codes4), per tier: " + " / ".join(tiers))
    for unit in units:
        for (dtype, m, shape), unit_rates in rates.items():
            if dtype != unit or ("codes4", m, shape) not in rates:
                continue
            ratios = [u / f for u, f in zip(unit_rates, rates["codes4", m, shape], strict=True)]
            print(f"{unit:12s} M={m:5d}  {shape:8s} " + " / ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()

"""The greedy LM head's arg-max paths side by side, at SmolLM2's head (49152 x 576) and decode row counts.

    .venv/bin/python benchmarks/lm_head_argmax.py                         # every tier from avx2 up to this CPU's
    .venv/bin/python benchmarks/lm_head_argmax.py --rows 8,64 --rounds 41 --tiers avx2

The weight is what a GGUF's Q8_0 tensor dequantizes to (gguf's quantizer on random weights, then Folio's loader),
as SmolLM2's tied embedding is. Per tier and row count, the same x through:
  float32   folio_gemm_argmax_f32 over the float32 layout (the path every tier has; the peer of the others)
  codes8    folio_gemm_argmax_codes8 over the 8-bit codes (one row tile widened in registers, more rows over
            blocks widened once), the engine's choice where the plan has no bfloat16 screen
  int16     the 8-bit codes screened in int16 with a float32 rescore (AVX2 libraries only)
  int8      the 8-bit codes screened in int8 (x per group of 32) with a float32 rescore (AVX512-VNNI, no AMX)
  screen    the bfloat16 screen with a float32 rescore (libraries with vdpbf16ps only)
Rounds interleave the paths (a call of each in turn, the order flipped every round) and the median call is shown,
with each path's median ratio to float32 over the rounds: on a VM whose speed swings from minute to minute a
ratio within a round is steadier than either figure. Every path's tokens are checked against float32's.
"""

from __future__ import annotations

import argparse
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

VOCAB, HIDDEN = 49152, 576


def q8_0_weight(n: int, k: int) -> torch.Tensor:
    raw = quantize(torch.randn(n, k).numpy(), GGMLQuantizationType.Q8_0)
    return dequantize_to_float32(raw, GGMLQuantizationType.Q8_0, (n, k)).contiguous()


def paths(gemm: CpuGemm, w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor | None]]:
    [plain] = gemm.pack_all([w])
    head = gemm.pack_codes8(w)
    if head is None:
        raise SystemExit("the Q8_0 weight was not kept as codes")
    found: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {
        "float32": lambda x: gemm.argmax(x, plain),
        "codes8": lambda x: gemm.argmax_codes8(x, head),
    }
    if gemm.argmax_codes8_screened(torch.randn(1, w.shape[1]), head)[1] != -2:
        found["int8" if head.quads is not None else "int16"] = lambda x: gemm.argmax_codes8_screened(x, head)[0]
    screen = gemm.build_screen(w)
    if screen is not None and gemm.screened_argmax(torch.randn(1, w.shape[1]), plain, screen)[1] != -2:
        found["screen"] = lambda x: gemm.screened_argmax(x, plain, screen)[0]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tiers",
        default="",
        help="comma-separated --cpu-isa tiers (default: avx2 up to this CPU's), avx2+avx_vnni among them",
    )
    parser.add_argument("--rows", default="1,8,16,32,64", help="comma-separated M values (at most 256)")
    parser.add_argument("--rounds", type=int, default=21, help="timed calls of each path")
    ns = parser.parse_args()
    native = native_tier()
    names = ns.tiers.split(",") if ns.tiers else [t.flag_name for t in IsaTier if IsaTier.AVX2 <= t <= native]
    torch.manual_seed(0)
    w = q8_0_weight(VOCAB, HIDDEN)
    print(f"CPU {cpu_info()[0]} (best tier {native.flag_name}), {torch.get_num_threads()} threads; LM head {VOCAB} x "
          f"{HIDDEN} (Q8_0 values); GFLOP/s of the median call, and the median per-round ratio to float32")  # fmt: skip
    for name in names:
        lib = load_cpu_isa_library(name)
        if lib is None:
            raise SystemExit("no C compiler: the kernels are not built")
        runners = paths(CpuGemm(lib), w)
        for m in (int(v) for v in ns.rows.split(",")):
            x = torch.randn(m, HIDDEN)
            expected = runners["float32"](x)
            times: dict[str, list[float]] = {path: [] for path in runners}
            for r in range(ns.rounds + 1):
                order = list(runners) if r % 2 == 0 else list(reversed(runners))
                for path in order:
                    start = time.perf_counter()
                    got = runners[path](x)
                    if r > 0:
                        times[path].append(time.perf_counter() - start)
                    if got is None or expected is None or not torch.equal(got, expected):
                        raise SystemExit(f"{name} M={m}: {path} did not give float32's tokens")
            flops = 2 * m * VOCAB * HIDDEN
            cells = []
            for path, seconds in times.items():
                ratio = statistics.median(f / t for f, t in zip(times["float32"], seconds, strict=True))
                cells.append(f"{path} {flops / statistics.median(seconds) / 1e9:5.1f} ({ratio:.2f}x)")
            print(f"{name:12s} M={m:4d}  " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()

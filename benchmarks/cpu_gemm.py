"""Folio's CPU GEMM against oneDNN's packed linear (the peer vLLM's CPU backend uses) at the default model's shapes.

    .venv/bin/python benchmarks/cpu_gemm.py                          # bfloat16
    .venv/bin/python benchmarks/cpu_gemm.py --dtype float32 --rows 1,64

Each projection of SmolLM2-135M (q|k|v, o, gate|up, down, the tied LM head) at several row counts M (1-4: decode
of a few requests, 64: W1's decode batch, 2048: a prefill chunk). Thirty copies of each layer weight are cycled
through, as a decode step walks 30 layers, so the weights come from memory as they do in the engine. Prints
GFLOP/s of both and the ratio; nothing is asserted.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from folio.kernels.cpu_gemm import load_cpu_gemm

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def best_seconds(fn: Callable[[], None], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="1,4,16,64,256,2048", help="comma-separated M values")
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args()
    dtype = getattr(torch, ns.dtype)
    gemm = load_cpu_gemm()
    if gemm is None:
        raise SystemExit("no C compiler: the kernel is not built")
    torch.manual_seed(0)
    print(f"{ns.dtype}, {torch.get_num_threads()} threads; GFLOP/s folio / oneDNN (ratio)")
    for m in (int(v) for v in ns.rows.split(",")):
        cells = []
        for name, (n, k) in SHAPES.items():
            copies = 1 if name == "lm_head" else 30
            weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            ours = gemm.pack_all(weights)
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
            del weights
            x = torch.randn(m, k).to(dtype)

            def run_ours(x: torch.Tensor = x, packed: list = ours) -> None:  # type: ignore[type-arg]
                for p in packed:
                    gemm.linear(x, p, None)

            def run_onednn(x: torch.Tensor = x, packed: list = onednn) -> None:  # type: ignore[type-arg]
                for p in packed:
                    torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

            flops = 2 * m * n * k * copies
            ours_gf = flops / best_seconds(run_ours, ns.repeats) / 1e9
            onednn_gf = flops / best_seconds(run_onednn, ns.repeats) / 1e9
            cells.append(f"{name} {ours_gf:5.0f}/{onednn_gf:5.0f} ({ours_gf / onednn_gf:.2f}x)")
        print(f"M={m:5d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()

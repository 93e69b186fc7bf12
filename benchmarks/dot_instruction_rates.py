"""The multiply-add rate of this CPU's dot-product instructions against its float32 FMA, on one core.

    .venv/bin/python benchmarks/dot_instruction_rates.py
    .venv/bin/python benchmarks/dot_instruction_rates.py --iterations 20000000 --rounds 5

Why: a kernel over exact small integers (the 4-bit and 8-bit codes) or bfloat16 can trade the float32 FMA for a
dot-product instruction (vdpbf16ps, vpdpwssd, vpdpbusd, vpmaddwd + vpaddd) only where that instruction's
multiply-adds per second beat the FMA's by more than the kernel's extra work (splitting x into parts, rescaling
each group). The rate is the core's, not the ISA's (on Zen 5 every 512-bit one here runs at the FMA's instruction
rate; docs/performance.md, session 49), and compiled C loops mislead (a scratch loop of intrinsics that gcc spilled
showed vpdpbusd slower than the FMA on the same Zen 5). So a session measures with this before it builds.

Each instruction runs in a loop of 24 (12 for 256-bit) independent accumulators held in fixed registers (inline
assembly: the compiler can neither hoist nor spill them), one thread, best of --rounds. The table gives each
instruction's nanoseconds, multiply-adds per nanosecond and the ratio of that to the float32 FMA of the same width
(the peer measured in the same run). Instructions this CPU lacks are skipped; needs gcc. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from folio.kernels.isa import cpu_info


@dataclass(frozen=True)
class DotInstruction:
    name: str
    width: int  # register bits: 512 (zmm, 24 accumulators) or 256 (ymm, 12)
    multiply_adds: int  # per instruction (a pair counts once)
    flags: frozenset[str]  # /proc/cpuinfo flags it needs
    body: str  # assembly for accumulator {acc}, operands {a} and {b}, scratch {t}


INSTRUCTIONS = [
    DotInstruction("vfmadd231ps zmm", 512, 16, frozenset({"avx512f"}), "vfmadd231ps {a}, {b}, {acc}"),
    DotInstruction("vdpbf16ps zmm", 512, 32, frozenset({"avx512_bf16"}), "vdpbf16ps {a}, {b}, {acc}"),
    DotInstruction("vpdpwssd zmm", 512, 32, frozenset({"avx512_vnni"}), "vpdpwssd {a}, {b}, {acc}"),
    DotInstruction("vpdpbusd zmm", 512, 64, frozenset({"avx512_vnni"}), "vpdpbusd {a}, {b}, {acc}"),
    DotInstruction(
        "vpmaddwd + vpaddd zmm",
        512,
        32,
        frozenset({"avx512bw"}),
        "vpmaddwd {a}, {b}, {t}\\n\\tvpaddd {t}, {acc}, {acc}",
    ),
    DotInstruction("vfmadd231ps ymm", 256, 8, frozenset({"avx2", "fma"}), "vfmadd231ps {a}, {b}, {acc}"),
    DotInstruction("vpdpwssd ymm (AVX-VNNI)", 256, 16, frozenset({"avx_vnni"}), "%{{vex%}} vpdpwssd {a}, {b}, {acc}"),
    DotInstruction("vpdpbusd ymm (AVX-VNNI)", 256, 32, frozenset({"avx_vnni"}), "%{{vex%}} vpdpbusd {a}, {b}, {acc}"),
    DotInstruction(
        "vpmaddwd + vpaddd ymm", 256, 16, frozenset({"avx2"}), "vpmaddwd {a}, {b}, {t}\\n\\tvpaddd {t}, {acc}, {acc}"
    ),
]


def loop_function(index: int, ins: DotInstruction) -> str:
    """A C function: ns per instruction over ``iterations`` passes of the instruction through every accumulator."""
    reg, accumulators, temps = ("zmm", 24, [26, 27, 28, 29, 30, 31]) if ins.width == 512 else ("ymm", 12, [14, 15])
    a, b = f"%%{reg}{accumulators}", f"%%{reg}{accumulators + 1}"
    body = [
        ins.body.format(acc=f"%%{reg}{i}", a=a, b=b, t=f"%%{reg}{temps[i % len(temps)]}") for i in range(accumulators)
    ]
    xor = "vpxord" if ins.width == 512 else "vpxor"
    zero = [f"{xor} %%{reg}{i}, %%{reg}{i}, %%{reg}{i}" for i in range(accumulators + 2)]
    clobbers = ", ".join(f'"xmm{i}"' for i in range(max(temps) + 1))
    separator = "\\n\\t"  # inside the C string: a newline and a tab between instructions
    zero_asm, body_asm = separator.join(zero), separator.join(body)
    return f"""
static double run_{index}(long long iterations) {{
    struct timespec t0, t1;
    __asm__ volatile("{zero_asm}" ::: {clobbers});
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long long i = 0; i < iterations; ++i) __asm__ volatile("{body_asm}" ::: {clobbers});
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / ((double)iterations * {accumulators});
}}
"""


def c_program(instructions: list[DotInstruction]) -> str:
    """Prints one line per instruction per round: its index and ns per instruction."""
    calls = "".join(f'        printf("%d %.6f\\n", {i}, run_{i}(iterations));\n' for i in range(len(instructions)))
    functions = "".join(loop_function(i, ins) for i, ins in enumerate(instructions))
    return f"""#include <stdio.h>
#include <stdlib.h>
#include <time.h>
{functions}
int main(int argc, char **argv) {{
    const long long iterations = atoll(argv[1]);
    const int rounds = atoi(argv[2]);
    for (int r = 0; r < rounds; ++r) {{
{calls}    }}
    return 0;
}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=5_000_000, help="loop passes per timing (default 5e6)")
    parser.add_argument("--rounds", type=int, default=3, help="timings per instruction, best kept (default 3)")
    args = parser.parse_args()
    model, flags = cpu_info()
    present = [ins for ins in INSTRUCTIONS if ins.flags <= flags]
    missing = [ins.name for ins in INSTRUCTIONS if not ins.flags <= flags]
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "rates.c", Path(tmp) / "rates"
        source.write_text(c_program(present))
        subprocess.run(["gcc", "-O2", "-march=native", str(source), "-o", str(binary)], check=True)
        out = subprocess.run(
            [str(binary), str(args.iterations), str(args.rounds)], check=True, capture_output=True, text=True
        )
    best: dict[int, float] = {}
    for line in out.stdout.splitlines():
        index, nanoseconds = line.split()
        best[int(index)] = min(best.get(int(index), float("inf")), float(nanoseconds))
    print(
        f"CPU {model}, one core, best of {args.rounds} x {args.iterations} passes; skipped (not on this CPU): "
        f"{', '.join(missing) or 'none'}"
    )
    print(f"{'instruction (or pair)':26} {'ns':>7} {'mul-adds/ns':>12}  vs the float32 FMA of its width")
    fma = {ins.width: ins.multiply_adds / best[i] for i, ins in enumerate(present) if ins.name.startswith("vfmadd")}
    for i, ins in enumerate(present):
        rate = ins.multiply_adds / best[i]
        ratio = f"{rate / fma[ins.width]:.2f}x" if ins.width in fma else "-"
        print(f"{ins.name:26} {best[i]:7.3f} {rate:12.1f}  {ratio}")


if __name__ == "__main__":
    main()

"""W1 beside a busy neighbour: quiet and busy runs of `folio bench throughput` in turn, and busy / quiet.

    .venv/bin/python benchmarks/busy_neighbour.py                          # float32, 2 rounds
    .venv/bin/python benchmarks/busy_neighbour.py --dtype bfloat16 --rounds 3
    .venv/bin/python benchmarks/busy_neighbour.py --cpu-isa avx2 --plot busy_neighbour.png

Issue 16's target: with one competing busy process on the machine W1 keeps >= 40% of its quiet rate (OpenMP's
fork/join once lost 90% of it, waiting for a descheduled thread). Each run is a fresh `folio bench throughput
--dataset-name w1` process, as a user starts one; a busy run first starts `python -c 'while True: pass'` and waits
until /proc shows it has run, and stops it after. Rounds alternate the order (quiet, busy; then busy, quiet) so that
the machine's drift over the minutes falls on both settings. Prints every run's output tok/s and busy / quiet by
medians and by bests (with two cores, half the machine would give about 50%); --plot draws the runs. Nothing is
asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

FOLIO = Path(sys.executable).with_name("folio")


def start_busy_process() -> subprocess.Popen[bytes]:
    """A process that only spins, once the kernel has scheduled it (its CPU time in /proc is above zero)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    stat = Path(f"/proc/{busy.pid}/stat")
    deadline = time.monotonic() + 30.0  # a hang guard: it runs within milliseconds
    while time.monotonic() < deadline:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        if int(fields[11]) + int(fields[12]) > 0:  # utime + stime, in clock ticks
            return busy
        time.sleep(0.01)
    busy.kill()
    raise RuntimeError("the busy process never ran")


def run_w1(dtype: str, cpu_isa: str) -> float:
    """One `folio bench throughput --dataset-name w1` process; its output tok/s."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "w1.json"
        cmd = [str(FOLIO), "bench", "throughput", "--dataset-name", "w1", "--dtype", dtype, "--cpu-isa", cpu_isa]
        cmd += ["--disable-tqdm", "--output-json", str(result)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return float(json.loads(result.read_text())["output_tokens_per_second"])


def measure(dtype: str, cpu_isa: str, rounds: int) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {"quiet": [], "busy": []}
    order = [("quiet", "busy") if r % 2 == 0 else ("busy", "quiet") for r in range(rounds)]
    with tqdm(total=2 * rounds, desc="W1 runs") as bar:
        for pair in order:
            for setting in pair:
                busy = start_busy_process() if setting == "busy" else None
                try:
                    runs[setting].append(run_w1(dtype, cpu_isa))
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
                bar.set_postfix_str(f"{setting} {runs[setting][-1]:.1f} tok/s")
                bar.update()
    return runs


def plot(runs: dict[str, list[float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (setting, values) in enumerate(runs.items()):
        ax.scatter([i] * len(values), values, label=setting)
    ax.set_xticks(range(len(runs)), list(runs))
    ax.set_xlim(-0.5, len(runs) - 0.5)
    ax.set_ylabel("W1 output tok/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cpu-isa", default="auto")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of one quiet and one busy run")
    parser.add_argument("--plot", default="", help="write the runs as a PNG to this path")
    ns = parser.parse_args()
    from folio.kernels.isa import cpu_info, detect_tier, is_x86_64

    cpu, flags = cpu_info()
    tier = detect_tier(flags, is_x86_64()).flag_name
    print(f"CPU {cpu} (best tier {tier}), {os.cpu_count()} CPUs; W1 {ns.dtype}, --cpu-isa {ns.cpu_isa}")
    runs = measure(ns.dtype, ns.cpu_isa, ns.rounds)
    for setting, values in runs.items():
        print(f"  {setting:6s} " + " ".join(f"{v:7.1f}" for v in values) + " output tok/s")
    quiet, busy = runs["quiet"], runs["busy"]
    by_median = statistics.median(busy) / statistics.median(quiet)
    by_best = max(busy) / max(quiet)
    print(f"busy / quiet: {by_median:.0%} by medians, {by_best:.0%} by bests (issue 16's target: >= 40%)")
    if ns.plot:
        plot(runs, ns.plot, f"W1 {ns.dtype} beside one busy process ({cpu}): {by_median:.0%} of quiet")
        print(f"plot: {ns.plot}")


if __name__ == "__main__":
    main()

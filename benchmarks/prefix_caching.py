"""Target 3 of issue 4: prefix_repetition throughput with prefix caching on vs off, in one run.

    .venv/bin/python benchmarks/prefix_caching.py                         # 100 prompts, 10 prefixes x 256 tokens
    .venv/bin/python benchmarks/prefix_caching.py --num-prompts 200 --suffix-len 64 --output-len 64

Runs `folio bench throughput --dataset-name prefix_repetition` twice on the same seeded request set (a fresh
process each, float32, the default model): once as is, once with --no-enable-prefix-caching. Prints both
throughputs (total tokens/s: prompt + output, since caching saves prompt work) and the ratio. The defaults keep
prompts prefix-heavy (256 shared + 32 own tokens) and outputs short (32), the case prefix caching exists for; with
vLLM's dataset defaults (256 + 256, 128 out) the attainable gain is below 2x even at zero cost for a cached token.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FOLIO = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "folio"


def run(ns: argparse.Namespace, caching: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            str(FOLIO), "bench", "throughput", "--dataset-name", "prefix_repetition",
            "--num-prompts", str(ns.num_prompts),
            "--prefix-repetition-prefix-len", str(ns.prefix_len),
            "--prefix-repetition-suffix-len", str(ns.suffix_len),
            "--prefix-repetition-num-prefixes", str(ns.num_prefixes),
            "--prefix-repetition-output-len", str(ns.output_len),
            "--dtype", "float32", "--disable-tqdm", "--output-json", str(out),
            "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
        ]  # fmt: skip
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stdout, stderr=subprocess.DEVNULL)
        result: dict[str, float] = json.loads(out.read_text())
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--num-prefixes", type=int, default=10)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    ns = parser.parse_args()
    on = run(ns, caching=True)
    off = run(ns, caching=False)
    print(f"prefix caching on:  {on['tokens_per_second']:.1f} total tok/s ({on['elapsed_time']:.2f} s)")
    print(f"prefix caching off: {off['tokens_per_second']:.1f} total tok/s ({off['elapsed_time']:.2f} s)")
    ratio = on["tokens_per_second"] / off["tokens_per_second"]
    print(f"on / off: {ratio:.2f}x (target >= 2x: {'met' if ratio >= 2 else 'missed'})")


if __name__ == "__main__":
    main()

"""xgrammar vs llguidance on this CPU, at the library level: what chose the default of ``backend="auto"``.

For each installed backend, on the default model's tokenizer (SmolLM2, 49152 tokens):
  - compile latency of a 20-property JSON schema (cold: a fresh compiler per run, nothing cached), median of runs;
  - per-step mask time at 64 running requests constrained by that schema: one batched call fills the 64 bitmask
    rows, each matcher at a different point of a valid instance; then each matcher accepts its next token;
  - the cost of applying the [64, V/32] int32 bitmask to float32 logits with plain torch ops (Folio's code).

Usage: python benchmarks/structured_backends.py [--backends xgrammar guidance] [--num-reqs 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import numpy as np
import torch

from folio.bench.schemas import TWENTY_PROPERTY_SCHEMA, twenty_property_instance
from folio.model.loader import default_model_path, load_tokenizer, read_model_spec
from folio.structured.backend import allocate_bitmask, create_backend
from folio.structured.bitmask import masked_logits
from folio.structured.params import GrammarSpec


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def measure(backend_name: str, tokenizer: Any, vocab_size: int, eos: list[int], args: argparse.Namespace) -> None:
    spec = GrammarSpec("json", json.dumps(TWENTY_PROPERTY_SCHEMA))
    compile_ms = []
    backend = None
    for _ in range(args.compile_runs):
        backend = create_backend(backend_name, tokenizer, vocab_size, eos, num_threads=args.threads)
        start = time.perf_counter()
        grammar = backend.compile(spec)
        # llguidance builds lexer states lazily: the first mask is part of the compile latency a request sees.
        backend.fill_bitmask([(backend.new_matcher(grammar), 0)], allocate_bitmask(1, vocab_size))
        compile_ms.append((time.perf_counter() - start) * 1e3)
    assert backend is not None
    instance_ids = tokenizer.encode(json.dumps(twenty_property_instance()), add_special_tokens=False)
    matchers = [backend.new_matcher(grammar) for _ in range(args.num_reqs)]
    # Stagger: request i starts i tokens into the instance (wrapping), as in a batch admitted over time.
    cursors = [i % (len(instance_ids) // 2) for i in range(args.num_reqs)]
    for matcher, cursor in zip(matchers, cursors, strict=True):
        assert matcher.accept_tokens(instance_ids[:cursor]), "the instance must be accepted"
    bitmask = allocate_bitmask(args.num_reqs, vocab_size)
    fill_ms, accept_ms = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        backend.fill_bitmask([(m, row) for row, m in enumerate(matchers)], bitmask)
        fill_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        for i, matcher in enumerate(matchers):
            if cursors[i] < len(instance_ids):
                assert matcher.accept_tokens([instance_ids[cursors[i]]]), "the instance must be accepted"
                cursors[i] += 1
        accept_ms.append((time.perf_counter() - start) * 1e3)
    allowed_share = float(np.unpackbits(bitmask.view(np.uint8)).mean())  # the last step's masks: not trivial
    logits = torch.randn(args.num_reqs, vocab_size)
    mask_t = torch.from_numpy(bitmask)
    apply_ms = []
    for _ in range(args.steps):
        start = time.perf_counter()
        masked_logits(logits, mask_t)
        apply_ms.append((time.perf_counter() - start) * 1e3)
    print(
        f"{backend_name:9s} compile(20 props) median {statistics.median(compile_ms):7.1f} ms "
        f"(runs {', '.join(f'{v:.0f}' for v in compile_ms)}) | per step at {args.num_reqs} reqs: "
        f"fill {statistics.median(fill_ms):.2f} ms, accept {statistics.median(accept_ms):.2f} ms, "
        f"apply {statistics.median(apply_ms):.2f} ms (medians of {args.steps} steps; "
        f"{100 * allowed_share:.1f}% of tokens allowed at the last)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "guidance"])
    parser.add_argument("--num-reqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compile-runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="mask-filling threads of each backend")
    args = parser.parse_args()
    path = default_model_path()
    tokenizer = load_tokenizer(path)
    spec = read_model_spec(path)
    print(f"CPU: {_cpu_name()}; torch threads {torch.get_num_threads()}; backend threads {args.threads}")
    for name in args.backends:
        measure(name, tokenizer, spec.vocab_size, list(spec.eos_token_ids), args)


if __name__ == "__main__":
    main()

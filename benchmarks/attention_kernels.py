"""Micro-benchmark of the CPU attention at W1's shapes (SmolLM2: 9 query / 3 KV heads of 64): the C kernel built
for each ISA tier, and the torch backend (TorchBatchedBackend), in one run.

    .venv/bin/python benchmarks/attention_kernels.py                          # float32, every tier this CPU has
    .venv/bin/python benchmarks/attention_kernels.py --dtype bfloat16 --tiers avx2 avx512_bf16
    .venv/bin/python benchmarks/attention_kernels.py --threads 1 --clock cpu   # on a machine shared with others

Every tier up to this CPU's own runs here (an AVX-512 machine measures the AVX2 and generic builds too); each
build is the library the engine would load for that tier (folio/kernels/cpu_build.py).
Decode: 64 rows at contexts 110-290 over 30 layers' caches (about 590 MB in float32, so K/V come from DRAM as in
a real step), each backend on the cache layout the engine allocates for it (head-major for the kernel), each
request's blocks consecutive, and scattered over the cache (as a long-running server's free list hands them
out). Prefill: 16 fresh prompts of 20-200 tokens through one layer.
The implementations take turns within each repeat (so the machine's drift hits them alike) and each figure is
the best of the repeats; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from folio.attention.backends.base import AttentionBackend
from folio.attention.backends.cpu_paged import CpuPagedBackend, load_paged_attention_kernel
from folio.attention.backends.torch_batched import TorchBatchedBackend
from folio.attention.builder import build_attn_metadata
from folio.kernels.cpu_build import native_tier
from folio.kernels.isa import IsaTier, cpu_info

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_LAYERS = 9, 3, 64, 16, 30


def best_of(fn: Callable[[], None], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def contiguous_tables(seq_lens: list[int]) -> list[list[int]]:
    tables, next_block = [], 0
    for seq_len in seq_lens:
        n = -(-seq_len // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    return tables


def fused_qkv(num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one q|k|v buffer, as the model hands them to the backend."""
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=1)
    return (
        q.view(num_tokens, NUM_HEADS, HEAD_DIM),
        k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM),
        v.view(num_tokens, NUM_KV_HEADS, HEAD_DIM),
    )


def layer_caches(num_blocks: int, dtype: torch.dtype, head_major: bool, num_layers: int) -> list[torch.Tensor]:
    """Random K/V caches [2, NB, BS, KV, D], in head-major storage where the backend wants it."""
    if head_major:
        shape = (2, num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
        return [torch.randn(shape).to(dtype).transpose(2, 3) for _ in range(num_layers)]
    return [torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype) for _ in range(num_layers)]


class Workload:
    """One implementation's decode step (over every layer's cache) and prefill (one layer), as callables."""

    def __init__(self, backend: AttentionBackend, dtype: torch.dtype) -> None:
        head_major = getattr(backend, "kv_cache_head_major", False)
        rng = random.Random(0)
        seq_lens = [rng.randint(110, 290) for _ in range(64)]
        tables = contiguous_tables(seq_lens)
        num_blocks = sum(len(t) for t in tables) + 1
        shuffled = list(range(num_blocks))
        rng.shuffle(shuffled)  # a long-running server's free list hands out blocks in no order
        self.decode_attn = build_attn_metadata([1] * 64, seq_lens, tables, BLOCK_SIZE)
        scattered = [[shuffled[b] for b in t] for t in tables]
        self.scattered_attn = build_attn_metadata([1] * 64, seq_lens, scattered, BLOCK_SIZE)
        self.decode_qkv = fused_qkv(64, dtype)
        self.caches = layer_caches(num_blocks, dtype, head_major, NUM_LAYERS)
        prompt_lens = [rng.randint(20, 200) for _ in range(16)]
        prompt_tables = contiguous_tables(prompt_lens)
        self.prefill_attn = build_attn_metadata(prompt_lens, prompt_lens, prompt_tables, BLOCK_SIZE)
        self.prefill_qkv = fused_qkv(sum(prompt_lens), dtype)
        self.prefill_cache = layer_caches(sum(len(t) for t in prompt_tables) + 1, dtype, head_major, 1)[0]
        self.backend = backend

    def decode(self, scattered: bool) -> None:
        attn = self.scattered_attn if scattered else self.decode_attn
        for cache in self.caches:
            self.backend.forward(*self.decode_qkv, cache, attn, HEAD_DIM**-0.5)

    def prefill(self) -> None:
        self.backend.forward(*self.prefill_qkv, self.prefill_cache, self.prefill_attn, HEAD_DIM**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    tiers = [tier.flag_name for tier in IsaTier if tier <= native_tier()]
    parser.add_argument("--tiers", nargs="+", default=tiers, choices=tiers, help="kernel builds (default: all)")
    parser.add_argument("--no-torch", action="store_true", help="leave out the torch backend")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    parser.add_argument(
        "--clock", default="wall", choices=["wall", "cpu"], help="cpu: the process's CPU time (with --threads 1, "
        "what the work costs on a machine other processes keep busy)"
    )  # fmt: skip
    ns = parser.parse_args()
    if ns.threads is not None:  # 1 on a machine shared with other busy processes: OpenMP's joins wait for a
        torch.set_num_threads(ns.threads)  # descheduled thread (docs/performance.md)
    dtype = getattr(torch, ns.dtype)
    clock = time.process_time if ns.clock == "cpu" else time.perf_counter
    backends: dict[str, AttentionBackend] = {}
    for name in ns.tiers:
        kernels = load_paged_attention_kernel(IsaTier[name.upper()])
        if kernels is None:
            raise SystemExit("no C compiler: the CPU kernels are not built")
        backends[f"C kernel, {name}"] = CpuPagedBackend(kernels)
    if not ns.no_torch:
        backends["torch (TorchBatchedBackend)"] = TorchBatchedBackend()
    workloads = {name: Workload(backend, dtype) for name, backend in backends.items()}
    figures: dict[str, dict[str, float]] = {name: {} for name in workloads}
    runs: dict[str, Callable[[Workload], None]] = {
        "decode": lambda w: w.decode(False),
        "decode, blocks scattered": lambda w: w.decode(True),
        "prefill": Workload.prefill,
    }
    for _ in range(ns.repeats):  # the implementations take turns
        for name, work in workloads.items():
            for run, fn in runs.items():
                seconds = best_of(lambda fn=fn, work=work: fn(work), 1, clock)
                figures[name][run] = min(figures[name].get(run, float("inf")), seconds)
    model, _ = cpu_info()
    print(f"CPU: {model}, {torch.get_num_threads()} threads, {ns.dtype}, {ns.clock} time, best of {ns.repeats}")
    print("decode: 64 rows x 30 layers, ms per step; prefill: 16 prompts (20-200 tokens), one layer, ms")
    cells = " | ".join(f"{run:>24}" for run in runs)
    header = f"| {'implementation':<28} | {cells} | vs torch: decode, prefill |"
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    base = figures.get("torch (TorchBatchedBackend)")
    for name, cells in figures.items():
        ratio = f"{base['decode'] / cells['decode']:.2f}x, {base['prefill'] / cells['prefill']:.2f}x" if base else "-"
        row = " | ".join(f"{cells[run] * 1e3:>24.2f}" for run in runs)
        print(f"| {name:<28} | {row} | {ratio:>25} |")


if __name__ == "__main__":
    main()

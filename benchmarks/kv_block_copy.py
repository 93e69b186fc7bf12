"""Time of the host KV tier's block copies: Folio's one parallel C call against ATen's gather-then-scatter.

    .venv/bin/python benchmarks/kv_block_copy.py
    .venv/bin/python benchmarks/kv_block_copy.py --blocks 8 33 100 --dtype bfloat16 --threads 2

The layout is the worker's for SmolLM2 (30 layers, 16-token blocks, 3 KV heads of 64): a device pool of
--device-blocks built as the worker builds it, a host tier of --host-blocks. Each round copies a random set of
host blocks into random device blocks (a load) and back (a store), alternating the two implementations. Prints
the median milliseconds of each, the bytes of block moved per second, and the ratio; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from folio.kernels.cpu_kernels import load_cpu_kernels
from folio.kernels.kv_block_copy import BlockCopy, CpuBlockCopy, aten_copy_blocks
from folio.worker.kv_cache_shape import KVCacheShape


def _time(
    copy: BlockCopy, src: list[torch.Tensor], dst: list[torch.Tensor], ids: list[tuple[list[int], list[int]]]
) -> list[float]:
    times = []
    for src_ids, dst_ids in ids:
        start = time.perf_counter()
        copy(src, src_ids, dst, dst_ids)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 33, 100], help="blocks per copy")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device-blocks", type=int, default=648)
    parser.add_argument("--host-blocks", type=int, default=2592)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = KVCacheShape(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype)
    device = shape.allocate(args.device_blocks, torch.device("cpu"))
    host = [torch.zeros((2, args.host_blocks, 16, 3, 64), dtype=dtype) for _ in range(shape.num_layers)]
    kernels = load_cpu_kernels(None, dtype)
    folio = kernels.block_copy
    if not isinstance(folio, CpuBlockCopy):
        raise SystemExit(f"this machine's plan does not run Folio's block copy ({kernels.plan.kv_block_copy})")
    print(f"{kernels.describe()}; {args.threads} threads; {shape.bytes_per_block} bytes a block")
    rng = random.Random(0)
    print("blocks | direction | aten ms (median) | folio ms (median) | folio GB/s | folio / aten speed")
    for n in args.blocks:
        ids = [
            (rng.sample(range(args.host_blocks), n), rng.sample(range(args.device_blocks), n))
            for _ in range(args.rounds)
        ]
        for direction, src, dst, plans in (
            ("load", host, device, ids),
            ("store", device, host, [(d, h) for h, d in ids]),
        ):
            aten, ours = [], []
            for half in range(2):  # alternated, so that the machine's drift hits both alike
                for copy, out in (
                    ((aten_copy_blocks, aten), (folio, ours))
                    if half == 0
                    else ((folio, ours), (aten_copy_blocks, aten))
                ):
                    out += _time(copy, src, dst, plans[half::2])
            a, f = statistics.median(aten) * 1e3, statistics.median(ours) * 1e3
            rate = n * shape.bytes_per_block / (f / 1e3) / 1e9
            print(f"{n:6d} | {direction:9s} | {a:16.2f} | {f:17.2f} | {rate:10.1f} | {a / f:.2f}x")


if __name__ == "__main__":
    main()

"""Pipeline parallelism on this machine (docs/scale_out.md): the real model's decode at pp=1 and pp=2, with the
stages overlapped (the default: up to pp batches in flight, folio/engine/batch_queue.py) and one batch at a time.

Every request gets a 4-token prompt and num_tokens greedy tokens; the set runs through the engine step by step
(folio/bench/stepping.py). Printed per setting and batch: the median time per output token of a request after its
first (TPOT; at pp=1 that is the decode step) and the output tokens per second of the whole set. Plus one gloo
send/recv of a decode row's activations between two processes (the hop between stages).

    OMP_NUM_THREADS=2 python benchmarks/pipeline_parallel.py          # pp=1 on 2 threads, pp=2 on 1 thread per stage
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from folio import LLM, SamplingParams
from folio.bench.stepping import run_stepped


def _measure(llm: LLM, batch: int, num_tokens: int) -> tuple[float, float]:
    """(median TPOT in ms, output tokens per second) of ``batch`` requests."""
    prompts = [[1, 100 + i, 200, 300] for i in range(batch)]
    params = [SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)] * batch
    run = run_stepped(llm.llm_engine, prompts, params)
    tpots = [r.tpot_s for r in run.requests if r.tpot_s is not None]
    num_out = sum(len(r.output_ids) for r in run.requests)
    return statistics.median(tpots) * 1e3, num_out / run.elapsed_s


def _engine(kwargs: dict[str, Any], overlap: bool) -> LLM:
    llm = LLM(dtype="float32", kv_cache_memory_bytes=2**27, max_model_len=512, **kwargs)
    if not overlap:
        llm.llm_engine.engine_core.batch_queue = None  # one step at a time through the stages
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--num-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of them is printed")
    args = parser.parse_args()
    settings: list[tuple[str, dict[str, Any], bool]] = [
        ("pp=1 fused decoder", {}, True),
        ("pp=1 layer by layer", {"enforce_eager": True}, True),
        ("pp=2 one batch at a time", {"pipeline_parallel_size": 2}, False),
        ("pp=2 overlapped", {"pipeline_parallel_size": 2}, True),
    ]
    engines = [(name, _engine(kwargs, overlap)) for name, kwargs, overlap in settings]
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for _ in range(args.rounds):  # alternating, so that a burst of load from elsewhere hits every setting alike
        for name, llm in engines:
            for batch in args.batches:
                _measure(llm, batch, 4)  # warm-up
                tpot, tps = _measure(llm, batch, args.num_tokens)
                old = best.get((name, batch))
                best[(name, batch)] = (tpot, tps) if old is None or tps > old[1] else old
    print("setting                      batch  TPOT median ms  output tok/s")
    for name, _ in engines:
        for batch in args.batches:
            tpot, tps = best[(name, batch)]
            print(f"{name:28s} {batch:6d} {tpot:15.2f} {tps:13.1f}")
    for _, llm in engines:
        llm.llm_engine.engine_core.shutdown()
    print(f"gloo send/recv of [2, 1, 576] float32 between 2 processes: {_hop_ms():.2f} ms one way (median)")


def _hop_worker(rank: int, port: int, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    message, times = torch.zeros(2, 1, 576), []
    for _ in range(repeats):
        start = time.perf_counter()
        if rank == 0:
            dist.send(message, 1)
            dist.recv(message, 1)
        else:
            dist.recv(message, 0)
            dist.send(message, 0)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times) / 2 * 1e3)
    dist.destroy_process_group()


def _hop_ms(repeats: int = 500) -> float:
    import multiprocessing

    from folio.executor.distributed import free_port

    ctx = multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_hop_worker, args=(r, port, repeats, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    result = float(queue.get(timeout=120))
    for proc in procs:
        proc.join(10)
    return result


if __name__ == "__main__":
    main()

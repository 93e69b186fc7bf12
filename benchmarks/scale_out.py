"""Costs of the multiprocess executor and of tensor parallelism on this machine (docs/scale_out.md).

broadcast: the per-step cost of moving a step to worker processes (and, given --ray-address, to Ray actors: a
cluster with 3 free CPUs). The no-op model (model_impl="noop": the real
shapes, no forward work) runs the same decode-only batches with the worker in the engine's process (uni) and in
1 or 3 worker processes (mp): the difference in step time is the hop (pickle the SchedulerOutput once, write it
to every rank's pipe, unpickle, rank 0's ModelRunnerOutput back). It also prints the pickled size of one step.

decode: the real model's decode step at tp=1 (fused CPU decoder, and layer by layer with enforce_eager) and at
tp=N (layer by layer, gloo collectives between the ranks), plus one gloo all-reduce of a decode row.

    OMP_NUM_THREADS=1 python benchmarks/scale_out.py broadcast
    OMP_NUM_THREADS=1 python benchmarks/scale_out.py broadcast --ray-address 127.0.0.1:6379   # + the Ray executor
    OMP_NUM_THREADS=1 python benchmarks/scale_out.py decode --tp 3
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from typing import Any

from folio import LLM, SamplingParams


class _StepRecorder:
    """Wraps the engine core's executor: the wall time of each execute_model and the pickled size of its input."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.step_s: list[float] = []
        self.num_bytes: list[int] = []
        self.pickle_s: list[float] = []

    def execute_model(self, sched: Any) -> Any:
        start = time.perf_counter()
        payload = pickle.dumps(sched, protocol=pickle.HIGHEST_PROTOCOL)
        self.pickle_s.append(time.perf_counter() - start)
        self.num_bytes.append(len(payload))
        start = time.perf_counter()
        out = self.inner.execute_model(sched)
        self.step_s.append(time.perf_counter() - start)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _decode_steps(llm: LLM, batch: int, num_tokens: int) -> _StepRecorder:
    """Runs ``batch`` requests of a short prompt for num_tokens greedy tokens; records the decode-only steps."""
    core = llm.llm_engine.engine_core
    recorder = _StepRecorder(core.executor)
    core.executor = recorder
    prompts = [{"prompt_token_ids": [1, 100 + i, 200, 300]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.executor = recorder.inner
    skip = 2  # the prefill step and the first decode step
    recorder.step_s, recorder.num_bytes = recorder.step_s[skip:], recorder.num_bytes[skip:]
    recorder.pickle_s = recorder.pickle_s[skip:]
    return recorder


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def broadcast(args: argparse.Namespace) -> None:
    print("executor    ranks  batch  step median ms  pickled step bytes  pickle.dumps us")
    settings = [("uni", 1), ("mp", 1), ("mp", 3)]
    if args.ray_address:
        settings += [("ray", 1), ("ray", 3)]
    for backend, tp in settings:
        llm = LLM(
            model_impl="noop",
            kv_cache_memory_bytes=2**32,  # accounted, not allocated (the no-op model keeps no K/V): no preemption
            max_model_len=512,
            tensor_parallel_size=tp,
            distributed_executor_backend=backend,
            ray_address=args.ray_address if backend == "ray" else None,
        )
        for batch in args.batches:
            rec = _decode_steps(llm, batch, args.num_tokens)
            step_ms, num_bytes = _median_ms(rec.step_s), statistics.median(rec.num_bytes)
            pickle_us = _median_ms(rec.pickle_s) * 1e3
            print(f"{backend:10s} {tp:6d} {batch:6d} {step_ms:15.3f} {num_bytes:19.0f} {pickle_us:16.1f}")
        llm.llm_engine.engine_core.shutdown()
    for num_bytes in (539, 2226, 16384):
        print(
            f"pipe round trip alone, {num_bytes} bytes down, 256 back: {_pipe_round_trip_us(num_bytes):.0f} us (median)"
        )


def _echo(conn: Any) -> None:
    while payload := conn.recv_bytes():
        conn.send_bytes(payload[:256])


def _pipe_round_trip_us(num_bytes: int, repeats: int = 2000) -> float:
    """The floor of the hop: bytes down a pipe to a spawned process and 256 bytes back (no pickling, no work)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(there,), daemon=True)
    proc.start()
    payload, times = b"x" * num_bytes, []
    for _ in range(repeats):
        start = time.perf_counter()
        here.send_bytes(payload)
        here.recv_bytes()
        times.append(time.perf_counter() - start)
    here.send_bytes(b"")
    proc.join(5)
    return statistics.median(times) * 1e6


def decode(args: argparse.Namespace) -> None:
    print("setting                      batch  decode step median ms")
    settings = [
        ("tp=1 fused decoder", {}),
        ("tp=1 layer by layer", {"enforce_eager": True}),
        (f"tp={args.tp} layer by layer", {"tensor_parallel_size": args.tp}),
    ]
    for name, kwargs in settings:
        llm = LLM(dtype="float32", kv_cache_memory_bytes=2**27, max_model_len=512, **kwargs)  # type: ignore[arg-type]
        for batch in args.batches:
            rec = _decode_steps(llm, batch, args.num_tokens)
            print(f"{name:28s} {batch:6d} {_median_ms(rec.step_s):22.2f}")
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("broadcast")
    b.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    b.add_argument("--num-tokens", type=int, default=64)
    b.add_argument("--ray-address", default=None, help="a Ray cluster's head (host:port): adds the Ray executor")
    d = sub.add_parser("decode")
    d.add_argument("--tp", type=int, default=3)
    d.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    d.add_argument("--num-tokens", type=int, default=16)
    args = parser.parse_args()
    broadcast(args) if args.what == "broadcast" else decode(args)


if __name__ == "__main__":
    main()

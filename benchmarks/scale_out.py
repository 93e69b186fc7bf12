"""Costs of the multiprocess executor and of tensor parallelism on this machine (docs/scale_out.md).

broadcast: the per-step cost of moving a step to worker processes (and, given --ray-address, to Ray actors: a
cluster with 3 free CPUs). The no-op model (model_impl="noop": the real
shapes, no forward work) runs the same decode-only batches with the worker in the engine's process (uni) and in
1 or 3 worker processes (mp): the difference in step time is the hop (pickle the SchedulerOutput once, write it
to every rank's pipe, unpickle, rank 0's ModelRunnerOutput back). It also prints the pickled size of one step.

decode: the real model's decode step at tp=1 (fused CPU decoder, and layer by layer with enforce_eager) and at
tp=N (layer by layer), with the ranks' collectives through gloo and through shared memory (cpu_allreduce).
SmolLM2 splits only at tp=3; smollm2-shaped writes a random model of its shapes that tp=2 splits.

allreduce: one all-reduce of [rows, 576] float32 (decode rows) between spawned ranks, gloo against the shared-memory
path (and its waiting policies: a pure spin, yielding at once), in alternating blocks.

    OMP_NUM_THREADS=1 python benchmarks/scale_out.py broadcast
    OMP_NUM_THREADS=1 python benchmarks/scale_out.py broadcast --ray-address 127.0.0.1:6379   # + the Ray executor
    OMP_NUM_THREADS=1 python benchmarks/scale_out.py decode --tp 3
    OMP_NUM_THREADS=1 python benchmarks/scale_out.py smollm2-shaped /tmp/smollm2_shaped
    OMP_NUM_THREADS=1 python benchmarks/scale_out.py decode --tp 2 --model /tmp/smollm2_shaped
    OMP_NUM_THREADS=1 python benchmarks/scale_out.py allreduce --ranks 2 --rows 1 64
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from typing import Any

from folio import LLM, SamplingParams
from folio.parallel.shm_allreduce import SPIN_S as SPIN
from folio.parallel.shm_allreduce import YIELD_S as YIELD


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
    """Every setting's engine is built first, then the settings alternate for ``rounds`` (a burst of load from
    elsewhere hits them alike); each round's median decode step is printed, and the best round last."""
    settings: list[tuple[str, dict[str, Any]]] = [
        ("tp=1 fused decoder", {}),
        ("tp=1 layer by layer", {"enforce_eager": True}),
    ]
    settings += [
        (f"tp={args.tp} {ar}", {"tensor_parallel_size": args.tp, "cpu_allreduce": ar}) for ar in args.allreduce
    ]
    engines = [
        (name, LLM(args.model, dtype="float32", kv_cache_memory_bytes=2**27, max_model_len=512, **kwargs))
        for name, kwargs in settings
    ]
    medians: dict[tuple[str, int], list[float]] = {}
    print("round  setting                      batch  decode step median ms")
    for round_ in range(args.rounds):
        for name, llm in engines:
            for batch in args.batches:
                rec = _decode_steps(llm, batch, args.num_tokens)
                medians.setdefault((name, batch), []).append(_median_ms(rec.step_s))
                print(f"{round_:5d}  {name:28s} {batch:6d} {medians[(name, batch)][-1]:22.2f}")
    for _, llm in engines:
        llm.llm_engine.engine_core.shutdown()
    print("best of the rounds:")
    for (name, batch), values in medians.items():
        print(f"       {name:28s} {batch:6d} {min(values):22.2f}")


def smollm2_shaped(args: argparse.Namespace) -> None:
    """A random-weight model of SmolLM2-135M's shapes that tp=2 can split: 12 heads of 48 and 4 KV heads give the
    same q|k|v sizes (576 | 192 | 192) as SmolLM2's 9 heads of 64 and 3 KV heads (which only tp=3 splits), with
    SmolLM2's hidden, intermediate, layers and vocabulary, and SmolLM2's tokenizer."""
    import torch
    import transformers

    from folio.model.loader import default_model_path, load_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=48,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(args.directory)
    load_tokenizer(default_model_path()).save_pretrained(args.directory)
    print(f"wrote {args.directory}")


_WAIT_POLICIES = {  # name -> (seconds of spinning before yielding, seconds of yielding before sleeping)
    "default": (None, None),  # shm_allreduce.py: SPIN_S, YIELD_S
    "spin": (1e9, 1e9),
    "yield": (0.0, 1e9),
    "spin10us": (1e-5, None),
    "spin50us": (5e-5, None),
    "spin200us": (2e-4, None),
}


def _allreduce_rank(rank: int, world_size: int, port: int, args: Any, results: Any) -> None:
    """One rank of the all-reduce benchmark: gloo and shm in alternating blocks of ``repeats`` calls per size."""
    import torch
    import torch.distributed as dist

    from folio.parallel.group import init_rank_group
    from folio.parallel.shm_allreduce import ShmCommunicator

    torch.set_num_threads(1)
    group = init_rank_group(rank, world_size, port, "cpu", "gloo")
    shm = ShmCommunicator.create(group.group, rank, world_size)
    times: dict[tuple[str, int], list[float]] = {}
    for rows in args.rows:
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rank))
        for _ in range(args.blocks):
            for name in ("gloo", *args.policies):
                if name != "gloo":
                    spin, yield_s = _WAIT_POLICIES[name]
                    shm.spin_s = SPIN if spin is None else spin
                    shm.yield_s = YIELD if yield_s is None else yield_s
                block = times.setdefault((name, rows), [])
                for i in range(args.repeats + 5):
                    y = x.clone()
                    start = time.perf_counter()
                    dist.all_reduce(y, group=group.group) if name == "gloo" else shm.all_reduce(y)
                    if i >= 5:  # warm-up calls of each block
                        block.append(time.perf_counter() - start)
    if rank == 0:
        results.send(times)
    dist.barrier()


def allreduce(args: argparse.Namespace) -> None:
    """Latency of one all-reduce of [rows, 576] float32 (the decode rows of SmolLM2) between ranks processes."""
    import multiprocessing

    from folio.executor.distributed import free_port

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    port = free_port()
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, args.ranks, port, args, there), daemon=True)
        for r in range(args.ranks)
    ]
    for proc in procs:
        proc.start()
    times = here.recv()
    for proc in procs:
        proc.join(30)
    print(f"{args.ranks} ranks, {args.blocks} alternating blocks of {args.repeats} calls; per call, microseconds")
    print("collective        rows   median      p10      p90")
    for (name, rows), values in times.items():
        q = statistics.quantiles(values, n=10)
        print(f"{name:16s} {rows:5d} {_median_ms(values) * 1e3:8.1f} {q[0] * 1e6:8.1f} {q[-1] * 1e6:8.1f}")


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
    d.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (tp=3 splits it)")
    d.add_argument("--allreduce", nargs="+", default=["gloo", "shm"], choices=["gloo", "shm"])
    d.add_argument("--rounds", type=int, default=2)
    m = sub.add_parser("smollm2-shaped")
    m.add_argument("directory")
    a = sub.add_parser("allreduce")
    a.add_argument("--ranks", type=int, default=2)
    a.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    a.add_argument("--blocks", type=int, default=5)
    a.add_argument("--repeats", type=int, default=200)
    a.add_argument("--policies", nargs="+", default=["default"], choices=sorted(_WAIT_POLICIES))
    args = parser.parse_args()
    modes = {"broadcast": broadcast, "decode": decode, "allreduce": allreduce, "smollm2-shaped": smollm2_shaped}
    modes[args.what](args)


if __name__ == "__main__":
    main()

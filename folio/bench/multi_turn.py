"""`folio bench throughput --dataset-name multi_turn`: the KV-tier workload of issue 18, offline.

Each prompt is the whole history, with the replies the engine produced for the earlier turns (greedy, EOS
ignored). Two arrival patterns (``--multi-turn-arrival``):
- ``waves`` (the default): wave t sends every conversation's turn t at once, once every turn t-1 has finished. The
  clock covers the waves' engine work only; a wave's last requests run in ever smaller batches.
- ``closed-loop``: every conversation's first turn at once, then each conversation's next turn as soon as its last
  reply finished, as a chat client sends it (no think time): the batch stays full until the conversations run out.
TTFT is measured per request from its submission to the step that returned its first token.

``--compare-offloading`` runs the workload without and with the host KV tier (the engine flags otherwise the
same), and prints both, their ratio, the tokens recomputed after preemption in each run and whether the greedy
outputs were identical in every run (exit 1 if not). ``--compare-rounds N`` repeats the pair N times, each run on
a fresh engine, the order swapped every round (without/with, then with/without, ...), and reports each side's
median run. On this project's 2-core VMs one side's time moves by several percent from run to run (the run with
the host tier: 85-96 s within one session), so a single pair can land on either side of a target; alternating
the order keeps a slow spell, or any cost of coming second in the process, off one side only.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from folio.bench.datasets import MultiTurnWorkload, multi_turn_from_args
from folio.bench.rounds import median_run, num_rounds
from folio.bench.stepping import RequestStepper, run_stepped
from folio.core.sched_output import ModelRunnerOutput, SchedulerOutput

# The scheduler snapshot's counters a run reports, as differences over the run (getattr: 0 where a core has none).
_COUNTERS = (
    "num_preemptions_total",
    "num_swapped_preemptions_total",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "external_prefix_cache_queries",
    "external_prefix_cache_hits",
    "kv_offload_blocks_to_cpu_total",
    "kv_offload_blocks_to_device_total",
)


class ComputeCounter:
    """Wraps the engine core's executor and counts, from each SchedulerOutput, the tokens the forward computes and
    those it computes again for a request that had computed them before (after a recompute preemption)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.forwarded = 0
        self.recomputed = 0
        self._high_water: dict[str, int] = {}  # request id -> positions computed so far

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        starts = {r.req_id: r.num_computed_tokens for r in sched.scheduled_new_reqs}
        cached = sched.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, count in sched.num_scheduled_tokens.items():
            start, high = starts[req_id], self._high_water.get(req_id, 0)
            self.forwarded += count
            self.recomputed += max(0, min(start + count, high) - start)
            self._high_water[req_id] = max(high, start + count)
        return self.inner.execute_model(sched)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class MultiTurnRun:
    label: str
    num_host_blocks: int
    preemption_mode: str
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    ttfts_s: list[float]
    forwarded_tokens: int
    recomputed_tokens: int  # tokens computed again after preemption (0 where swap brings them back)
    counters: dict[str, int] = field(default_factory=dict)
    replies: list[list[list[int]]] = field(default_factory=list)  # [conversation][turn] -> output token ids

    @property
    def tokens_per_second(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttfts_s) / len(self.ttfts_s)

    def lines(self) -> list[str]:
        c = self.counters
        return [
            f"Throughput: {self.tokens_per_second:.2f} total tokens/s ({self.prompt_tokens} prompt + "
            f"{self.output_tokens} output tokens in {self.elapsed_s:.2f} s); "
            f"mean TTFT {1000 * self.mean_ttft_s:.1f} ms",
            f"Preemptions: {c['num_preemptions_total']} ({c['num_swapped_preemptions_total']} by swap); tokens "
            f"recomputed after preemption: {self.recomputed_tokens}; tokens forwarded: {self.forwarded_tokens}",
            f"Prefix cache hits: device {c['prefix_cache_hits']} of {c['prefix_cache_queries']} tokens, host tier "
            f"{c['external_prefix_cache_hits']} of {c['external_prefix_cache_queries']}; blocks to CPU "
            f"{c['kv_offload_blocks_to_cpu_total']}, to device {c['kv_offload_blocks_to_device_total']}",
        ]


def _counters(engine: Any) -> dict[str, int]:
    stats = engine.engine_core.scheduler.get_stats()
    return {name: int(getattr(stats, name, 0)) for name in _COUNTERS}


def _run_wave(engine: Any, prompts: list[list[int]], output_len: int) -> tuple[list[list[int]], list[float]]:
    """Every prompt queued at once, stepped to completion: (output ids, TTFT seconds) in the prompts' order."""
    from folio.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    run = run_stepped(engine, prompts, [params] * len(prompts))
    return [r.output_ids for r in run.requests], [r.ttft_s for r in run.requests]


@dataclass
class _Served:
    """What serving the workload gave: every conversation's replies, each request's TTFT, the prompt tokens sent,
    and the seconds on the clock."""

    replies: list[list[list[int]]]
    ttfts_s: list[float]
    prompt_tokens: int
    elapsed_s: float


def _serve_in_waves(engine: Any, workload: MultiTurnWorkload) -> _Served:
    replies: list[list[list[int]]] = [[] for _ in workload.user_turns]
    served = _Served(replies, [], 0, 0.0)
    for turn in range(workload.num_turns):
        prompts = [workload.turn_prompt(c, turn, replies[c]) for c in range(len(replies))]
        start = time.perf_counter()
        outputs, wave_ttfts = _run_wave(engine, prompts, workload.output_len)
        served.elapsed_s += time.perf_counter() - start
        served.ttfts_s += wave_ttfts
        served.prompt_tokens += sum(len(p) for p in prompts)
        for c, output in enumerate(outputs):
            replies[c].append(output)
    return served


def _serve_closed_loop(engine: Any, workload: MultiTurnWorkload) -> _Served:
    from folio.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=workload.output_len, ignore_eos=True)
    stepper = RequestStepper(engine)
    served = _Served([[] for _ in workload.user_turns], [], 0, 0.0)
    conversation_of: dict[str, int] = {}  # request id -> its conversation

    def send_next_turn(c: int) -> None:
        prompt = workload.turn_prompt(c, len(served.replies[c]), served.replies[c])
        served.prompt_tokens += len(prompt)
        conversation_of[stepper.add(prompt, params)] = c

    for c in range(len(served.replies)):
        send_next_turn(c)
    while stepper.has_unfinished():
        for request_id, request in stepper.step().items():
            c = conversation_of.pop(request_id)
            served.replies[c].append(request.output_ids)
            served.ttfts_s.append(request.ttft_s)
            if len(served.replies[c]) < workload.num_turns:
                send_next_turn(c)
    served.elapsed_s = stepper.now()
    return served


ARRIVALS = {"waves": _serve_in_waves, "closed-loop": _serve_closed_loop}


def run_multi_turn(llm: Any, workload: MultiTurnWorkload, label: str, arrival: str = "waves") -> MultiTurnRun:
    """The workload on ``llm`` with the given arrival pattern (a warm-up request first, outside the clock and the
    counts)."""
    engine = llm.llm_engine
    _run_wave(engine, [workload.system_prompt[:16] or [1]], 2)  # first-use costs (kernels, allocator) off the clock
    counter = ComputeCounter(engine.engine_core.executor)
    engine.engine_core.executor = counter
    before = _counters(engine)
    try:
        served = ARRIVALS[arrival](engine, workload)
    finally:
        engine.engine_core.executor = counter.inner
    after = _counters(engine)
    config = engine.config
    num_host_blocks = config.cache_config.num_host_blocks
    mode = config.scheduler_config.preemption_mode or ("swap" if num_host_blocks else "recompute")
    return MultiTurnRun(
        label=label,
        num_host_blocks=num_host_blocks,
        preemption_mode=mode,
        elapsed_s=served.elapsed_s,
        prompt_tokens=served.prompt_tokens,
        output_tokens=sum(len(r) for conv in served.replies for r in conv),
        ttfts_s=served.ttfts_s,
        forwarded_tokens=counter.forwarded,
        recomputed_tokens=counter.recomputed,
        counters={name: after[name] - before[name] for name in _COUNTERS},
        replies=served.replies,
    )


def _describe(llm: Any, workload: MultiTurnWorkload, ns: argparse.Namespace) -> str:
    cache = llm.llm_engine.config.cache_config
    working_blocks = -(-workload.working_set_tokens() // cache.block_size)
    return (
        f"Multi-turn chat: {len(workload.user_turns)} conversations x {workload.num_turns} turns (system "
        f"{ns.multi_turn_system_len}, user {ns.multi_turn_user_len}, output {workload.output_len} tokens); working "
        f"set {working_blocks} blocks of {cache.block_size} tokens; device KV pool {cache.num_blocks} blocks "
        f"({100 * cache.num_blocks / working_blocks:.0f}% of it); host tier {cache.num_host_blocks} blocks; "
        f"turns arrive {'in waves' if ns.multi_turn_arrival == 'waves' else 'closed-loop'}; --dtype {ns.dtype}, "
        f"--kv-cache-dtype {ns.kv_cache_dtype}"
    )


def _one_run(ns: argparse.Namespace, label: str, **overrides: Any) -> tuple[MultiTurnRun, str]:
    from folio.bench.offline import _make_llm, _special_ids

    llm = _make_llm(ns, **overrides)
    workload = multi_turn_from_args(ns, llm.llm_engine.model_spec.vocab_size, _special_ids(llm))
    description = _describe(llm, workload, ns)
    run = run_multi_turn(llm, workload, label, ns.multi_turn_arrival)
    del llm
    gc.collect()  # the next run's engine takes its KV cache and host tier
    return run, description


def _compare_offloading(ns: argparse.Namespace, rounds: int) -> tuple[list[MultiTurnRun], list[MultiTurnRun], str]:
    """``rounds`` runs of each side, alternating which goes first: (without runs, with runs, description)."""
    base_runs: list[MultiTurnRun] = []
    tier_runs: list[MultiTurnRun] = []
    description = ""
    for r in range(rounds):
        sides = [False, True] if r % 2 == 0 else [True, False]
        for with_tier in sides:
            if with_tier:
                run, description = _one_run(ns, "with host tier")
                tier_runs.append(run)
            else:
                base_runs.append(_one_run(ns, "without host tier", kv_offloading_size=0.0, preemption_mode=None)[0])
    return base_runs, tier_runs, description


def cmd_multi_turn(ns: argparse.Namespace) -> int:
    if not ns.compare_offloading:
        run, description = _one_run(ns, "run")
        print(description)
        print("\n".join(run.lines()))
        _write(ns.output_json, {"run": _summary(run)})
        return 0
    if not ns.kv_offloading_size > 0:
        raise ValueError("--compare-offloading needs --kv-offloading-size > 0 (the host tier of the second run)")
    rounds = num_rounds(ns.compare_rounds, default=1)  # a round of the default workload takes minutes
    base_runs, tier_runs, description = _compare_offloading(ns, rounds)
    base, tier = median_run(base_runs), median_run(tier_runs)
    print(description)
    if rounds > 1:
        print(f"Each side's median of {rounds} runs (the order swapped every round); every run's elapsed seconds:")
        for runs in (base_runs, tier_runs):
            print(f"  {runs[0].label}: " + ", ".join(f"{run.elapsed_s:.2f}" for run in runs))
    for run in (base, tier):
        print(f"--- {run.label} ({run.num_host_blocks} host blocks, preemption {run.preemption_mode})")
        print("\n".join(run.lines()))
    identical = all(run.replies == base_runs[0].replies for run in base_runs + tier_runs)
    num_turns = sum(len(conv) for conv in base.replies)
    throughput_ratio = tier.tokens_per_second / base.tokens_per_second
    ttft_ratio = tier.mean_ttft_s / base.mean_ttft_s
    print(f"Ratio (with / without host tier): total throughput {throughput_ratio:.2f}x, mean TTFT {ttft_ratio:.2f}x")
    print(
        f"Tokens recomputed after preemption: {tier.preemption_mode} {tier.recomputed_tokens}, "
        f"{base.preemption_mode} {base.recomputed_tokens}"
    )
    every = f", every one of {2 * rounds} runs" if rounds > 1 else ""
    print(f"Greedy outputs identical: {'yes' if identical else 'NO'} ({num_turns} turns{every})")
    moved = tier.counters["kv_offload_blocks_to_cpu_total"] + tier.counters["kv_offload_blocks_to_device_total"]
    if moved == 0:
        print("Note: the host tier moved no block in this run: both runs did the same work, any ratio is noise")
    result = {
        "without": _summary(base),
        "with": _summary(tier),
        "rounds": rounds,
        "elapsed_s": {"without": [r.elapsed_s for r in base_runs], "with": [r.elapsed_s for r in tier_runs]},
        "throughput_ratio": throughput_ratio,
        "mean_ttft_ratio": ttft_ratio,
        "greedy_identical": identical,
    }
    _write(ns.output_json, result)
    return 0 if identical else 1


def _summary(run: MultiTurnRun) -> dict[str, Any]:
    summary = asdict(run)
    del summary["replies"]
    return {**summary, "tokens_per_second": run.tokens_per_second, "mean_ttft_s": run.mean_ttft_s}


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)

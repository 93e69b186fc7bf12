"""`folio bench throughput --compare-speculative`: the request set on two engines in one command, without and with
the ``--speculative-config`` given (every other engine flag the same), in alternating rounds (``--compare-rounds``,
the median round of each side reported), greedy, step by step so that each request's TTFT and TPOT are measured
(folio.bench.stepping). Prints both sides, the ratios, the output tokens each request got per engine step it took
part in (1.0 without speculation; the mean accepted drafts + 1 with it), and whether the greedy outputs were
identical in every round (exit 1 if not). Issue 19's targets read off it: TPOT at batch 1 (``--max-num-seqs 1``),
throughput at batch 8, and the cost on W1.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from typing import Any

from folio.bench.datasets import SampleRequest
from folio.bench.rounds import median_run, num_rounds
from folio.bench.stepping import SteppedRun, run_stepped


@dataclass
class SpecRun:
    label: str
    run: SteppedRun

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.run.requests)

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.run.elapsed_s

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(r.ttft_s for r in self.run.requests)

    @property
    def mean_tpot_s(self) -> float:
        tpots = [t for t in (r.tpot_s for r in self.run.requests) if t is not None]
        return statistics.fmean(tpots) if tpots else float("nan")

    @property
    def tokens_per_request_step(self) -> float:
        """Output tokens after each request's first, per engine step that returned tokens for it."""
        tokens = sum(max(0, len(r.output_ids) - 1) for r in self.run.requests)
        steps = sum(r.decode_steps for r in self.run.requests)
        return tokens / steps if steps else float("nan")

    def line(self) -> str:
        return (
            f"{self.label}: {self.output_tokens_per_second:.2f} output tok/s ({self.output_tokens} tokens in "
            f"{self.run.elapsed_s:.2f} s, {self.run.num_steps} steps); mean TTFT {1000 * self.mean_ttft_s:.1f} ms, "
            f"mean TPOT {1000 * self.mean_tpot_s:.2f} ms; {self.tokens_per_request_step:.2f} tokens per request step"
        )

    def summary(self) -> dict[str, Any]:
        return {
            "elapsed_s": self.run.elapsed_s,
            "num_steps": self.run.num_steps,
            "output_tokens": self.output_tokens,
            "output_tokens_per_second": self.output_tokens_per_second,
            "mean_ttft_s": self.mean_ttft_s,
            "mean_tpot_s": self.mean_tpot_s,
            "tokens_per_request_step": self.tokens_per_request_step,
        }


def _engine(ns: argparse.Namespace, **overrides: Any) -> tuple[Any, list[SampleRequest], list[Any]]:
    """An engine for the flags (with ``overrides``), warmed up, with the request set and its sampling params."""
    from folio.bench.offline import _make_llm, dataset_requests
    from folio.sampling_params import SamplingParams

    llm = _make_llm(ns, **overrides)
    requests = dataset_requests(llm, ns)
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=r.ignore_eos) for r in requests]
    warm_up = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    run_stepped(llm.llm_engine, [requests[0].prompt_token_ids], [warm_up])  # first-use costs off the clock
    return llm, requests, params


def cmd_compare_speculative(ns: argparse.Namespace) -> int:
    if not ns.speculative_config:
        raise ValueError("--compare-speculative needs --speculative-config (the second run's speculation)")
    if ns.dataset_name == "multi_turn":
        raise ValueError("--compare-speculative does not run the multi_turn dataset")
    rounds = num_rounds(ns.compare_rounds, default=3)
    base_llm, requests, params = _engine(ns, speculative_config=None)
    spec_llm, _, _ = _engine(ns)
    prompts = [r.prompt_token_ids for r in requests]
    base_runs: list[SteppedRun] = []
    spec_runs: list[SteppedRun] = []
    for _ in range(rounds):
        for llm, runs in ((base_llm, base_runs), (spec_llm, spec_runs)):
            if not llm.reset_prefix_cache():  # every round prefills its prompts, as the first did
                raise RuntimeError("the prefix cache could not be reset: a request still holds blocks")
            runs.append(run_stepped(llm.llm_engine, prompts, params))
    base = SpecRun("without speculation", median_run(base_runs))
    spec = SpecRun(f"with {ns.speculative_config}", median_run(spec_runs))
    mean_prompt = statistics.fmean(r.prompt_len for r in requests)
    print(
        f"{len(requests)} requests of {ns.dataset_name} (mean prompt {mean_prompt:.0f} tokens), greedy, "
        f"max_num_seqs {ns.max_num_seqs}; the median of {rounds} alternating rounds per side"
    )
    for run in (base, spec):
        print(run.line())
    throughput_ratio = spec.output_tokens_per_second / base.output_tokens_per_second
    tpot_ratio = base.mean_tpot_s / spec.mean_tpot_s
    print(
        f"Ratio (with / without speculation): output throughput {throughput_ratio:.2f}x; "
        f"mean TPOT {tpot_ratio:.2f}x lower"
    )
    reference = [r.output_ids for r in base_runs[0].requests]
    identical = all([r.output_ids for r in run.requests] == reference for run in base_runs + spec_runs)
    print(f"Greedy outputs identical: {'yes' if identical else 'NO'} ({len(requests)} requests, every round)")
    result = {
        "without": base.summary(),
        "with": spec.summary(),
        "throughput_ratio": throughput_ratio,
        "tpot_ratio": tpot_ratio,
        "greedy_identical": identical,
    }
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if identical else 1

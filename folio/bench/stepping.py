"""Runs a set of requests through an in-process engine step by step, timing each request: the offline benchmarks
that report per-request latency (TTFT, TPOT) and the engine steps a token took, which `LLM.generate` hides."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class SteppedRequest:
    """One request's output ids and its times from the set's start: the step that returned its first token and
    the step that finished it."""

    output_ids: list[int]
    ttft_s: float
    e2e_s: float
    decode_steps: int  # steps after the first that returned tokens for it (a step may return several)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None for a single token)."""
        n = len(self.output_ids)
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None


@dataclass
class SteppedRun:
    requests: list[SteppedRequest]  # in the prompts' order
    elapsed_s: float
    num_steps: int


def run_stepped(engine: Any, prompts: list[list[int]], params: list[Any]) -> SteppedRun:
    """Queues every prompt at once (token ids, with its SamplingParams) and steps the engine until all finish."""
    from folio.engine.output_processor import RequestOutputKind

    ids = [engine.next_request_id() for _ in prompts]
    start = time.perf_counter()
    for request_id, prompt, sampling in zip(ids, prompts, params, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling, 0, RequestOutputKind.CUMULATIVE)
    first: dict[str, float] = {}
    seen: dict[str, int] = {}
    steps_with_tokens: dict[str, int] = {}
    done: dict[str, tuple[list[int], float]] = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        num_steps += 1
        now = time.perf_counter() - start
        for out in outputs:
            tokens = out.outputs[0].token_ids
            if len(tokens) > seen.get(out.request_id, 0):
                if out.request_id in first:
                    steps_with_tokens[out.request_id] = steps_with_tokens.get(out.request_id, 0) + 1
                else:
                    first[out.request_id] = now
                seen[out.request_id] = len(tokens)
            if out.finished:
                done[out.request_id] = (list(tokens), now)
    elapsed = time.perf_counter() - start
    requests = [
        SteppedRequest(done[r][0], first.get(r, done[r][1]), done[r][1], steps_with_tokens.get(r, 0)) for r in ids
    ]
    return SteppedRun(requests, elapsed, num_steps)

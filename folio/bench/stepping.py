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


class RequestStepper:
    """An in-process engine stepped by hand: requests join at any step, each timed from its own submission (TTFT:
    to the step that returned its first token; e2e: to the step that finished it)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.start = time.perf_counter()
        self.num_steps = 0
        self._submitted: dict[str, float] = {}
        self._first: dict[str, float] = {}
        self._seen: dict[str, int] = {}
        self._steps_with_tokens: dict[str, int] = {}

    def now(self) -> float:
        return time.perf_counter() - self.start

    def add(self, prompt: list[int], params: Any) -> str:
        """Queues ``prompt`` (token ids) with its SamplingParams; returns its request id."""
        from folio.engine.output_processor import RequestOutputKind

        request_id = self.engine.next_request_id()
        self._submitted[request_id] = self.now()
        self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params, 0, RequestOutputKind.CUMULATIVE)
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def step(self) -> dict[str, SteppedRequest]:
        """One engine step; the requests it finished, by request id."""
        outputs = self.engine.step()
        self.num_steps += 1
        now = self.now()
        finished = {}
        for out in outputs:
            request_id, tokens = out.request_id, out.outputs[0].token_ids
            if len(tokens) > self._seen.get(request_id, 0):
                if request_id in self._first:
                    self._steps_with_tokens[request_id] = self._steps_with_tokens.get(request_id, 0) + 1
                else:
                    self._first[request_id] = now
                self._seen[request_id] = len(tokens)
            if out.finished:
                submitted = self._submitted.pop(request_id)
                first = self._first.pop(request_id, now)
                steps = self._steps_with_tokens.pop(request_id, 0)
                self._seen.pop(request_id, None)
                finished[request_id] = SteppedRequest(list(tokens), first - submitted, now - submitted, steps)
        return finished


def run_stepped(engine: Any, prompts: list[list[int]], params: list[Any]) -> SteppedRun:
    """Queues every prompt at once (token ids, with its SamplingParams) and steps the engine until all finish."""
    stepper = RequestStepper(engine)
    ids = [stepper.add(prompt, sampling) for prompt, sampling in zip(prompts, params, strict=True)]
    done: dict[str, SteppedRequest] = {}
    while stepper.has_unfinished():
        done.update(stepper.step())
    return SteppedRun([done[r] for r in ids], stepper.now(), stepper.num_steps)

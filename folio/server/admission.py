"""Admission control: the server counts the engine requests it let in and refuses new ones at once (503).

The count is the server's own, not the engine core's last report: a burst lands between two core steps, when
the core still reports an empty queue. ``Admission.admit`` checks and charges in one synchronous call (no await
between them), so however many handlers run at once, no more than the limit get in.

What is counted:
- requests: engine requests, i.e. prompts x n (a /v1/completions call with 3 prompts and n=2 holds 6 slots, as
  many as the core schedules). The limit is --max-num-seqs + --max-num-queued-reqs: the running batch plus the
  queue behind it.
- queued tokens (--max-num-queued-tokens): the prompt tokens still awaiting prefill, i.e. of admitted prompts
  that have produced no output yet (vLLM's meaning: the prefill backlog). A prompt counts once however large n
  is (its n samples share the prompt's KV blocks). A prompt arriving while the backlog is empty is admitted
  whatever its size (it is bounded by --max-model-len), so no prompt is refused forever. A preempted request's
  recomputation is not counted again.

Every admitted request holds a ``Ticket`` that gives its slots back exactly once: per prompt when that prompt's
engine stream ends (``Ticket.track``), and all that is left when the handler or the streamed response ends
(``Ticket.release``), whatever ended it (finish, error, disconnect, abort, drain).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from folio.server.errors import APIError, bad_request

T = TypeVar("T")

# What a refused client is told to wait before retrying. Requests here last seconds; 1 s spreads retries out
# without leaving capacity idle for long.
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class AdmissionLimits:
    """The flags, with vLLM's names; None: no limit."""

    max_num_seqs: int = 1
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None

    @property
    def max_num_reqs(self) -> int | None:
        """Engine requests running plus queued."""
        return None if self.max_num_queued_reqs is None else self.max_num_seqs + self.max_num_queued_reqs

    def describe_reqs(self) -> str:
        return f"--max-num-seqs {self.max_num_seqs} + --max-num-queued-reqs {self.max_num_queued_reqs}"


class Admission:
    """The server's count of engine requests in flight (admitted, not finished) and of prompt tokens queued."""

    def __init__(self, limits: AdmissionLimits | None = None) -> None:
        self.limits = limits or AdmissionLimits()
        self.num_in_flight = 0
        self.num_queued_tokens = 0
        self.num_refused = 0

    def admit(self, prompt_lens: Sequence[int], n: int) -> Ticket:
        """Charges ``len(prompt_lens) * n`` requests and the prompts' tokens, or raises without charging anything:
        503 (with Retry-After) when the server is full now, 400 when the request could never fit."""
        num_requests = len(prompt_lens) * n
        num_tokens = sum(prompt_lens)
        max_reqs = self.limits.max_num_reqs
        if max_reqs is not None:
            if num_requests > max_reqs:
                raise bad_request(
                    f"this request needs {num_requests} engine requests ({len(prompt_lens)} prompt(s) x n={n}), "
                    f"more than this server ever runs and queues at once ({max_reqs}: {self.limits.describe_reqs()})",
                    param="n" if n > 1 else "prompt",
                )
            if self.num_in_flight + num_requests > max_reqs:
                raise self._refuse(
                    f"{self.num_in_flight} requests are running or queued and this one adds {num_requests}; the "
                    f"limit is {max_reqs} ({self.limits.describe_reqs()})"
                )
        max_tokens = self.limits.max_num_queued_tokens
        if max_tokens is not None and self.num_queued_tokens > 0 and self.num_queued_tokens + num_tokens > max_tokens:
            raise self._refuse(
                f"{self.num_queued_tokens} prompt tokens await prefill and this request adds {num_tokens}; the "
                f"limit is --max-num-queued-tokens {max_tokens}"
            )
        self.num_in_flight += num_requests
        self.num_queued_tokens += num_tokens
        return Ticket(self, [(n, length) for length in prompt_lens])

    def _refuse(self, reason: str) -> APIError:
        self.num_refused += 1
        return APIError(
            503,
            f"The server is overloaded: {reason}. Retry after {RETRY_AFTER_S} s.",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def _give_back(self, num_requests: int, num_tokens: int) -> None:
        self.num_in_flight -= num_requests
        self.num_queued_tokens -= num_tokens
        assert self.num_in_flight >= 0 and self.num_queued_tokens >= 0, "admission released more than it charged"


class Ticket:
    """One admitted HTTP request's charge, per prompt: (slots held, prompt tokens still awaiting prefill)."""

    def __init__(self, admission: Admission, parts: list[tuple[int, int]]) -> None:
        self._admission = admission
        self._slots = [num_requests for num_requests, _ in parts]
        self._queued_tokens = [num_tokens for _, num_tokens in parts]

    @property
    def num_held(self) -> int:
        return sum(self._slots)

    def prefill_done(self, index: int) -> None:
        """Prompt ``index`` produced output: its tokens leave the queued-token count."""
        tokens, self._queued_tokens[index] = self._queued_tokens[index], 0
        self._admission._give_back(0, tokens)

    def finish(self, index: int) -> None:
        """Prompt ``index``'s engine requests ended: its slots (and tokens, if still queued) come back. Idempotent."""
        slots, self._slots[index] = self._slots[index], 0
        tokens, self._queued_tokens[index] = self._queued_tokens[index], 0
        self._admission._give_back(slots, tokens)

    def release(self) -> None:
        """Gives back everything still held. Idempotent: safe from every exit path."""
        for index in range(len(self._slots)):
            self.finish(index)

    async def track(self, index: int, generator: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        """Wraps prompt ``index``'s engine stream: its first output ends its prefill wait, its end (finished,
        failed or closed) frees its slots. Closing the wrapper closes (aborts) the engine stream."""
        try:
            async for item in generator:
                self.prefill_done(index)
                yield item
        finally:
            self.finish(index)
            await generator.aclose()


class AdmissionCollector(Collector):
    """The admission counts in /metrics, read at scrape time."""

    def __init__(self, admission: Admission, model_name: str) -> None:
        self.admission = admission
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name"]
        in_flight = GaugeMetricFamily(
            "folio:num_requests_in_flight",
            "Engine requests the server admitted and has not finished (running + queued, as the server counts).",
            labels=labels,
        )
        in_flight.add_metric([self.model_name], self.admission.num_in_flight)
        tokens = GaugeMetricFamily(
            "folio:num_queued_prompt_tokens",
            "Prompt tokens of admitted requests still awaiting prefill (what --max-num-queued-tokens limits).",
            labels=labels,
        )
        tokens.add_metric([self.model_name], self.admission.num_queued_tokens)
        refused = CounterMetricFamily(
            "folio:num_requests_refused", "Requests refused with 503 because the server was full.", labels=labels
        )
        refused.add_metric([self.model_name], self.admission.num_refused)
        yield from (in_flight, tokens, refused)


def register_admission_metrics(registry: CollectorRegistry, admission: Admission, model_name: str) -> None:
    registry.register(AdmissionCollector(admission, model_name))

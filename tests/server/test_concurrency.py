"""Many streams at once, and clients that go away: their requests are aborted and every KV block comes back."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from tests.server.conftest import MODEL_NAME, ServerProcess, metric, parse_metrics, wait_until

FINISH_REASONS = ("abort", "length", "stop")
TOPICS = ["the sea", "a robot", "music", "winter", "a small town", "coffee", "the moon", "trains"]


def test_32_concurrent_streams_equal_sequential(client: Any, async_client_factory: Any) -> None:
    prompts = [f"Write one sentence about {TOPICS[i % 8]} (#{i}):" for i in range(32)]

    async def stream_one(aclient: Any, prompt: str) -> str:
        stream = await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True
        )
        text = ""
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
        return text

    async def run_all() -> list[str]:
        aclient = async_client_factory()
        try:
            return list(await asyncio.gather(*(stream_one(aclient, p) for p in prompts)))
        finally:
            await aclient.close()

    concurrent = asyncio.run(run_all())
    assert all(concurrent)
    # Each of the 8 topics, one request at a time (every third prompt: 11 of the 32; all 32 one by one were 320
    # decode steps of one row, two thirds of the test's time).
    checked = range(0, len(prompts), 3)
    sequential = [
        client.completions.create(model=MODEL_NAME, prompt=prompts[i], max_tokens=10, temperature=0).choices[0].text
        for i in checked
    ]
    assert [concurrent[i] for i in checked] == sequential


def _kv_free(server: ServerProcess) -> bool:
    values = server.metrics()
    return (
        metric(values, "folio:kv_cache_usage_perc") == 0.0
        and metric(values, "folio:num_requests_running") == 0.0
        and metric(values, "folio:num_requests_waiting") == 0.0
    )


def _finished_counts(server: ServerProcess) -> dict[str, float]:
    """folio:request_success_total by finish reason."""
    values = server.metrics()
    return {reason: metric(values, "folio:request_success_total", finished_reason=reason) for reason in FINISH_REASONS}


def _finished_since(server: ServerProcess, before: dict[str, float]) -> dict[str, float]:
    now = _finished_counts(server)
    return {reason: now[reason] - before[reason] for reason in FINISH_REASONS}


# The most tokens the shared server's context allows (max-model-len 1024), without EOS.
LONG_BODY = {"prompt": "Tell me a very long story.", "max_tokens": 1000, "ignore_eos": True}
HANG_GUARD_S = 300.0


async def _core_counts(aclient: httpx.AsyncClient, server: ServerProcess) -> tuple[float, float]:
    """(running, waiting) as the engine core last reported them."""
    values = parse_metrics((await aclient.get(server.url("/metrics"))).text)
    return metric(values, "folio:num_requests_running"), metric(values, "folio:num_requests_waiting")


async def _wait_for_counts(aclient: httpx.AsyncClient, server: ServerProcess, done: Any) -> None:
    """Polls the core's (running, waiting) until ``done(running, waiting)``; the timeout only guards a hang."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not done(*(counts := await _core_counts(aclient, server))):
        assert time.monotonic() < deadline, f"(running, waiting) stuck at {counts}"
        await asyncio.sleep(0.05)


class Sentinel:
    """A long stream opened before the requests under test, with the same length: had those run to their end
    instead of being aborted, it would have ended no later than they did (it is ahead of them, and first come
    first served never preempts the earliest request). So while the core runs only it, the others were aborted."""

    def __init__(self, aclient: httpx.AsyncClient, server: ServerProcess) -> None:
        self.aclient, self.server = aclient, server
        self.started, self.stop = asyncio.Event(), asyncio.Event()
        self.finish_reasons: list[str] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        body = {**LONG_BODY, "stream": True}
        async with self.aclient.stream("POST", self.server.url("/v1/completions"), json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    self.started.set()
                    reason = json.loads(line[len("data: ") :])["choices"][0]["finish_reason"]
                    self.finish_reasons += [reason] if reason else []
                if self.stop.is_set():
                    return  # hang up: the sentinel is aborted too

    async def wait_alone_then_drop(self) -> None:
        """Waits until the core runs the sentinel only, then hangs it up; it must not have finished by then."""

        def alone_or_finished(running: float, waiting: float) -> bool:
            return (running == 1 and waiting == 0) or bool(self.finish_reasons)

        await _wait_for_counts(self.aclient, self.server, alone_or_finished)
        self.stop.set()
        await asyncio.wait_for(self.task, HANG_GUARD_S)
        assert self.finish_reasons == [], "the sentinel finished: the requests under test were not aborted"


def test_dropped_streams_are_aborted(server: ServerProcess) -> None:
    """50 long streams; each client reads its first chunk and hangs up. All 50 are aborted (none ran to its end),
    their KV blocks all come back, and a new request is served."""
    body = {**LONG_BODY, "stream": True}
    before = _finished_counts(server)

    async def open_and_drop(aclient: httpx.AsyncClient) -> None:
        async with aclient.stream("POST", server.url("/v1/completions"), json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # leave with the stream unfinished: the connection is closed

    async def run() -> None:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=HANG_GUARD_S, limits=limits) as aclient:
            sentinel = Sentinel(aclient, server)
            await asyncio.wait_for(sentinel.started.wait(), HANG_GUARD_S)
            await asyncio.gather(*(open_and_drop(aclient) for _ in range(50)))
            await sentinel.wait_alone_then_drop()

    asyncio.run(run())
    assert wait_until(lambda: _kv_free(server), timeout_s=HANG_GUARD_S), server.metrics()
    assert _finished_since(server, before) == {"abort": 51, "length": 0, "stop": 0}
    response = httpx.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert response.status_code == 200


def test_disconnected_non_streaming_requests_are_aborted(server: ServerProcess) -> None:
    """5 long non-streaming requests; once all 5 run, the clients hang up. All 5 are aborted, none ran to its end."""
    before = _finished_counts(server)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as aclient:
            sentinel = Sentinel(aclient, server)
            await asyncio.wait_for(sentinel.started.wait(), HANG_GUARD_S)
            url = server.url("/v1/completions")
            tasks = [asyncio.create_task(aclient.post(url, json=LONG_BODY)) for _ in range(5)]
            await _wait_for_counts(aclient, server, lambda running, waiting: running == 6)
            for task in tasks:
                task.cancel()  # closes each connection mid-request
            await asyncio.gather(*tasks, return_exceptions=True)
            await sentinel.wait_alone_then_drop()

    asyncio.run(run())
    assert wait_until(lambda: _kv_free(server), timeout_s=HANG_GUARD_S), server.metrics()
    assert _finished_since(server, before) == {"abort": 6, "length": 0, "stop": 0}

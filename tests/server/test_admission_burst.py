"""A burst against the request limit: with --max-num-seqs 2 --max-num-queued-reqs 4, of N simultaneous long
requests exactly 2 + 4 get in and N - 6 get 503 with Retry-After; once the admitted ones are dropped, nothing is
left in flight and the server serves normally."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess, metric, parse_metrics, server_is_idle, start_server, wait_until

MAX_NUM_SEQS, MAX_NUM_QUEUED_REQS = 2, 4
MAX_NUM_QUEUED_TOKENS = 1000  # far above the burst's prompts (6 x under 50 tokens)
NUM_REQUESTS = 30
HANG_GUARD_S = 120.0
# Long enough to still run when the burst is judged: 2 run at a time, each for 1000 tokens.
LONG = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def burst_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-queued-reqs", str(MAX_NUM_QUEUED_REQS)]
    args += ["--max-num-queued-tokens", str(MAX_NUM_QUEUED_TOKENS)]
    proc = start_server(Path(tmp_path_factory.mktemp("burst")), "burst", args)
    yield proc
    proc.stop()


def _request(index: int) -> tuple[str, dict[str, Any]]:
    """Every fourth request alike: completions and chat, streamed and whole."""
    stream = index % 2 == 0
    if index % 4 < 2:
        return "/v1/completions", {"prompt": f"Tell me a long story (#{index}).", "stream": stream, **LONG}
    messages = [{"role": "user", "content": f"Tell me a long story (#{index})."}]
    return "/v1/chat/completions", {"messages": messages, "stream": stream, **LONG}


class Outcome:
    """What one client saw: its status and headers (None while it waits for them)."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: httpx.Headers | None = None
        self.body: Any = None


async def _send(aclient: httpx.AsyncClient, server: ServerProcess, index: int, outcome: Outcome) -> None:
    """Sends the request and, if it is admitted, holds it open until cancelled."""
    path, body = _request(index)
    async with aclient.stream("POST", server.url(path), json=body) as response:
        outcome.status, outcome.headers = response.status_code, response.headers
        if response.status_code != 200:
            outcome.body = (await response.aread()).decode()
            return
        async for _ in response.aiter_lines():
            pass


async def _core_counts(aclient: httpx.AsyncClient, server: ServerProcess) -> tuple[float, float]:
    values = parse_metrics((await aclient.get(server.url("/metrics"))).text)
    return metric(values, "folio:num_requests_running"), metric(values, "folio:num_requests_waiting")


async def _wait_for(aclient: httpx.AsyncClient, server: ServerProcess, done: Any) -> dict[str, float]:
    """Polls /metrics until ``done(values)``; the timeout only guards a hang."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not done(values := parse_metrics((await aclient.get(server.url("/metrics"))).text)):
        assert time.monotonic() < deadline, values
        await asyncio.sleep(0.05)
    return values


def test_burst_admits_running_plus_queued_and_refuses_the_rest(burst_server: ServerProcess) -> None:
    server = burst_server
    outcomes = [Outcome() for _ in range(NUM_REQUESTS)]

    async def run() -> tuple[float, float]:
        limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
        async with httpx.AsyncClient(timeout=HANG_GUARD_S, limits=limits) as aclient:
            tasks = [asyncio.create_task(_send(aclient, server, i, o)) for i, o in enumerate(outcomes)]
            # Judged once every request is either answered with a refusal or inside the engine core.
            deadline = time.monotonic() + HANG_GUARD_S
            while True:
                refused = sum(o.status is not None and o.status != 200 for o in outcomes)
                running, waiting = await _core_counts(aclient, server)
                if refused + running + waiting == NUM_REQUESTS:
                    break
                assert time.monotonic() < deadline, (refused, running, waiting)
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()  # the clients of the admitted requests hang up
            await asyncio.gather(*tasks, return_exceptions=True)
            return running, waiting

    running, waiting = asyncio.run(run())
    refusals = [o for o in outcomes if o.status is not None and o.status != 200]
    print(f"burst of {NUM_REQUESTS}: {len(refusals)} refused, core running {running:.0f} + waiting {waiting:.0f}")
    assert len(refusals) == NUM_REQUESTS - MAX_NUM_SEQS - MAX_NUM_QUEUED_REQS, [o.status for o in outcomes]
    assert (running, waiting) == (MAX_NUM_SEQS, MAX_NUM_QUEUED_REQS)
    for outcome in refusals:
        assert outcome.status == 503, outcome.body
        assert outcome.headers is not None and int(outcome.headers["retry-after"]) >= 1
        assert '"code":"queue_full"' in outcome.body and '"type":"service_unavailable_error"' in outcome.body

    # Every admitted request was dropped: nothing is left in flight, and the server serves again.
    assert wait_until(lambda: server_is_idle(server), HANG_GUARD_S), server.metrics()
    assert metric(server.metrics(), "folio:num_requests_refused_total") == len(refusals)  # the first test here
    response = httpx.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert response.status_code == 200, response.text


def test_queued_prompt_tokens_limit(burst_server: ServerProcess) -> None:
    """Both batch slots held by long streams; long prompts queue behind them and keep their tokens awaiting
    prefill. Two fit under --max-num-queued-tokens 1000, the third is refused (503, Retry-After) though a
    request slot is free."""
    server = burst_server
    prompt = "one two three four " * 100
    num_prompt_tokens = httpx.post(server.url("/tokenize"), json={"prompt": prompt}).json()["count"]
    assert 2 * num_prompt_tokens <= MAX_NUM_QUEUED_TOKENS < 3 * num_prompt_tokens
    url = server.url("/v1/completions")
    queued_body = {"prompt": prompt, "max_tokens": 1}

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as aclient:
            holders = [asyncio.create_task(_send(aclient, server, i * 4, Outcome())) for i in range(2)]

            def holders_running(values: dict[str, float]) -> bool:
                running = metric(values, "folio:num_requests_running")
                return running == 2 and metric(values, "folio:num_queued_prompt_tokens") == 0

            await _wait_for(aclient, server, holders_running)
            queued = []
            for i in range(2):
                queued.append(asyncio.create_task(aclient.post(url, json=queued_body)))

                def queued_behind(values: dict[str, float], num_queued: int = i + 1) -> bool:
                    tokens = metric(values, "folio:num_queued_prompt_tokens")
                    waiting = metric(values, "folio:num_requests_waiting")
                    return tokens == num_queued * num_prompt_tokens and waiting == num_queued

                await _wait_for(aclient, server, queued_behind)
            refused = await aclient.post(url, json=queued_body)
            for task in [*holders, *queued]:
                task.cancel()
            await asyncio.gather(*holders, *queued, return_exceptions=True)
            return refused

    refused = asyncio.run(run())
    assert refused.status_code == 503, refused.text
    assert int(refused.headers["retry-after"]) >= 1
    assert "--max-num-queued-tokens 1000" in refused.json()["error"]["message"]
    assert wait_until(lambda: server_is_idle(server), HANG_GUARD_S), server.metrics()

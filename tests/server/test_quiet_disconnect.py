"""A client that goes away mid-generation: its request is aborted (every KV block comes back) and the server logs
exactly one info line for it, "request X aborted: client disconnected", with no traceback."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from tests.server.conftest import ServerProcess, metric, parse_metrics, wait_until

HANG_GUARD_S = 120.0
LONG_BODY = {"prompt": "Tell me a very long story.", "max_tokens": 1000, "ignore_eos": True}
ABORT_LINE = re.compile(r"^INFO .*\[folio\] request (cmpl|chatcmpl)-[0-9a-f]{32} aborted: client disconnected$")


def _counts(server: ServerProcess) -> tuple[float, float, float]:
    """(running, KV usage, aborted so far) from /metrics."""
    values = server.metrics()
    return (
        metric(values, "folio:num_requests_running"),
        metric(values, "folio:kv_cache_usage_perc"),
        metric(values, "folio:request_success_total", finished_reason="abort"),
    )


async def _wait_running(aclient: httpx.AsyncClient, server: ServerProcess, running: float) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        values = parse_metrics((await aclient.get(server.url("/metrics"))).text)
        if metric(values, "folio:num_requests_running") == running:
            return
        assert time.monotonic() < deadline, "the request never started running"
        await asyncio.sleep(0.05)


def _hang_up_mid_generation(server: ServerProcess, open_request: Callable[[httpx.AsyncClient], Awaitable[Any]]) -> str:
    """Runs ``open_request`` until the core runs it, hangs up, waits for the abort; returns the log since the start."""
    assert wait_until(lambda: _counts(server)[:2] == (0.0, 0.0), HANG_GUARD_S), "the server was busy before the test"
    aborted_before = _counts(server)[2]
    offset = len(server.log_path.read_bytes())

    async def run() -> None:
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as aclient:
            task = asyncio.create_task(open_request(aclient))
            await _wait_running(aclient, server, 1.0)
            task.cancel()  # closes the connection mid-request
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())

    def logged() -> bool:
        return "aborted: client disconnected" in server.log_path.read_bytes()[offset:].decode(errors="replace")

    assert wait_until(lambda: _counts(server) == (0.0, 0.0, aborted_before + 1), HANG_GUARD_S), _counts(server)
    assert wait_until(logged, HANG_GUARD_S), server.log_tail()
    return server.log_path.read_bytes()[offset:].decode(errors="replace")


def _assert_one_quiet_line(log: str) -> None:
    lines = [line for line in log.splitlines() if "aborted: client disconnected" in line]
    assert len(lines) == 1, log
    assert ABORT_LINE.match(lines[0]), lines[0]
    assert "Traceback" not in log and "ERROR" not in log, log


def test_non_streaming_disconnect_is_one_info_line(server: ServerProcess) -> None:
    async def post(aclient: httpx.AsyncClient) -> None:
        await aclient.post(server.url("/v1/completions"), json=LONG_BODY)

    _assert_one_quiet_line(_hang_up_mid_generation(server, post))


def test_streaming_disconnect_is_one_info_line(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": LONG_BODY["prompt"]}], "max_tokens": 900, "ignore_eos": True}

    async def stream(aclient: httpx.AsyncClient) -> None:
        async with aclient.stream("POST", server.url("/v1/chat/completions"), json={**body, "stream": True}) as r:
            async for _ in r.aiter_lines():
                pass

    _assert_one_quiet_line(_hang_up_mid_generation(server, stream))

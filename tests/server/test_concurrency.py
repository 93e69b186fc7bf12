"""Many streams at once, and clients that go away: their requests are aborted and every KV block comes back."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from tests.server.conftest import MODEL_NAME, ServerProcess, metric, wait_until

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
    sequential = [
        client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=10, temperature=0).choices[0].text
        for p in prompts
    ]
    assert all(concurrent)
    assert concurrent == sequential


def _kv_free(server: ServerProcess) -> bool:
    values = server.metrics()
    return (
        metric(values, "folio:kv_cache_usage_perc") == 0.0
        and metric(values, "folio:num_requests_running") == 0.0
        and metric(values, "folio:num_requests_waiting") == 0.0
    )


def test_dropped_streams_are_aborted(server: ServerProcess) -> None:
    """50 long streams; each client reads its first chunk and hangs up. Their KV blocks must all come back."""
    body = {"prompt": "Tell me a very long story.", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    aborted_before = metric(server.metrics(), "folio:request_success_total", finished_reason="abort")

    async def open_and_drop(aclient: httpx.AsyncClient) -> None:
        async with aclient.stream("POST", server.url("/v1/completions"), json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # leave with the stream unfinished: the connection is closed

    async def run() -> None:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as aclient:
            await asyncio.gather(*(open_and_drop(aclient) for _ in range(50)))

    asyncio.run(run())
    start = time.monotonic()
    response = httpx.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert response.status_code == 200
    assert time.monotonic() - start < 20, "a new request waited behind the abandoned ones"
    assert wait_until(lambda: _kv_free(server), timeout_s=30), server.metrics()
    aborted = metric(server.metrics(), "folio:request_success_total", finished_reason="abort") - aborted_before
    assert aborted == 50


def test_disconnected_non_streaming_requests_are_aborted(server: ServerProcess) -> None:
    body = {"prompt": "Tell me a very long story.", "max_tokens": 1000, "ignore_eos": True}

    async def give_up(aclient: httpx.AsyncClient) -> None:
        try:
            await aclient.post(server.url("/v1/completions"), json=body, timeout=1.0)
        except httpx.TimeoutException:
            return
        raise AssertionError("a 1000-token request finished within 1 s")

    async def run() -> None:
        async with httpx.AsyncClient() as aclient:
            await asyncio.gather(*(give_up(aclient) for _ in range(5)))

    asyncio.run(run())
    assert wait_until(lambda: _kv_free(server), timeout_s=30), server.metrics()

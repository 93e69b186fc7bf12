"""Process-level behaviour: the API key (flag and variable), /ping, priority under a full batch, the queue limit,
SIGTERM drain (exit 0), engine-core death (exit 1), a core that fails to start (exit 2).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from folio.cli import resolve_api_key
from tests.server.conftest import (
    MODEL_NAME,
    START_TIMEOUT_S,
    ServerProcess,
    folio_script,
    free_port,
    http_status,
    metric,
    parse_metrics,
    server_is_idle,
    start_server,
    stream_killing_after_first_event,
    wait_until,
)

API_KEY = "sk-folio-test"
ENV_API_KEY = "sk-folio-from-env"  # set alongside --api-key: must be refused


def test_engine_core_death(tmp_path: Path) -> None:
    """Kill the core: the in-flight stream gets an error event then [DONE], /health 503, the server exits 1."""
    server = start_server(tmp_path, "death")
    try:
        pid = httpx.get(server.url("/version")).json()["engine_core_pid"]
        body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        error = stream_killing_after_first_event(server, body, lambda: os.kill(pid, signal.SIGKILL), 60)
        assert error["code"] == "engine_dead" and set(error) == {"message", "type", "param", "code"}
        # The engine was marked dead before the error event went out, and the server keeps answering for
        # ENGINE_DEAD_EXIT_DELAY_S after that: one request each, no polling.
        assert http_status(server) == 503
        assert http_status(server, "/ping", "POST") == 503
        assert server.process.wait(timeout=60) == 1  # hang guard only
        assert "engine-core process died" in server.log_tail()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Key from --api-key (FOLIO_API_KEY holds another key: the flag must win); 2 sequences at a time, at most 2
    queued requests (4 in flight), priority scheduling."""
    args = ["--api-key", API_KEY, "--max-num-seqs", "2", "--max-num-queued-reqs", "2"]
    args += ["--scheduling-policy", "priority"]
    env = {"FOLIO_API_KEY": ENV_API_KEY}
    proc = start_server(Path(tmp_path_factory.mktemp("keyed")), "keyed", args, env=env)
    yield proc
    proc.stop()


def test_api_key_resolution() -> None:
    """The flag wins over the environment variable; either one alone is the key; empty means no key."""
    assert resolve_api_key("flag", {"FOLIO_API_KEY": "env"}) == "flag"
    assert resolve_api_key(None, {"FOLIO_API_KEY": "env"}) == "env"
    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {"FOLIO_API_KEY": ""}) is None
    assert resolve_api_key("", {"FOLIO_API_KEY": "env"}) is None


def test_api_key(keyed_server: ServerProcess) -> None:
    server = keyed_server
    body = {"prompt": "Hi", "max_tokens": 2}
    bad_headers = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, _auth(ENV_API_KEY))
    for headers in bad_headers:
        response = httpx.post(server.url("/v1/completions"), json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/ping", "/metrics", "/version"):
        assert httpx.get(server.url(path)).status_code == 200
    assert httpx.post(server.url("/ping")).status_code == 200
    assert httpx.get(server.url("/v1/models")).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0)
    assert good.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


LONG_STREAM = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
HANG_GUARD_S = 120.0


async def _metrics(aclient: httpx.AsyncClient, server: ServerProcess) -> dict[str, float]:
    return parse_metrics((await aclient.get(server.url("/metrics"))).text)


async def _wait_for_metric(
    aclient: httpx.AsyncClient,
    server: ServerProcess,
    name: str,
    done: Callable[[float], bool],
    tasks: Sequence[asyncio.Task[None]] = (),
) -> None:
    """Polls /metrics until ``done(value of name)``; raises at once what a task in ``tasks`` (requests that must
    still be in flight) raised. The timeout only guards against a hang."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not done(value := metric(await _metrics(aclient, server), name)):
        for task in tasks:
            if task.done():
                task.result()
                raise AssertionError(f"a request ended while waiting for {name}")
        assert time.monotonic() < deadline, f"{name} stuck at {value}"
        await asyncio.sleep(0.05)


async def _hold_stream(aclient: httpx.AsyncClient, server: ServerProcess, stop: asyncio.Event) -> None:
    """A long stream that keeps its batch slot until ``stop`` is set, then hangs up (which aborts it)."""
    headers = _auth(API_KEY)
    async with aclient.stream("POST", server.url("/v1/completions"), json=LONG_STREAM, headers=headers) as response:
        assert response.status_code == 200
        async for _ in response.aiter_lines():
            if stop.is_set():
                return


def test_priority_reorders_a_full_batch(keyed_server: ServerProcess) -> None:
    """Both batch slots held; 'low' (priority 10) queues before 'high' (-10). When one slot frees, 'high' runs
    first and finishes before 'low' starts (first come first served would give the opposite order)."""
    server = keyed_server
    finished: list[str] = []

    async def short(aclient: httpx.AsyncClient, name: str, priority: int) -> None:
        body = {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True, "priority": priority}
        response = await aclient.post(server.url("/v1/completions"), json=body, headers=_auth(API_KEY))
        assert response.status_code == 200, response.text
        finished.append(name)

    async def run() -> None:
        stops = [asyncio.Event(), asyncio.Event()]
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as aclient:
            holders = [asyncio.create_task(_hold_stream(aclient, server, stop)) for stop in stops]
            await _wait_for_metric(aclient, server, "folio:num_requests_running", lambda n: n == 2, holders)
            low = asyncio.create_task(short(aclient, "low", 10))
            await _wait_for_metric(aclient, server, "folio:num_requests_waiting", lambda n: n == 1, [*holders, low])
            high = asyncio.create_task(short(aclient, "high", -10))
            in_flight = [*holders, low, high]
            await _wait_for_metric(aclient, server, "folio:num_requests_waiting", lambda n: n == 2, in_flight)
            stops[0].set()  # one slot frees: the scheduler picks the next waiting request by priority
            await asyncio.wait_for(asyncio.gather(low, high), HANG_GUARD_S)
            stops[1].set()
            await asyncio.wait_for(asyncio.gather(*holders), HANG_GUARD_S)

    asyncio.run(run())
    assert finished == ["high", "low"]


def test_queue_limit_503(keyed_server: ServerProcess) -> None:
    """2 running + 2 queued fill --max-num-seqs 2 + --max-num-queued-reqs 2: a new request gets 503 with
    Retry-After until they are gone."""
    server = keyed_server
    headers = _auth(API_KEY)
    body = {**LONG_STREAM, "stream": False}
    probe = {"prompt": "Hi", "max_tokens": 1}

    async def run() -> httpx.Response:
        stops = [asyncio.Event(), asyncio.Event()]
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as aclient:
            holders = [asyncio.create_task(_hold_stream(aclient, server, stop)) for stop in stops]
            await _wait_for_metric(aclient, server, "folio:num_requests_running", lambda n: n == 2, holders)
            # Two of these are admitted and queue; the third is refused at once.
            url = server.url("/v1/completions")
            waiting = [asyncio.create_task(aclient.post(url, json=body, headers=headers)) for _ in range(3)]
            await _wait_for_metric(aclient, server, "folio:num_requests_waiting", lambda n: n >= 2)
            response = await aclient.post(url, json=probe, headers=headers)
            for stop in stops:
                stop.set()
            for task in waiting:
                task.cancel()
            await asyncio.gather(*holders, *waiting, return_exceptions=True)
            return response

    response = asyncio.run(run())
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "service_unavailable_error"
    assert int(response.headers["retry-after"]) >= 1
    assert wait_until(lambda: server_is_idle(server), timeout_s=HANG_GUARD_S), server.metrics()
    response = httpx.post(server.url("/v1/completions"), json=probe, headers=headers, timeout=60)
    assert response.status_code == 200


def test_sigterm_drains_and_exits_0(keyed_server: ServerProcess) -> None:
    """SIGTERM mid-stream: the stream still finishes with all its tokens and [DONE]; the process exits 0."""
    server = keyed_server
    headers = _auth(API_KEY)
    body = {"prompt": "Count slowly:", "max_tokens": 40, "ignore_eos": True, "stream": True, "temperature": 0}
    body["stream_options"] = {"include_usage": True}
    events: list[str] = []
    outcome: list[int | None] = []
    late = threading.Thread(target=_try_new_request, args=(server, headers, outcome), daemon=True)
    with httpx.stream("POST", server.url("/v1/completions"), json=body, headers=headers, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 1:
                    server.process.send_signal(signal.SIGTERM)
                    late.start()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 40
    assert server.process.wait(timeout=60) == 0  # hang guard only
    late.join(timeout=60)  # hang guard only
    assert outcome and outcome[0] in (503, None), outcome


def _try_new_request(server: ServerProcess, headers: dict[str, str], outcome: list[int | None]) -> None:
    """A request that arrives during the drain (seen on /health): refused (the socket is closed) or 503."""
    if not wait_until(lambda: http_status(server) != 200, timeout_s=60, interval_s=0.05):
        return  # outcome stays empty: the test fails on it
    try:
        body = {"prompt": "Hi", "max_tokens": 1}
        outcome.append(httpx.post(server.url("/v1/completions"), json=body, headers=headers, timeout=30).status_code)
    except httpx.TransportError:
        outcome.append(None)


def test_serve_exits_with_the_error_when_the_core_fails_to_start(tmp_path: Path) -> None:
    """A KV budget that holds no block is only found by the engine core, after it loaded the model: `folio serve`
    must print the core's reason and exit 2, never open the port or hang."""
    args = [folio_script(), "serve", "--port", str(free_port()), "--dtype", "float32", "--kv-cache-memory-bytes", "1"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=START_TIMEOUT_S)  # hang guard
    assert result.returncode == 2, result.stderr[-2000:]
    assert "folio: error: ValueError: kv_cache_memory_bytes 1 holds no KV block" in result.stderr


def test_serve_help_documents_every_flag() -> None:
    result = subprocess.run([folio_script(), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    flags = [
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--dtype",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--kv-cache-memory-bytes",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--max-num-queued-reqs",
        "--max-num-queued-tokens",
        "--seed",
        "--uvicorn-log-level",
    ]
    for flag in flags:
        assert flag in result.stdout, flag
    assert "127.0.0.1" in result.stdout

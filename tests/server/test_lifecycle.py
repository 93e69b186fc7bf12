"""Process-level behaviour: the API key, the queue limit, SIGTERM drain (exit 0), engine-core death (exit != 0)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess, metric, start_server, wait_until

API_KEY = "sk-folio-test"


def test_engine_core_death(tmp_path: Path) -> None:
    """Kill the core: the in-flight stream gets an error event then [DONE], /health 503, the server exits 1."""
    server = start_server(tmp_path, "death")
    try:
        pid = httpx.get(server.url("/version")).json()["engine_core_pid"]
        body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if len(events) == 1:
                        os.kill(pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and set(error) == {"message", "type", "param", "code"}
        # The server keeps answering for ENGINE_DEAD_EXIT_DELAY_S (2 s) so that health checkers see the 503.
        assert wait_until(lambda: _health_status(server) == 503, timeout_s=10, interval_s=0.05)
        assert server.process.wait(timeout=60) == 1
        assert "engine-core process died" in server.log_tail()
    finally:
        server.stop()


def _health_status(server: ServerProcess) -> int | None:
    try:
        return httpx.get(server.url("/health"), timeout=2).status_code
    except httpx.TransportError:
        return None  # the server is already gone


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Key from FOLIO_API_KEY (the CLI reads it); 2 sequences at a time, at most 1 waiting request."""
    args = ["--max-num-seqs", "2", "--max-num-queued-reqs", "1"]
    proc = start_server(Path(tmp_path_factory.mktemp("keyed")), "keyed", args, env={"FOLIO_API_KEY": API_KEY})
    yield proc
    proc.stop()


def test_api_key(keyed_server: ServerProcess) -> None:
    server = keyed_server
    body = {"prompt": "Hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(server.url("/v1/completions"), json=body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.url(path)).status_code == 200
    assert httpx.get(server.url("/v1/models")).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0)
    assert good.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_queue_limit_503(keyed_server: ServerProcess) -> None:
    """2 running + 3 waiting > 1 queued allowed: a new request gets 503 until the queue drains."""
    server = keyed_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    probe = {"prompt": "Hi", "max_tokens": 1}
    statuses: list[int] = []

    async def hold_stream(aclient: httpx.AsyncClient, stop: asyncio.Event) -> None:
        async with aclient.stream("POST", server.url("/v1/completions"), json=body, headers=headers) as response:
            assert response.status_code == 200
            async for _ in response.aiter_lines():
                if stop.is_set():
                    return

    async def run() -> None:
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as aclient:
            tasks = [asyncio.create_task(hold_stream(aclient, stop)) for _ in range(2)]
            await asyncio.sleep(1.0)  # the first two are running; the next three only get to wait
            waiting = [asyncio.create_task(aclient.post(server.url("/v1/completions"), json=body, headers=headers))]
            waiting += [asyncio.create_task(aclient.post(server.url("/v1/completions"), json=body, headers=headers))]
            waiting += [asyncio.create_task(aclient.post(server.url("/v1/completions"), json=body, headers=headers))]
            for _ in range(100):
                await asyncio.sleep(0.2)
                response = await aclient.post(server.url("/v1/completions"), json=probe, headers=headers)
                statuses.append(response.status_code)
                if response.status_code == 503:
                    assert response.json()["error"]["type"] == "service_unavailable_error"
                    break
            stop.set()
            for task in waiting:
                task.cancel()
            await asyncio.gather(*tasks, *waiting, return_exceptions=True)

    asyncio.run(run())
    assert statuses[-1] == 503, statuses
    assert wait_until(lambda: metric(server.metrics(), "folio:num_requests_running") == 0, timeout_s=30)
    assert metric(server.metrics(), "folio:kv_cache_usage_perc") == 0
    response = httpx.post(server.url("/v1/completions"), json=probe, headers=headers, timeout=60)
    assert response.status_code == 200


def test_sigterm_drains_and_exits_0(keyed_server: ServerProcess) -> None:
    """SIGTERM mid-stream: the stream still finishes with all its tokens and [DONE]; the process exits 0."""
    server = keyed_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
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
    assert server.process.wait(timeout=60) == 0
    late.join(timeout=30)
    assert outcome and outcome[0] in (503, None)


def _try_new_request(server: ServerProcess, headers: dict[str, str], outcome: list[int | None]) -> None:
    """A request that arrives during the drain: refused (the socket is closed) or 503."""
    time.sleep(0.3)
    try:
        body = {"prompt": "Hi", "max_tokens": 1}
        outcome.append(httpx.post(server.url("/v1/completions"), json=body, headers=headers, timeout=30).status_code)
    except httpx.TransportError:
        outcome.append(None)


def test_serve_help_documents_every_flag() -> None:
    from tests.server.conftest import folio_script

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
        "--seed",
        "--uvicorn-log-level",
    ]
    for flag in flags:
        assert flag in result.stdout, flag
    assert "127.0.0.1" in result.stdout

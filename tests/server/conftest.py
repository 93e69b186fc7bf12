"""Real `folio serve` subprocesses for the server tests: the installed console script, the default model, a free
port on 127.0.0.1. Loading takes a few seconds, so the default server is shared by the session; tests that need
a fresh or special server (metrics counts, engine death, drain) start their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from folio.bench.server_proc import free_port
from tests.small_engine import SMALL_ENGINE_FLAGS

MODEL_NAME = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 180.0


def folio_script() -> str:
    script = Path(sys.executable).parent / "folio"
    if not script.exists():
        pytest.fail("the folio console script is not installed in the venv")
    return str(script)


class ServerProcess:
    """One `folio serve` subprocess; its combined output goes to a log file (a pipe could fill and block it)."""

    def __init__(self, log_path: Path, extra_args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.metrics_at_start: str | None = None  # /metrics as served before any request (the shared server's)
        args = [folio_script(), "serve", "--port", str(self.port)]
        args += SMALL_ENGINE_FLAGS  # a test's own --max-model-len below wins (the last)
        args += ["--dtype", "float32", "--uvicorn-log-level", "warning", *(extra_args or [])]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2) as client:  # one client: a new one per poll costs ~16 ms of CPU (its SSL setup)
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    pytest.fail(f"folio serve exited with {self.process.returncode}:\n{self.log_tail()}")
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        self.stop()
        pytest.fail(f"folio serve did not become healthy in {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, num_chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def metrics(self) -> dict[str, float]:
        """The exposition as {series (name plus labels): value}."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """The value of one series, labels given without model_name (it is always the served name). Without an
    ``engine`` label, the sum over the engine cores' series (one core: its series)."""
    wanted = {"model_name": MODEL_NAME, **labels}
    matched = []
    for series, value in values.items():
        metric_name, _, label_text = series.partition("{")
        if metric_name != name:
            continue
        found = dict(part.split("=", 1) for part in label_text.rstrip("}").split(",") if part)
        found = {k: v.strip('"') for k, v in found.items()}
        if "engine" not in labels:
            found.pop("engine", None)
        if found == wanted:
            matched.append(value)
    if not matched:
        raise KeyError(f"{name}{wanted} not in /metrics")
    return sum(matched)


# Nothing runs, waits, holds an admission slot or a KV block: the state every test ends in.
IDLE_METRICS = (
    "folio:num_requests_running",
    "folio:num_requests_waiting",
    "folio:num_requests_in_flight",
    "folio:num_queued_prompt_tokens",
    "folio:kv_cache_usage_perc",
)


def server_is_idle(server: ServerProcess) -> bool:
    """Every IDLE_METRICS series reads 0 in /metrics."""
    values = server.metrics()
    return all(metric(values, name) == 0 for name in IDLE_METRICS)


def start_server(tmp_dir: Path, name: str, extra_args: list[str] | None = None, **kwargs: Any) -> ServerProcess:
    server = ServerProcess(tmp_dir / f"{name}.log", extra_args, **kwargs)
    server.wait_healthy()
    return server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default server, shared by the modules that only send requests to it."""
    proc = start_server(tmp_path_factory.mktemp("server"), "shared", ["--max-model-len", "1024"])
    proc.metrics_at_start = httpx.get(proc.url("/metrics"), timeout=10).text
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def async_client_factory(server: ServerProcess) -> Any:
    import openai

    def make() -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=300)

    return make


def http_status(server: ServerProcess, path: str = "/health", method: str = "GET") -> int | None:
    """The status code of one request to the server, or None once it is gone (a dying server's health checks)."""
    try:
        return httpx.request(method, server.url(path), timeout=10).status_code
    except httpx.TransportError:
        return None


def wait_until(predicate: Any, timeout_s: float, interval_s: float = 0.2) -> bool:
    """Polls ``predicate`` until it is true or ``timeout_s`` passes; returns its last result."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)


def direction_values(logger: Any) -> dict[tuple[str, str], float]:
    """A PrometheusStatLogger's samples, in process: (sample name, its direction label or '') -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(logger.render().decode()):
        for sample in family.samples:
            out[(sample.name, sample.labels.get("direction", ""))] = sample.value
    return out


def stream_killing_after_first_event(server: ServerProcess, body: dict[str, Any], kill: Any, timeout_s: float) -> dict:
    """Streams ``body`` from /v1/completions, calls ``kill()`` once the first event has arrived, reads the stream to
    its end and returns the error of its last event before [DONE] (the stream must end with both)."""
    events: list[str] = []
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=timeout_s) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 1:
                    kill()
    assert events[-1] == "[DONE]"
    error: dict = json.loads(events[-2])["error"]
    return error

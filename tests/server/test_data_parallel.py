"""`folio serve --data-parallel-size 2` (two engine cores of 1 thread each behind one API server), real processes
and the real openai client: greedy outputs equal the single-core server's for a concurrent mixed batch served by
both cores; a shared long prefix follows the core that caches it while unrelated requests spread by load (per-core
counters on /metrics); a killed core makes the server answer 503 and exit 1; `--data-parallel-size 0` is refused
naming the flag. After every test on a live server, every core's KV usage is back to 0."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.server.conftest import (
    MODEL_NAME,
    ServerProcess,
    folio_script,
    metric,
    start_server,
    stream_killing_after_first_event,
    wait_until,
)

DP_ARGS = ["--data-parallel-size", "2", "--max-model-len", "1024"]
ENGINES = ("0", "1")
HANG_GUARD_S = 120.0
LONG_PROMPT = (
    "Bread needs flour, water, salt and yeast. Mix them, knead the dough for ten minutes, let it rise for an "
    "hour in a warm place, shape it, let it rise again, then bake it in a hot oven until the crust is brown and "
    "the loaf sounds hollow when tapped underneath. The secret of good bread is"
)
PREFIX = (  # ~91 tokens: 5 full KV blocks shared by the prompts that start with it
    "You are the archivist of a lighthouse museum. The museum keeps logbooks from 1820 to 1990, brass lenses, "
    "storm charts, letters from keepers' families and a collection of foghorn recordings. Visitors ask about "
    "shipwrecks, the lives of keepers, how the lamps were lit and why the lights were automated. Answer in one "
    "short sentence, plainly, and never invent dates that are not in the logbooks.\n"
)


@pytest.fixture(scope="module")
def dp_holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    holder: dict[str, ServerProcess] = {}
    yield holder
    if "server" in holder:
        holder["server"].stop()


@pytest.fixture
def dp_server(dp_holder: dict[str, ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The module's dp=2 server (started again if a test killed it); afterwards, the leak check on every core."""
    if "server" not in dp_holder or dp_holder["server"].process.poll() is not None:
        tmp = Path(tmp_path_factory.mktemp("dp"))
        dp_holder["server"] = start_server(tmp, "dp2", DP_ARGS, env={"OMP_NUM_THREADS": "2"})  # 1 thread per core
    server = dp_holder["server"]
    yield server
    if server.process.poll() is None:
        assert wait_until(lambda: every_engine_idle(server), HANG_GUARD_S), server.metrics()


def every_engine_idle(server: ServerProcess) -> bool:
    values = server.metrics()
    names = ("folio:num_requests_running", "folio:num_requests_waiting", "folio:kv_cache_usage_perc")
    per_engine = [metric(values, name, engine=engine) for name in names for engine in ENGINES]
    return all(value == 0 for value in per_engine) and metric(values, "folio:num_requests_in_flight") == 0


def per_engine(server: ServerProcess, name: str, **labels: str) -> list[float]:
    values = server.metrics()
    return [metric(values, name, engine=engine, **labels) for engine in ENGINES]


def served(server: ServerProcess) -> list[float]:
    """Requests each core finished, whatever the reason."""
    values = server.metrics()
    reasons = ("stop", "length", "abort")
    return [
        sum(metric(values, "folio:request_success_total", engine=e, finished_reason=r) for r in reasons)
        for e in ENGINES
    ]


def minus(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before, strict=True)]


async def mixed_batch(base_url: str) -> list[Any]:
    """Streams, n = 2, a chat, beam search and prompts from 3 to ~100 tokens, all at once; their outputs."""
    aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)

    async def stream(prompt: str, max_tokens: int) -> str:
        chunks = await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join([chunk.choices[0].text async for chunk in chunks if chunk.choices])

    async def n_two() -> list[str]:
        out = await aclient.completions.create(
            model=MODEL_NAME, prompt="Name a colour:", n=2, max_tokens=8, temperature=0
        )
        return [choice.text for choice in out.choices]

    async def chat() -> str | None:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        out = await aclient.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
        return out.choices[0].message.content

    async def beams() -> list[str]:
        out = await aclient.completions.create(
            model=MODEL_NAME,
            prompt="The three primary colors are",
            n=2,
            max_tokens=6,
            extra_body={"use_beam_search": True},
        )
        return [choice.text for choice in out.choices]

    prompts = ["Hi", "The sea is", "Write one sentence about winter:", LONG_PROMPT]
    prompts += [f"Count from {i} to {i + 5}:" for i in range(4)]
    try:
        return list(
            await asyncio.gather(*(stream(p, 10 + 2 * i) for i, p in enumerate(prompts)), n_two(), chat(), beams())
        )
    finally:
        await aclient.close()


def test_greedy_outputs_equal_one_engine_and_both_engines_serve(
    server: ServerProcess, dp_server: ServerProcess
) -> None:
    before = served(dp_server)
    expected = asyncio.run(mixed_batch(server.base_url))
    outputs = asyncio.run(mixed_batch(dp_server.base_url))
    assert outputs == expected
    assert all(outputs[:8]) and len(outputs[8]) == 2 and len(outputs[10]) == 2
    assert all(count > 0 for count in minus(served(dp_server), before)), "one core served the whole batch"


def _completion(server: ServerProcess, prompt: str, max_tokens: int = 4) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=HANG_GUARD_S)
    assert response.status_code == 200, response.text


class Holder:
    """A long stream held open (its request runs until closed): load on whichever core it went to."""

    def __init__(self, server: ServerProcess, prompt: str) -> None:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 900, "ignore_eos": True, "stream": True}
        self._context = httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=HANG_GUARD_S)
        response = self._context.__enter__()
        assert response.status_code == 200
        self._lines = response.iter_lines()
        while not next(self._lines).startswith("data: {"):  # its first token: it runs
            pass

    def close(self) -> None:
        self._context.__exit__(None, None, None)  # hangs up: the server aborts it


def test_shared_prefix_follows_its_engine_and_unrelated_requests_spread(dp_server: ServerProcess) -> None:
    hits_before, served_before = per_engine(dp_server, "folio:prefix_cache_hits_total"), served(dp_server)
    _completion(dp_server, PREFIX + "Who lit the lamps?")  # nothing cached anywhere, equal loads: core 0
    assert minus(served(dp_server), served_before) == [1, 0]
    holders = [Holder(dp_server, "Tell me a very long story about a dragon.")]  # equal loads again: core 0
    try:
        assert wait_until(lambda: per_engine(dp_server, "folio:num_requests_running") == [1, 0], HANG_GUARD_S)
        # Load alone would now pick core 1; the prefix cached on core 0 (many blocks, 1 request more) wins.
        _completion(dp_server, PREFIX + "Why were the lights automated?")
        _completion(dp_server, PREFIX + "What do the storm charts show?")
        assert minus(served(dp_server), served_before) == [3, 0]
        hits = minus(per_engine(dp_server, "folio:prefix_cache_hits_total"), hits_before)
        assert hits == [2 * 5 * 16, 0]  # each of the two found the prefix's 5 blocks cached on core 0
        _completion(dp_server, "Unrelated: list three fruits.")  # no prefix anywhere: the less loaded core 1
        assert minus(served(dp_server), served_before) == [3, 1]
        holders.append(Holder(dp_server, "Describe a long journey across the mountains."))  # core 1 again
        assert wait_until(lambda: per_engine(dp_server, "folio:num_requests_running") == [1, 1], HANG_GUARD_S)
    finally:
        for holder in holders:
            holder.close()


def test_a_killed_engine_core_makes_the_server_answer_503_and_exit_1(dp_server: ServerProcess) -> None:
    pids = httpx.get(dp_server.url("/version")).json()["engine_core_pids"]
    children = {child.pid for child in psutil.Process(dp_server.process.pid).children()}
    assert len(set(pids)) == 2 and set(pids) <= children
    body = {"model": MODEL_NAME, "prompt": "Tell me a story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
    kill_other_core = lambda: psutil.Process(pids[1]).send_signal(signal.SIGKILL)  # noqa: E731 - not the stream's
    assert stream_killing_after_first_event(dp_server, body, kill_other_core, HANG_GUARD_S)["code"] == "engine_dead"
    assert httpx.get(dp_server.url("/health"), timeout=10).status_code == 503
    assert dp_server.process.wait(timeout=HANG_GUARD_S) == 1  # hang guard only
    log = dp_server.log_tail(20000)
    assert "the engine core process 1 of 2 died (exit code -9)" in log, [
        line for line in log.splitlines() if "died" in line
    ]
    assert wait_until(lambda: not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == "zombie", 30)


def test_data_parallel_size_0_is_refused_naming_the_flag() -> None:
    result = subprocess.run(
        [folio_script(), "serve", "--data-parallel-size", "0"], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert result.returncode == 2
    assert "data_parallel_size (--data-parallel-size) must be >= 1, got 0" in result.stderr

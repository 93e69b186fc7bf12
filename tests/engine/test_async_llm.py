"""AsyncLLM with the engine core in its own process: streams, cancellation frees blocks, a dead core is reported."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from folio import LLM, SamplingParams
from folio.config import EngineArgs
from folio.engine.async_llm import AsyncLLM, EngineDeadError
from tests.engine.conftest import TEST_KV_BYTES

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLM]:
    engine = AsyncLLM(EngineArgs(dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES))
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLM, prompt: str, params: SamplingParams, request_id: str) -> tuple[str, list[int], int]:
    text, token_ids, chunks = "", [], 0
    async for out in engine.generate(prompt, params, request_id):
        text += out.outputs[0].text
        token_ids += out.outputs[0].token_ids
        chunks += 1
    return text, token_ids, chunks


async def wait_until_idle(engine: AsyncLLM, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        stats = engine.last_scheduler_stats
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"engine not idle: {engine.last_scheduler_stats}")


def test_stream_equals_offline_generate(engine: AsyncLLM, llm: LLM) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3,"]

    async def run() -> list[tuple[str, list[int], int]]:
        return await asyncio.gather(*(collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(prompts)))

    streamed = asyncio.run(run())
    offline = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, token_ids, chunks), out in zip(streamed, offline, strict=True):
        assert token_ids == out.outputs[0].token_ids
        assert text == out.outputs[0].text
        assert chunks > 1, "outputs arrive as a stream of deltas"


def test_closing_the_stream_aborts_and_frees_blocks(engine: AsyncLLM) -> None:
    long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

    async def run() -> None:
        streams = [engine.generate("Tell me a long story.", long, f"long{i}") for i in range(8)]
        for stream in streams:
            await stream.__anext__()  # each request is running
        assert engine.last_scheduler_stats.kv_cache_usage > 0
        for stream in streams:
            await stream.aclose()  # the client went away
        await wait_until_idle(engine)
        text, _, _ = await collect(engine, "Hello", SamplingParams(max_tokens=4), "after")
        assert text

    asyncio.run(run())


def test_bad_input_raises_before_running(engine: AsyncLLM) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="max_tokens"):
            await collect(engine, "Hi", SamplingParams(max_tokens=10**6), "bad")
        await wait_until_idle(engine)

    asyncio.run(run())


def test_dead_core_fails_streams_and_is_reported() -> None:
    engine = AsyncLLM(EngineArgs(dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES))

    async def run() -> None:
        stream = engine.generate("Tell me a story.", SamplingParams(max_tokens=4000, ignore_eos=True), "doomed")
        await stream.__anext__()
        os.kill(engine.engine_core_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        await asyncio.wait_for(engine.wait_for_dead(), 10)
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()

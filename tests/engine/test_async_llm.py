"""AsyncLLM with the engine core in its own process: streams, cancellation and abort() free blocks, duplicate ids
are refused, a dead core is reported (also to requests made after it died), a core that fails to start raises."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from folio import LLM, SamplingParams
from folio.config import EngineArgs
from folio.core.scheduler import SchedulerStats
from folio.engine.async_llm import AsyncLLM, EngineDeadError
from folio.engine.stats import IterationStats
from folio.outputs import RequestOutput
from tests.small_engine import SMALL_ENGINE

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
LONG_PROMPT = "Tell me a long story."
HANG_GUARD_S = 300.0


class FinishRecorder:
    """A stat logger (AsyncLLM's own extension point) that keeps every finish reason in the order they came."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats, engine_index: int = 0) -> None:
        self.reasons += [finished.finish_reason for finished in iteration_stats.finished_requests]


@pytest.fixture(scope="module")
def recorder() -> FinishRecorder:
    return FinishRecorder()


@pytest.fixture(scope="module")
def engine(recorder: FinishRecorder) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(
        EngineArgs(dtype="float32", **SMALL_ENGINE),
        stat_loggers=[recorder],
    )
    yield engine
    engine.shutdown()


async def collect(engine: AsyncLLM, prompt: str, params: SamplingParams, request_id: str) -> tuple[str, list[int], int]:
    text, token_ids, chunks = "", [], 0
    async for out in engine.generate(prompt, params, request_id):
        text += out.outputs[0].text
        token_ids += out.outputs[0].token_ids
        chunks += 1
    return text, token_ids, chunks


async def wait_for_core(engine: AsyncLLM, done: Callable[[SchedulerStats], bool]) -> None:
    """Polls the core's last reported state until ``done``; the timeout only guards against a hang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_GUARD_S
    while not done(engine.last_scheduler_stats):
        assert loop.time() < deadline, f"engine stuck at {engine.last_scheduler_stats}"
        await asyncio.sleep(0.05)


async def wait_until_idle(engine: AsyncLLM) -> None:
    await wait_for_core(engine, lambda s: s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0)


async def wait_alone_with_sentinel(engine: AsyncLLM, recorder: FinishRecorder, since: int) -> None:
    """Waits until the core runs only the sentinel: a LONG request started before the ones under test. Had those run
    to their end instead of being aborted, the sentinel (ahead of them, never preempted first under first come first
    served) would have finished no later, as a 'length' the recorder would hold."""

    def alone_or_finished(stats: SchedulerStats) -> bool:
        return (stats.num_running == 1 and stats.num_waiting == 0) or "length" in recorder.reasons[since:]

    await wait_for_core(engine, alone_or_finished)
    assert "length" not in recorder.reasons[since:], "the sentinel finished: the other requests were not aborted"


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


def test_closing_the_stream_aborts_and_frees_blocks(engine: AsyncLLM, recorder: FinishRecorder) -> None:
    since = len(recorder.reasons)

    async def run() -> None:
        sentinel = engine.generate(LONG_PROMPT, LONG, "close-sentinel")
        await sentinel.__anext__()
        streams = [engine.generate(LONG_PROMPT, LONG, f"long{i}") for i in range(8)]
        for stream in streams:
            await stream.__anext__()  # each request is running
        assert engine.last_scheduler_stats.kv_cache_usage > 0
        for stream in streams:
            await stream.aclose()  # the client went away
        await wait_alone_with_sentinel(engine, recorder, since)
        assert recorder.reasons[since:] == ["abort"] * 8
        await sentinel.aclose()
        await wait_until_idle(engine)
        text, _, _ = await collect(engine, "Hello", SamplingParams(max_tokens=4), "after")
        assert text

    asyncio.run(run())
    assert recorder.reasons[since:] == ["abort"] * 9 + ["length"]  # the last one is "after"


def test_abort_ends_the_stream_and_frees_blocks(engine: AsyncLLM, recorder: FinishRecorder) -> None:
    """abort(request_id) from outside the stream: the stream ends without a finished output, the core drops it."""
    since = len(recorder.reasons)

    async def drain(stream: AsyncIterator[RequestOutput]) -> list[bool]:
        return [out.finished async for out in stream]

    async def run() -> None:
        sentinel = engine.generate(LONG_PROMPT, LONG, "abort-sentinel")
        await sentinel.__anext__()
        stream = engine.generate(LONG_PROMPT, LONG, "to-abort")
        await stream.__anext__()
        await engine.abort("to-abort")
        assert not any(await asyncio.wait_for(drain(stream), HANG_GUARD_S)), "an aborted request reported finished"
        await wait_alone_with_sentinel(engine, recorder, since)
        assert recorder.reasons[since:] == ["abort"]
        await engine.abort("abort-sentinel")
        assert not any(await asyncio.wait_for(drain(sentinel), HANG_GUARD_S))
        await wait_until_idle(engine)

    asyncio.run(run())
    assert recorder.reasons[since:] == ["abort", "abort"]


def test_duplicate_request_id_is_refused(engine: AsyncLLM) -> None:
    """A second request under a live request's id is a ValueError naming the id; the first one runs on. Once it is
    gone the id is free again, and the new request gets none of the old one's late outputs."""

    async def run() -> None:
        _, fresh, _ = await collect(engine, "Hello", GREEDY, "fresh")
        first = engine.generate(LONG_PROMPT, LONG, "dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
            await asyncio.wait_for(engine.generate("Hello", GREEDY, "dup").__anext__(), HANG_GUARD_S)
        assert not (await asyncio.wait_for(first.__anext__(), HANG_GUARD_S)).finished
        # Blocks this loop until the core has sent another step's outputs (the running 'dup' among them): they
        # stay unread in the pipe while 'dup' is closed and used again.
        assert engine.core.outputs_conn.poll(HANG_GUARD_S)
        await first.aclose()
        _, token_ids, _ = await collect(engine, "Hello", GREEDY, "dup")
        assert token_ids == fresh
        await wait_until_idle(engine)

    asyncio.run(run())


def test_bad_input_raises_before_running(engine: AsyncLLM) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="max_tokens"):
            await collect(engine, "Hi", SamplingParams(max_tokens=10**6), "bad")
        await wait_until_idle(engine)

    asyncio.run(run())


def test_dead_core_fails_streams_and_is_reported() -> None:
    """Kill the core: requests made before the frontend noticed, in-flight streams, health checks and requests made
    after it noticed (on this loop or a new one) all raise EngineDeadError instead of hanging."""
    engine = AsyncLLM(EngineArgs(dtype="float32", **SMALL_ENGINE))

    async def run() -> None:
        stream = engine.generate("Tell me a story.", SamplingParams(max_tokens=2000, ignore_eos=True), "doomed")
        await stream.__anext__()
        os.kill(engine.engine_core_pid, signal.SIGKILL)
        engine.core.process.join(HANG_GUARD_S)  # gone before this loop can notice: nothing has run it since
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(engine, "Hi", GREEDY, "unnoticed"), HANG_GUARD_S)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        await asyncio.wait_for(engine.wait_for_dead(), HANG_GUARD_S)
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError, match="engine core is dead"):
            await asyncio.wait_for(collect(engine, "Hi", GREEDY, "noticed"), HANG_GUARD_S)

    try:
        asyncio.run(run())
        with pytest.raises(EngineDeadError, match="engine core is dead"):
            asyncio.run(asyncio.wait_for(collect(engine, "Hi", GREEDY, "new-loop"), HANG_GUARD_S))
    finally:
        engine.shutdown()


def test_core_that_fails_to_start_raises_its_reason() -> None:
    """A KV budget that holds no block is found only in the core process, after loading the model: the
    constructor raises the core's reason (no hang, no half-built engine)."""
    with pytest.raises(ValueError, match="kv_cache_memory_bytes 1 holds no KV block"):
        AsyncLLM(EngineArgs(dtype="float32", kv_cache_memory_bytes=1))

"""200 streams through the official `openai` client, 32 at a time, with careless clients: some give up before the
first chunk, some close after a random number of chunks, some read to the end. Afterwards nothing runs or waits,
the server holds no admission slot, and every KV block is free (all read from /metrics)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

from tests.server.conftest import IDLE_METRICS, MODEL_NAME, ServerProcess, metric, server_is_idle, wait_until

NUM_STREAMS = 200
CONCURRENCY = 32
SEED = 17
HANG_GUARD_S = 120.0


async def _open(aclient: Any, index: int, max_tokens: int, n: int) -> Any:
    """A streamed completion or chat completion (alternately), EOS ignored so every stream has max_tokens."""
    extra = {"ignore_eos": True}
    if index % 2 == 0:
        prompt = f"Write about topic number {index}:"
        return await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, n=n, stream=True, extra_body=extra
        )
    messages = [{"role": "user", "content": f"Say something about the number {index}."}]
    return await aclient.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, n=n, stream=True, extra_body=extra
    )


async def _one(aclient: Any, index: int, rng: random.Random) -> str:
    """Runs one careless client; returns what it did."""
    max_tokens, n = rng.randint(2, 12), rng.choice([1, 1, 1, 2])
    behaviour = rng.choices(["give_up_early", "close_midway", "read_all"], weights=[2, 4, 4])[0]
    if behaviour == "give_up_early":
        try:  # a client timeout that may fire before the response headers (the first chunk) arrive
            stream = await asyncio.wait_for(_open(aclient, index, max_tokens, n), timeout=rng.uniform(0.0, 0.6))
        except TimeoutError:
            return "gave_up_before_first_chunk"
        await stream.close()
        return "closed_before_reading"
    stream = await _open(aclient, index, max_tokens, n)
    if behaviour == "close_midway":
        chunks_to_read = rng.randint(0, max_tokens - 1)
        num_read = 0
        async for _ in stream:
            if num_read == chunks_to_read:
                break
            num_read += 1
        await stream.close()
        return "closed_midway"
    finish_reasons = []
    async for chunk in stream:
        finish_reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert finish_reasons == ["length"] * n, finish_reasons
    return "read_all"


def test_soak_of_careless_streams_leaks_nothing(server: ServerProcess, async_client_factory: Any) -> None:
    rng = random.Random(SEED)
    seeds = [rng.random() for _ in range(NUM_STREAMS)]

    async def run() -> Counter[str]:
        aclient = async_client_factory()
        limit = asyncio.Semaphore(CONCURRENCY)

        async def bounded(index: int) -> str:
            async with limit:
                return await _one(aclient, index, random.Random(seeds[index]))

        try:
            outcomes = await asyncio.wait_for(asyncio.gather(*(bounded(i) for i in range(NUM_STREAMS))), HANG_GUARD_S)
        finally:
            await aclient.close()
        return Counter(outcomes)

    start = time.monotonic()
    outcomes = asyncio.run(run())

    assert wait_until(lambda: server_is_idle(server), HANG_GUARD_S), server.metrics()
    duration = time.monotonic() - start
    values = server.metrics()
    print(f"soak: {dict(outcomes)} in {duration:.1f} s; " + ", ".join(f"{m} {metric(values, m)}" for m in IDLE_METRICS))
    assert sum(outcomes.values()) == NUM_STREAMS
    assert set(outcomes) >= {"closed_midway", "read_all"}

"""Plumbing between engine output streams and HTTP: SSE framing, merging streams, and aborting on disconnect.

The rule these helpers keep: whenever the client goes away (a dropped stream, or a non-streaming request whose
connection closes), every engine generator of that request is closed, which aborts the request in the engine
core and frees its KV blocks. Nothing here waits for garbage collection to do that.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

T = TypeVar("T")

logger = logging.getLogger("folio")

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event; ``exclude_none`` is not used, so fields OpenAI sends as null stay null."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


class AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its body generator however the response ends.

    Starlette cancels the send loop when the client disconnects but leaves the generator suspended at its
    ``yield``; closing it here runs its ``finally`` blocks, which close the engine generators (abort). Then
    ``on_close`` runs (the admission ticket's release), however the response ended. A stream left unfinished that
    way is logged as one info line, as a non-streaming request's disconnect is.
    """

    def __init__(
        self,
        content: AsyncGenerator[str, None],
        request_id: str,
        on_close: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self._generator = content
        self.request_id = request_id
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ended = False

        async def watched_send(message: Message) -> None:
            nonlocal ended
            ended = ended or (message["type"] == "http.response.body" and not message.get("more_body", False))
            await send(message)

        try:
            await super().__call__(scope, receive, watched_send)
        finally:
            try:
                await self._generator.aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()
        if not ended:  # Starlette stopped the stream because the client went away
            logger.info("request %s aborted: client disconnected", self.request_id)


async def prime(generator: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """Pulls the first item now, so input errors (ValueError) raise before a 200 and its headers go out.

    Returns a generator that yields that first item and then the rest; closing it closes ``generator``.
    """
    try:
        first = await generator.__anext__()
    except StopAsyncIteration:
        first = None
        empty = True
    else:
        empty = False

    async def chained() -> AsyncGenerator[T, None]:
        try:
            if not empty:
                yield first  # type: ignore[misc]
                async for item in generator:
                    yield item
        finally:
            await generator.aclose()

    return chained()


async def prime_all(generators: Sequence[AsyncGenerator[T, None]]) -> list[AsyncGenerator[T, None]]:
    """Primes every generator; if one raises, closes them all (aborting any that started) and re-raises."""
    primed: list[AsyncGenerator[T, None]] = []
    try:
        for generator in generators:
            primed.append(await prime(generator))
    except BaseException:
        for generator in generators:
            await generator.aclose()
        raise
    return primed


async def merge_async_iterators(iterators: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Yields (index of the iterator, item) as items arrive from any of them.

    On exit (exhausted, error, or this generator closed) the pending reads are cancelled and every iterator is
    closed, so no engine request outlives its consumer.
    """
    pending: dict[asyncio.Future[T], int] = {}
    try:
        pending = {asyncio.ensure_future(_anext(it)): i for i, it in enumerate(iterators)}
        while pending:
            done, _ = await asyncio.wait(pending.keys(), return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(_anext(iterators[index]))] = index
                yield index, item
    finally:
        for future in pending:
            future.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()


async def _anext(iterator: AsyncIterator[T]) -> T:
    return await iterator.__anext__()


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client has closed the connection (the body was already read, so only that arrives)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    """The client went away before the response was ready; the work was cancelled (its engine requests aborted).

    Not an error of the server: errors.py logs it as one info line, "request X aborted: client disconnected".
    """

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id} aborted: client disconnected")
        self.request_id = request_id


async def cancel_on_disconnect(work: Awaitable[T], request: Request, request_id: str) -> T:
    """Runs ``work`` but cancels it if the client disconnects first (which closes its engine generators), then
    raises ClientDisconnected naming ``request_id``.

    This is vLLM's ``with_cancellation``: a non-streaming request whose client gave up should not keep
    generating to the end.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
        watch_task.cancel()
        await asyncio.gather(watch_task, return_exceptions=True)
    if work_task.done() and not work_task.cancelled():
        return work_task.result()
    await asyncio.gather(work_task, return_exceptions=True)
    raise ClientDisconnected(request_id)

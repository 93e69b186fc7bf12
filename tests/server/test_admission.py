"""The admission counter on its own (no server): exact counts after every admit, refusal and release."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from folio.server.admission import RETRY_AFTER_S, Admission, AdmissionLimits
from folio.server.errors import APIError


def _refusal(admission: Admission, prompt_lens: list[int], n: int = 1) -> APIError:
    with pytest.raises(APIError) as info:
        admission.admit(prompt_lens, n)
    return info.value


def test_admits_running_plus_queued_then_refuses_with_retry_after() -> None:
    admission = Admission(AdmissionLimits(max_num_seqs=2, max_num_queued_reqs=4))
    tickets = [admission.admit([5], 1) for _ in range(6)]
    assert admission.num_in_flight == 6
    error = _refusal(admission, [5])
    assert error.status == 503 and error.code == "queue_full" and error.type == "service_unavailable_error"
    assert error.headers == {"Retry-After": str(RETRY_AFTER_S)}
    assert "--max-num-seqs 2 + --max-num-queued-reqs 4" in error.message
    assert admission.num_in_flight == 6 and admission.num_refused == 1  # a refusal charges nothing
    tickets[0].release()
    assert admission.num_in_flight == 5
    admission.admit([5], 1)
    assert admission.num_in_flight == 6


def test_prompts_times_n_engine_requests() -> None:
    admission = Admission(AdmissionLimits(max_num_seqs=2, max_num_queued_reqs=4))
    ticket = admission.admit([3, 4], 2)
    assert admission.num_in_flight == 4 and ticket.num_held == 4
    assert _refusal(admission, [1, 1, 1]).status == 503  # 4 + 3 > 6
    admission.admit([1], 2)
    assert admission.num_in_flight == 6


def test_request_larger_than_the_server_is_400_naming_the_field() -> None:
    admission = Admission(AdmissionLimits(max_num_seqs=2, max_num_queued_reqs=4))
    error = _refusal(admission, [3], n=7)
    assert (error.status, error.param) == (400, "n")
    error = _refusal(admission, [3] * 7, n=1)
    assert (error.status, error.param) == (400, "prompt")
    assert admission.num_in_flight == 0 and admission.num_refused == 0


def test_no_limit_still_counts() -> None:
    admission = Admission()
    tickets = [admission.admit([10], 3) for _ in range(100)]
    assert admission.num_in_flight == 300 and admission.num_queued_tokens == 1000
    for ticket in tickets:
        ticket.release()
    assert admission.num_in_flight == 0 and admission.num_queued_tokens == 0


def test_queued_tokens_limit_counts_prompts_awaiting_prefill() -> None:
    admission = Admission(AdmissionLimits(max_num_queued_tokens=100))
    first = admission.admit([60], 4)  # each prompt once, whatever n
    assert admission.num_queued_tokens == 60
    error = _refusal(admission, [41])
    assert error.status == 503 and "--max-num-queued-tokens 100" in error.message
    second = admission.admit([40], 1)
    assert admission.num_queued_tokens == 100
    first.prefill_done(0)  # its first output arrived: it no longer waits for prefill, but still holds its slots
    assert (admission.num_queued_tokens, admission.num_in_flight) == (40, 5)
    second.release()
    assert admission.num_queued_tokens == 0
    big = admission.admit([500], 1)  # an empty backlog admits any prompt, or a long one could never run
    assert admission.num_queued_tokens == 500
    big.release()
    first.release()
    assert (admission.num_queued_tokens, admission.num_in_flight) == (0, 0)


def test_release_is_idempotent_and_per_prompt() -> None:
    admission = Admission()
    ticket = admission.admit([7, 8, 9], 2)
    ticket.finish(1)
    assert (admission.num_in_flight, admission.num_queued_tokens) == (4, 16)
    ticket.finish(1)
    ticket.release()
    ticket.release()
    assert (admission.num_in_flight, admission.num_queued_tokens) == (0, 0)


async def _engine_stream(items: list[str], closed: list[bool], fail: bool = False) -> AsyncGenerator[str, None]:
    try:
        for item in items:
            yield item
        if fail:
            raise RuntimeError("engine failed")
    finally:
        closed.append(True)


def test_track_frees_slots_on_finish_error_and_close() -> None:
    async def run() -> None:
        admission = Admission()
        ticket = admission.admit([10, 20, 30], 1)
        closed: list[bool] = []
        finished = ticket.track(0, _engine_stream(["a", "b"], closed))
        assert [item async for item in finished] == ["a", "b"]
        assert (admission.num_in_flight, admission.num_queued_tokens) == (2, 50)

        failed = ticket.track(1, _engine_stream(["a"], closed, fail=True))
        with pytest.raises(RuntimeError):
            async for _ in failed:
                assert admission.num_queued_tokens == 30  # the first output ended its prefill wait
        assert (admission.num_in_flight, admission.num_queued_tokens) == (1, 30)

        dropped = ticket.track(2, _engine_stream(["a", "b", "c"], closed))
        assert await dropped.__anext__() == "a"
        await dropped.aclose()  # the client went away: the engine stream is closed (aborted) too
        assert (admission.num_in_flight, admission.num_queued_tokens) == (0, 0)
        assert closed == [True, True, True]

    asyncio.run(run())


def test_never_started_stream_is_freed_by_release() -> None:
    admission = Admission()
    ticket = admission.admit([10], 2)
    never_started = ticket.track(0, _engine_stream(["a"], []))
    asyncio.run(never_started.aclose())  # closing an unstarted generator runs none of its code
    assert admission.num_in_flight == 2
    ticket.release()  # the handler's finally
    assert (admission.num_in_flight, admission.num_queued_tokens) == (0, 0)

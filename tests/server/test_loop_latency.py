"""A request that takes the server seconds of work must not stall the others: while a 2 MB prompt is tokenized
(only to be refused: it is far over the context), /health keeps answering.

On the shared server (2 MB is under the default --max-request-body-bytes of 8 MiB). The worst /health time is
printed (the issue asks for under 100 ms; a 10 MB prompt's took 10.56 s when tokenizing ran on the event loop). Had
the tokenization run on the event loop, a probe sent during it would wait for the rest of it: so the worst probe
must take under half the big request's own time (and the hang guard). The probes are paced (one every
PROBE_INTERVAL_S): a probe loop at full speed kept both cores busy answering /health for the whole tokenization.
"""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.server.conftest import ServerProcess

PROMPT_BYTES = 2_000_000  # about 1.2 CPU-s of tokenization
HEALTH_HANG_GUARD_S = 3.0  # a liveness probe's usual timeout
PROBE_INTERVAL_S = 0.02  # ~50 probes over the tokenization


def test_health_answers_while_a_2mb_prompt_is_tokenized(server: ServerProcess) -> None:
    prompt = ("hello world " * (PROMPT_BYTES // 12 + 1))[:PROMPT_BYTES]
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    result: dict[str, httpx.Response] = {}
    big_seconds: list[float] = []
    answered = threading.Event()

    def send_big() -> None:
        start = time.perf_counter()
        try:
            result["big"] = httpx.post(
                server.url("/v1/completions"), content=body, headers={"content-type": "application/json"}, timeout=300
            )
        finally:
            big_seconds.append(time.perf_counter() - start)
            answered.set()

    sender = threading.Thread(target=send_big)
    sender.start()
    probe_times: list[float] = []
    with httpx.Client(timeout=60) as probe:
        while not answered.is_set():
            start = time.perf_counter()
            status = probe.get(server.url("/health")).status_code
            probe_times.append(time.perf_counter() - start)
            assert status == 200
            answered.wait(PROBE_INTERVAL_S)
    sender.join()
    big = result["big"]
    assert big.status_code == 400, big.text[:500]
    assert big.json()["error"]["code"] == "context_length_exceeded"
    worst = max(probe_times)
    print(
        f"\n/health during a {PROMPT_BYTES / 1e6:.0f} MB prompt ({big_seconds[0]:.2f} s): {len(probe_times)} probes,"
        f" worst {worst * 1000:.1f} ms"
    )
    assert len(probe_times) >= 5, "too few probes during the big request to see a stall"
    assert worst < big_seconds[0] / 2, f"/health took {worst:.2f} s of the big request's {big_seconds[0]:.2f} s"
    assert worst < HEALTH_HANG_GUARD_S, f"/health took {worst:.2f} s while the big prompt was tokenized"

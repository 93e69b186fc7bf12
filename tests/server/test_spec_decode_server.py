"""Speculative decoding through a real `folio serve --speculative-config` (one server): the spec-decode counters
are exposed at 0 before any request, drafts are made for copy prompts, and the counters agree exactly with what
the frontend counted. For a request that nothing stops early (ignore_eos, drafts cut by max_tokens), every step
that delivers its tokens gives 1 + the drafts accepted in it, and every step after the first is one inter-token
latency sample, so accepted tokens = generation tokens - ITL samples - requests. The periodic log line shows the
mean acceptance length."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess, metric, server_is_idle, start_server, wait_until

K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
_PASSAGE = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
PROMPTS = [
    "Repeat the following text exactly.\nText: " + _PASSAGE + "\nRepeated text: " + _PASSAGE[:30],
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
]
COUNTERS = ["num_drafts", "num_draft_tokens", "num_accepted_tokens"]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--speculative-config", json.dumps(SPEC), "--max-model-len", "512"]
    proc = start_server(Path(tmp_path_factory.mktemp("spec_decode")), "spec_decode", args)
    yield proc
    proc.stop()


def _spec_counters(values: dict[str, float]) -> tuple[dict[str, float], list[float]]:
    totals = {name: metric(values, f"folio:spec_decode_{name}_total") for name in COUNTERS}
    per_pos = [metric(values, "folio:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(K)]
    return totals, per_pos


def test_counters_agree_with_the_delivered_tokens(spec_server: ServerProcess) -> None:
    totals, per_pos = _spec_counters(spec_server.metrics())
    assert totals == dict.fromkeys(COUNTERS, 0.0) and per_pos == [0.0] * K  # exposed before any request
    bodies = [
        {"prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0.0},
        {"prompt": PROMPTS[1], "max_tokens": 33, "temperature": 0.0},
        {"prompt": PROMPTS[0], "max_tokens": 25, "temperature": 0.7, "seed": 11},
    ]
    for body in bodies:  # one at a time: each request's steps are its own
        response = httpx.post(
            spec_server.url("/v1/completions"), json={"model": MODEL_NAME, "ignore_eos": True, **body}, timeout=120
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == body["max_tokens"]
    assert wait_until(lambda: server_is_idle(spec_server), timeout_s=30), "the server must go idle"  # hang guard

    values = spec_server.metrics()
    totals, per_pos = _spec_counters(values)
    generation_tokens = metric(values, "folio:generation_tokens_total")
    num_itl = metric(values, "folio:inter_token_latency_seconds_count")
    assert generation_tokens == 40 + 33 + 25
    assert totals["num_drafts"] > 0 and totals["num_accepted_tokens"] > 0, totals  # copy prompts: drafts accepted
    assert totals["num_accepted_tokens"] == generation_tokens - num_itl - len(bodies)
    assert sum(per_pos) == totals["num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # a draft is accepted only after every draft before it
    assert totals["num_drafts"] <= totals["num_draft_tokens"] <= K * totals["num_drafts"]
    assert totals["num_accepted_tokens"] <= totals["num_draft_tokens"]
    # The periodic line (every 10 s, and once after the engine goes idle) reports the acceptance; hang guard.
    assert wait_until(lambda: "Mean acceptance length: " in spec_server.log_tail(100_000), timeout_s=40)

"""Disaggregated prefill and decode with real processes on 127.0.0.1: a producer `folio serve` (kv_producer), a
consumer `folio serve` (kv_consumer), `folio proxy` over them, and the shared plain server as the reference.

Through the proxy, greedy outputs equal the single server's (completions and chat, whole and streamed); the
consumer's counters show that every full prompt block arrived and was hit, so it computed only each prompt's tail
while the producer computed the prompts; both KV pools are full again after every test. A transfer that fails costs
a recompute and changes no output; a consumer that is down makes the proxy answer a 502 naming it.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import (
    MODEL_NAME,
    START_TIMEOUT_S,
    ServerProcess,
    folio_script,
    free_port,
    metric,
    server_is_idle,
    wait_until,
)

BLOCK = 16
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
HANG_GUARD_S = 120.0
COUNTERS = (
    "folio:prefix_cache_queries_total",
    "folio:prefix_cache_hits_total",
    "folio:external_prefix_cache_hits_total",
    "folio:kv_transfer_received_blocks_total",
    "folio:kv_transfer_loaded_blocks_total",
    "folio:kv_transfer_sent_blocks_total",
    "folio:kv_transfer_failed_sends_total",
)


def _kv_config(role: str, port: int | None = None) -> list[str]:
    config: dict[str, Any] = {"kv_connector": "TcpConnector", "kv_role": role}
    if port is not None:
        config["kv_port"] = port
    # 64 MiB of KV (1456 tokens) instead of the tests' 512: a faster start, the same numbers
    return [
        "--max-model-len",
        "1024",
        "--kv-cache-memory-bytes",
        str(64 * 2**20),
        "--no-cpu-huge-pages",  # as tests/small_engine.py says
        "--kv-transfer-config",
        json.dumps(config),
    ]


class ProxyProcess:
    """`folio proxy` on a free port; healthy once both instances are."""

    def __init__(self, log_path: Path, prefill: str, decode: str, decode_kv_port: int) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.log_path = log_path
        args = [folio_script(), "proxy", "--prefill", prefill, "--decode", decode, "--port", str(self.port)]
        self.process = subprocess.Popen(
            [*args, "--decode-kv-port", str(decode_kv_port)], stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            assert self.process.poll() is None, self.log_path.read_text()
            try:
                return httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(healthy, START_TIMEOUT_S), self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)
        self._log.close()


@dataclass
class Disaggregated:
    producer: ServerProcess
    consumer: ServerProcess
    proxy: ProxyProcess
    reference: ServerProcess
    kv_port: int


@pytest.fixture(scope="module")
def pd(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Disaggregated]:
    tmp = tmp_path_factory.mktemp("disaggregated")
    kv_port = free_port()
    producer = ServerProcess(tmp / "producer.log", _kv_config("kv_producer"), env=ONE_THREAD)
    consumer = ServerProcess(tmp / "consumer.log", _kv_config("kv_consumer", kv_port), env=ONE_THREAD)
    proxy = ProxyProcess(tmp / "proxy.log", producer.base_url, consumer.base_url, kv_port)
    try:
        reference = request.getfixturevalue("server")  # the shared server starts (if it must) while ours load
        producer.wait_healthy()
        consumer.wait_healthy()
        proxy.wait_healthy()
        yield Disaggregated(producer, consumer, proxy, reference, kv_port)
    finally:
        proxy.stop()
        for instance in (producer, consumer):  # both drain at once
            if instance.process.poll() is None:
                instance.process.send_signal(signal.SIGTERM)
        producer.stop()
        consumer.stop()


@pytest.fixture(autouse=True)
def _pools_full_after_each_test(pd: Disaggregated) -> Iterator[None]:
    yield
    for instance in (pd.producer, pd.consumer):
        if instance.process.poll() is None:
            assert wait_until(lambda: server_is_idle(instance), HANG_GUARD_S), instance.log_tail()  # noqa: B023


def _counts(server: ServerProcess) -> dict[str, float]:
    values = server.metrics()
    return {name: metric(values, name) for name in COUNTERS}


def _since(server: ServerProcess, before: dict[str, float]) -> dict[str, float]:
    now = _counts(server)
    return {name.removeprefix("folio:").removesuffix("_total"): now[name] - before[name] for name in COUNTERS}


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)


def _report(case: int, topic: str, num_lines: int) -> str:
    """A distinct text from its first word on (no two prompts share a block)."""
    lines = " ".join(f"Item {j}: the {topic} count was {j * 7 % 13} units." for j in range(num_lines))
    return f"Case {case} concerns {topic}. {lines} Summarize the {topic} report in one sentence:"


def _ask(client: openai.OpenAI, kind: str, case: int) -> tuple[str, str | None, int]:
    """(text, finish reason, prompt tokens) of one greedy request; kinds: completion / chat, whole / stream."""
    topic, num_lines = [("harbour", 9), ("orchard", 22), ("library", 14), ("railway", 5)][case]
    text = _report(case, topic, num_lines)
    common: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 24, "temperature": 0}
    stream = kind.endswith("stream")
    if stream:
        common.update(stream=True, stream_options={"include_usage": True})
    if kind.startswith("chat"):
        messages = [{"role": "system", "content": f"Case {case}: be brief."}, {"role": "user", "content": text}]
        answer = client.chat.completions.create(messages=messages, **common)  # type: ignore[call-overload]
    else:
        answer = client.completions.create(prompt=text, **common)  # type: ignore[call-overload]
    if not stream:
        choice = answer.choices[0]
        content = choice.message.content if kind.startswith("chat") else choice.text
        return content, choice.finish_reason, answer.usage.prompt_tokens
    parts, finish, num_prompt_tokens = [], None, 0
    for chunk in answer:
        if chunk.usage is not None:
            num_prompt_tokens = chunk.usage.prompt_tokens
        for choice in chunk.choices:
            parts.append((choice.delta.content if kind.startswith("chat") else choice.text) or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish, num_prompt_tokens


KINDS = ["completion", "completion-stream", "chat", "chat-stream"]


def test_outputs_equal_a_single_server_and_the_consumer_computes_only_the_tails(pd: Disaggregated) -> None:
    producer_before, consumer_before = _counts(pd.producer), _counts(pd.consumer)
    with _client(pd.proxy.base_url) as client:
        proxied = [_ask(client, kind, case) for case, kind in enumerate(KINDS)]
    with _client(pd.reference.base_url) as client:
        reference = [_ask(client, kind, case) for case, kind in enumerate(KINDS)]
    assert proxied == reference
    assert all(text for text, _, _ in proxied)
    lengths = [num_prompt_tokens for _, _, num_prompt_tokens in reference]
    assert min(lengths) > 5 * BLOCK, lengths
    full_blocks = sum(length // BLOCK for length in lengths)
    hittable_blocks = sum((length - 1) // BLOCK for length in lengths)  # the last token is always computed
    produced, consumed = _since(pd.producer, producer_before), _since(pd.consumer, consumer_before)
    # the producer computed every prompt (no prefix hit) and sent all its full blocks
    assert (produced["prefix_cache_queries"], produced["prefix_cache_hits"]) == (sum(lengths), 0)
    assert (produced["kv_transfer_sent_blocks"], produced["kv_transfer_failed_sends"]) == (full_blocks, 0)
    # the consumer received them, hit all but a prompt's last token in them, and computed only the tails
    assert consumed["kv_transfer_received_blocks"] == full_blocks
    assert consumed["kv_transfer_loaded_blocks"] == hittable_blocks
    assert consumed["external_prefix_cache_hits"] == hittable_blocks * BLOCK
    computed = consumed["prefix_cache_queries"] - consumed["prefix_cache_hits"] - consumed["external_prefix_cache_hits"]
    assert computed == sum(length - (length - 1) // BLOCK * BLOCK for length in lengths) <= len(lengths) * BLOCK


def test_a_failed_transfer_is_recomputed(pd: Disaggregated) -> None:
    producer_before, consumer_before = _counts(pd.producer), _counts(pd.consumer)
    dead_port = free_port()  # nothing listens there
    body = {"model": MODEL_NAME, "prompt": _report(7, "bakery", 12), "max_tokens": 16, "temperature": 0}
    sent = {"do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": dead_port}
    prefill = httpx.post(pd.producer.url("/v1/completions"), json={**body, "kv_transfer_params": sent}, timeout=60)
    assert prefill.status_code == 200, prefill.text
    assert prefill.json()["kv_transfer_params"] == {**sent, "do_remote_decode": False, "do_remote_prefill": True}
    handed_over = {**body, "kv_transfer_params": prefill.json()["kv_transfer_params"]}  # as the proxy does
    decode = httpx.post(pd.consumer.url("/v1/completions"), json=handed_over, timeout=60)
    assert decode.status_code == 200, decode.text
    reference = httpx.post(pd.reference.url("/v1/completions"), json=body, timeout=60).json()
    assert decode.json()["choices"][0]["text"] == reference["choices"][0]["text"]
    produced, consumed = _since(pd.producer, producer_before), _since(pd.consumer, consumer_before)
    assert (produced["kv_transfer_failed_sends"], produced["kv_transfer_sent_blocks"]) == (1, 0)
    assert (consumed["kv_transfer_received_blocks"], consumed["external_prefix_cache_hits"]) == (0, 0)
    assert consumed["prefix_cache_queries"] - consumed["prefix_cache_hits"] == reference["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("target", "params", "param", "message"),
    [
        ("consumer", {"do_remote_decode": True}, "kv_transfer_params.do_remote_decode", "kv_producer or kv_both"),
        ("producer", {"do_remote_prefill": True}, "kv_transfer_params.do_remote_prefill", "kv_consumer or kv_both"),
        ("producer", {"do_remote_decode": True}, "kv_transfer_params.remote_port", "names no consumer (kv_port)"),
        ("producer", {"do_remote_decode": True, "remote_host": "h"}, "kv_transfer_params.remote_port", "remote_host"),
        ("producer", {"do_remote_decode": True, "remote_port": 70000}, "kv_transfer_params.remote_port", "65535"),
        ("producer", {"do_remote_decode": True, "engine_id": "x"}, "kv_transfer_params.engine_id", "unknown field"),
        ("reference", {"do_remote_decode": True}, "kv_transfer_params.do_remote_decode", "--kv-transfer-config"),
    ],
)
def test_bad_kv_transfer_params_are_400_naming_the_field(
    pd: Disaggregated, target: str, params: dict[str, Any], param: str, message: str
) -> None:
    server: ServerProcess = getattr(pd, target)
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "kv_transfer_params": params}
    answer = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_errors_pass_through_the_proxy(pd: Disaggregated) -> None:
    bad = httpx.post(
        pd.proxy.base_url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": -1},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature", bad.text
    unknown = httpx.post(
        pd.proxy.base_url + "/v1/chat/completions", json={"model": "no-such-model", "messages": []}, timeout=60
    )
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "messages", unknown.text
    not_json = httpx.post(pd.proxy.base_url + "/v1/completions", content=b"{", timeout=60)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    models = httpx.get(pd.proxy.base_url + "/v1/models", timeout=60)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL_NAME


def test_a_consumer_that_is_down_is_a_502_naming_it(pd: Disaggregated) -> None:
    """Last in this module: it stops the consumer."""
    producer_before = _counts(pd.producer)
    pd.consumer.stop()
    answer = httpx.post(
        pd.proxy.base_url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": _report(9, "quarry", 8), "max_tokens": 8},
        timeout=HANG_GUARD_S,
    )
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["code"] == "upstream_unreachable" and pd.consumer.base_url in error["message"], error
    # the prefill ran, its send found no receiver: counted, and the producer answered all the same
    assert _since(pd.producer, producer_before)["kv_transfer_failed_sends"] == 1
    health = httpx.get(pd.proxy.base_url + "/health", timeout=30)
    assert health.status_code == 503 and "decode instance" in health.json()["error"]["message"]

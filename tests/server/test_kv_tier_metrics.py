"""The host KV tier's /metrics counters on a real `folio serve` (issue 18) after a workload whose counts are exact.

8 device blocks of 16 tokens, a host tier of 14 blocks (0.01 GiB of float32 SmolLM2), one request at a time:
  1. A: a 64-token prompt (4 full blocks), 1 output token. Computed into fresh blocks 0-3; cached; freed last block
     first, so the free queue is [4, 5, 6, 7, A3, A2, A1, A0].
  2. F: a distinct 127-token prompt (8 blocks, 7 of them full), 1 output token. It takes all 8 blocks: the 4 fresh
     ones, then A's 4 cached blocks, each stored to the host tier as it is evicted (4 stores). F's 7 full blocks are
     cached; freed last block first: the free queue is [F7 (partial, uncached), F6, F5, F4, F3, F2, F1, F0].
  3. A again: not on the device; the host tier continues the chain for 3 blocks (capped so that the last token is
     recomputed: (64 - 1) // 16 = 3): 48 hit tokens, 3 loads. Its 4 fresh device blocks are F7 (no store), F6, F5,
     F4 (3 stores, into never-used host blocks: nothing dropped).
Host-tier queries count the tokens not found on the device: 64 + 127 + 64. Every number below follows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, ServerProcess, metric, server_is_idle, start_server, wait_until

BLOCK = 16
PROMPT_A = [300 + i for i in range(4 * BLOCK)]
PROMPT_F = [2000 + 3 * i for i in range(8 * BLOCK - 1)]
COUNTERS = {
    "to_cpu": ("folio:kv_offload_blocks_total", {"direction": "to_cpu"}),
    "to_device": ("folio:kv_offload_blocks_total", {"direction": "to_device"}),
    "queries": ("folio:external_prefix_cache_queries_total", {}),
    "hits": ("folio:external_prefix_cache_hits_total", {}),
    "device_queries": ("folio:prefix_cache_queries_total", {}),
    "device_hits": ("folio:prefix_cache_hits_total", {}),
    "swapped": ("folio:num_swapped_preemptions_total", {}),
}


@pytest.fixture(scope="module")
def tiered_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--num-gpu-blocks-override", "8", "--max-model-len", "128", "--max-num-seqs", "1"]
    args += ["--kv-offloading-size", "0.01", "--enable-prefix-caching"]
    proc = start_server(Path(tmp_path_factory.mktemp("kv_tier")), "kv_tier", args)
    yield proc
    proc.stop()


def _counters(server: ServerProcess) -> dict[str, float]:
    values = server.metrics()
    return {key: metric(values, name, **labels) for key, (name, labels) in COUNTERS.items()}


def _complete(server: ServerProcess, prompt: list[int]) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": 1}
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return list(choice["logprobs"]["tokens"])


def test_counters_equal_the_known_counts(tiered_server: ServerProcess) -> None:
    assert "KV host tier: 14 blocks of 16 tokens" in tiered_server.log_tail(20000)
    before = _counters(tiered_server)
    first = _complete(tiered_server, PROMPT_A)
    _complete(tiered_server, PROMPT_F)
    again = _complete(tiered_server, PROMPT_A)
    assert again == first, "the host tier's K/V give the same greedy token"
    assert wait_until(lambda: server_is_idle(tiered_server), timeout_s=30), "the server must go idle"  # hang guard
    after = _counters(tiered_server)
    diff = {key: after[key] - before[key] for key in COUNTERS}
    assert diff == {
        "to_cpu": 4 + 3,  # A's 4 blocks evicted by F, then F6, F5, F4 evicted by A's second run
        "to_device": 3,  # A's first 3 blocks loaded back
        "queries": 64 + 127 + 64,  # nothing was ever found on the device: every token is a host query
        "hits": 3 * BLOCK,
        "device_queries": 64 + 127 + 64,
        "device_hits": 0,
        "swapped": 0,
    }, diff
    values = tiered_server.metrics()
    assert metric(values, "folio:kv_offload_cpu_usage_perc") == 0  # nothing swapped or being loaded: all free

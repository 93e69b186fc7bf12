"""The disk KV tier across restarts of a real `folio serve` (issue 18).

SmolLM2 with an 8-block device pool, a host tier and a disk tier: prompt A (64 tokens) is answered, the server is
stopped (SIGTERM: the core writes its 4 cached blocks to disk) and started again on the same directory. It finds the
4 blocks warm, and A again is a prefix hit from disk: 3 blocks (the last token is always recomputed), 48 tokens,
with the same greedy tokens.

That a directory written by another model is never read is tested on in-process engines
(tests/engine/test_kv_disk_tier.py): the directory's name comes from the worker, not from the server.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.server.conftest import ServerProcess, metric, start_server

BLOCK = 16
PROMPT_A = [300 + 7 * i for i in range(4 * BLOCK)]


def _disk_args(directory: Path, host_gib: str = "0.01", disk_gib: str = "0.05") -> list[str]:
    return ["--kv-offloading-size", host_gib, "--kv-offloading-disk-path", str(directory)] + [
        "--kv-offloading-disk-size",
        disk_gib,
    ]


def _complete(server: ServerProcess, prompt: list[int], max_tokens: int) -> tuple[str, list[str]]:
    """Greedy: (text, tokens)."""
    body = {"model": _served_name(server), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body["logprobs"] = 1
    response = httpx.post(server.url("/v1/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], list(choice["logprobs"]["tokens"])


def _served_name(server: ServerProcess) -> str:
    return str(httpx.get(server.url("/v1/models"), timeout=10).json()["data"][0]["id"])


def _disk_counters(server: ServerProcess, model_name: str) -> dict[str, float]:
    values = server.metrics()

    def get(name: str, **labels: str) -> float:
        wanted = [f'model_name="{model_name}"', *(f'{k}="{v}"' for k, v in labels.items())]
        for series, value in values.items():
            if series.startswith(name + "{") and all(label in series for label in wanted):
                return value
        raise KeyError(name)

    return {
        "to_disk": get("folio:kv_offload_blocks_total", direction="to_disk"),
        "from_disk": get("folio:kv_offload_blocks_total", direction="from_disk"),
        "external_hits": get("folio:external_prefix_cache_hits_total"),
        "device_hits": get("folio:prefix_cache_hits_total"),
        "failed_loads": get("folio:kv_offload_disk_failed_loads_total"),
    }


def test_a_restarted_server_answers_a_repeated_prompt_from_disk(tmp_path: Path) -> None:
    args = ["--num-gpu-blocks-override", "8", "--max-model-len", "128", "--max-num-seqs", "1"]
    args += _disk_args(tmp_path / "kv")
    first = start_server(tmp_path, "first", args)
    try:
        assert "0 blocks found warm" in first.log_tail(20000)
        tokens = _complete(first, PROMPT_A, max_tokens=6)
        name = _served_name(first)
    finally:
        first.stop()
    assert "KV disk tier: 4 blocks written at shutdown" in first.log_path.read_text()
    second = start_server(tmp_path, "second", args)
    try:
        assert "4 blocks found warm" in second.log_tail(20000)
        assert _disk_counters(second, name) == dict.fromkeys(
            ["to_disk", "from_disk", "external_hits", "device_hits", "failed_loads"], 0.0
        )
        assert _complete(second, PROMPT_A, max_tokens=6) == tokens
        assert _disk_counters(second, name) == {
            "to_disk": 0,
            "from_disk": 3,
            "external_hits": 3 * BLOCK,
            "device_hits": 0,
            "failed_loads": 0,
        }
        assert metric(second.metrics(), "folio:kv_offload_disk_usage_perc") > 0
    finally:
        second.stop()

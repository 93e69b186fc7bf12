"""The disk KV tier across restarts of a real `folio serve` (issue 18).

1. SmolLM2 with an 8-block device pool, a host tier and a disk tier: prompt A (64 tokens) is answered, the server is
   stopped (SIGTERM: the core writes its 4 cached blocks to disk) and started again on the same directory. It finds
   the 4 blocks warm, and A again is a prefix hit from disk: 3 blocks (the last token is always recomputed), 48 tokens,
   with the same greedy tokens.
2. Two tiny random Llamas of identical shapes (only their weights differ) share one directory: model B starts cold,
   never reads the files model A wrote (no disk hit, no failed load), leaves them as they were, and answers as B
   does with no tier at all (an in-process engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from folio import LLM, SamplingParams
from tests.server.conftest import ServerProcess, metric, start_server
from tests.tiny_models import save_tiny_llama

BLOCK = 16
PROMPT_A = [300 + 7 * i for i in range(4 * BLOCK)]
TINY_PROMPT = [1 + (5 * i) % 90 for i in range(40)]  # ids below the tiny models' vocabulary of 96


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


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> tuple[str, str]:
    """Two random Llamas of the same config (seeds 0 and 1), saved as safetensors with the default tokenizer."""
    model_a, model_b = (save_tiny_llama(tmp_path_factory.mktemp(f"tiny{s}"), s, tokenizer) for s in (0, 1))
    return model_a, model_b


def test_a_directory_written_by_another_model_is_never_read(tmp_path: Path, tiny_models: tuple[str, str]) -> None:
    model_a, model_b = tiny_models
    disk = tmp_path / "kv"
    # 64 device blocks, not the 512 MiB of TEST_KV_BYTES (65536 of the tiny model's 8 KiB blocks to build and zero)
    common = ["--max-model-len", "256", "--max-num-seqs", "1", "--num-gpu-blocks-override", "64"]
    common += _disk_args(disk, "0.001", "0.01")

    def serve(model: str, name: str) -> ServerProcess:
        return start_server(tmp_path, name, ["--model", model, *common])

    a = serve(model_a, "a")
    try:
        a_tokens = _complete(a, TINY_PROMPT, max_tokens=8)
    finally:
        a.stop()
    assert "KV disk tier: 2 blocks written at shutdown" in a.log_path.read_text()
    (a_dir,) = [path for path in disk.iterdir() if path.is_dir()]
    a_files = sorted(path.name for path in a_dir.glob("*.kv"))
    assert len(a_files) == 2
    a_contents = {name: (a_dir / name).read_bytes() for name in a_files}

    b = serve(model_b, "b")
    try:
        assert "0 blocks found warm" in b.log_tail(20000)
        b_tokens = _complete(b, TINY_PROMPT, max_tokens=8)
        counters = _disk_counters(b, _served_name(b))
        assert (counters["from_disk"], counters["external_hits"], counters["failed_loads"]) == (0, 0, 0), counters
    finally:
        b.stop()
    assert b_tokens != a_tokens, "the two models must answer differently, or a mix-up would not show"
    fresh = LLM(model=model_b, dtype="float32", kv_cache_memory_bytes=2**24, max_model_len=256)  # no tier at all
    params = SamplingParams(temperature=0.0, max_tokens=8)
    (expected,) = fresh.generate([{"prompt_token_ids": TINY_PROMPT}], params, use_tqdm=False)
    assert b_tokens[0] == expected.outputs[0].text
    assert sorted(path.name for path in a_dir.glob("*.kv")) == a_files  # B wrote its own directory only
    assert all((a_dir / name).read_bytes() == content for name, content in a_contents.items())
    assert len([path for path in disk.iterdir() if path.is_dir()]) == 2

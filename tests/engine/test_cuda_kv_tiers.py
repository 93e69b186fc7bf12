"""The KV tiers on CUDA (skipped without a GPU): the host tier's pinned, side-stream copies and the disk tier's
files change no output.

A tiny random Llama with a word-level tokenizer (both built here; the real GGUF cannot travel to the GPU
machines of this project) on a 20-block
device pool, 8 prompts sharing a 64-token prefix, sent twice (the second round reversed, so its prefixes were
evicted by then) and once more with seeded sampling: greedy and seeded outputs with swap preemption to the host
tier, and with a host tier so small that its drops go to disk, equal the plain engine's, in float32 and bfloat16;
and the copies did happen.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from folio import LLM, SamplingParams
from tests.engine.conftest import assert_no_leaks
from tests.tiny_models import save_tiny_llama

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    shape = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4}
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), max_position_embeddings=2048, **shape)


def _outputs(model: str, dtype: str, **tiers: Any) -> tuple[list[list[list[int]]], Any]:
    rng = random.Random(0)
    system = [rng.randrange(3, 512) for _ in range(64)]
    prompts: list[Any] = [
        {"prompt_token_ids": system + [rng.randrange(3, 512) for _ in range(40 + 8 * i)]} for i in range(8)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
    llm = LLM(model=model, device="cuda", dtype=dtype, max_model_len=256, enable_prefix_caching=True, **tiers)
    first = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy, use_tqdm=False)]
    second = [r.outputs[0].token_ids for r in llm.generate(prompts[::-1], greedy, use_tqdm=False)][::-1]
    sampled = [r.outputs[0].token_ids for r in llm.generate(prompts[:4], seeded, use_tqdm=False)]
    stats = llm.llm_engine.engine_core.scheduler.get_stats()
    assert_no_leaks(llm)
    return [first, second, sampled], stats


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiers_on_cuda_change_no_output(tiny_model: str, dtype: str, tmp_path: Path) -> None:
    plain, _ = _outputs(tiny_model, dtype)
    small = {"num_gpu_blocks_override": 20, "kv_offloading_size": 0.01, "preemption_mode": "swap"}
    swapped, stats = _outputs(tiny_model, dtype, **small)
    assert swapped == plain
    assert stats.num_swapped_preemptions_total > 0 and stats.kv_offload_blocks_to_device_total > 0
    disk = {"kv_offloading_size": 0.0002, "kv_offloading_disk_path": str(tmp_path), "kv_offloading_disk_size": 0.05}
    disked, stats = _outputs(tiny_model, dtype, num_gpu_blocks_override=20, **disk)
    assert disked == plain
    assert stats.kv_offload_blocks_to_disk_total > 0 and stats.kv_offload_blocks_from_disk_total > 0

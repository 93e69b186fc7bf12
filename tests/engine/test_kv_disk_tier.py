"""The disk KV tier on the real model (issue 18): a 12-block device pool, a 7-block host tier and a disk tier under
it. Six distinct 80-token prompts are sent twice (two rounds); by the second round the first prompts' blocks have
gone device -> host -> disk and are loaded back from their files. Greedy outputs must equal the plain engine's (no
tier), with files written and loaded, and again after a restart on the same directory (the shutdown flush leaves
the prefix cache warm), and after files were damaged or deleted behind the engine's back (those loads fail and the
tokens are recomputed). Last, two tiny random Llamas of the same shapes share one directory: neither reads the
other's files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from folio import LLM, SamplingParams
from folio.core.sched_stats import SchedulerStats
from tests.engine.conftest import assert_no_leaks
from tests.tiny_models import save_tiny_llama

BLOCK = 16
PROMPTS = [[(131 * i + 17 * j) % 5000 + 300 for j in range(5 * BLOCK)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SMALL_POOL: dict[str, Any] = dict(num_gpu_blocks_override=12, max_model_len=128, max_num_seqs=2)
HOST_GIB = 0.005  # 7 blocks of SmolLM2 in float32
DISK_GIB = 0.05  # 72 block files: every block the host tier drops fits


def _tiered(directory: Path) -> LLM:
    return LLM(
        dtype="float32",
        **SMALL_POOL,
        kv_offloading_size=HOST_GIB,
        kv_offloading_disk_path=str(directory),
        kv_offloading_disk_size=DISK_GIB,
    )


def _two_rounds(llm: LLM) -> tuple[list[list[int]], SchedulerStats]:
    tokens = []
    for _ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        assert_no_leaks(llm)  # every tier's blocks free again (no pin or plan left in the disk tier)
        tokens += [list(out.outputs[0].token_ids) for out in outputs]
    return tokens, llm.llm_engine.scheduler.get_stats()


def _block_files(directory: Path) -> list[Path]:
    (subdirectory,) = [path for path in directory.iterdir() if path.is_dir()]
    return sorted(subdirectory.glob("*.kv"))


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return _two_rounds(LLM(dtype="float32", **SMALL_POOL))[0]


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("kv_disk")


@pytest.fixture(scope="module")
def first_run(disk_dir: Path) -> tuple[list[list[int]], SchedulerStats, int]:
    """Two rounds, then the shutdown flush: (tokens, stats, files after the flush)."""
    llm = _tiered(disk_dir)
    tokens, stats = _two_rounds(llm)
    llm.llm_engine.engine_core.shutdown()
    return tokens, stats, len(_block_files(disk_dir))


def test_blocks_dropped_to_disk_and_loaded_back_keep_greedy_outputs(
    plain: list[list[int]], first_run: tuple[list[list[int]], SchedulerStats, int]
) -> None:
    tokens, stats, _ = first_run
    assert stats.kv_offload_blocks_to_disk_total > 0, stats
    assert stats.kv_offload_blocks_from_disk_total > 0, stats
    assert stats.kv_offload_disk_failed_loads_total == 0, stats
    assert stats.external_prefix_cache_hits > 0, stats
    assert tokens == plain
    assert tokens[:6] == tokens[6:]  # and each round gives the same output for the same prompt


def test_a_restart_on_the_same_directory_starts_warm(
    plain: list[list[int]], first_run: tuple[list[list[int]], SchedulerStats, int], disk_dir: Path
) -> None:
    _, _, num_files = first_run
    assert num_files == 6 * 5  # every full block of the workload (80 prompt + 15 computed output tokens: 5 each)
    restarted = _tiered(disk_dir)
    disk = restarted.llm_engine.kv_cache_manager.disk_tier
    assert disk is not None and disk.num_warm_blocks == num_files
    outputs = restarted.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert_no_leaks(restarted)
    warm = restarted.llm_engine.scheduler.get_stats()
    # every prompt's 4 lookup blocks were on disk: nothing of this engine was on the device or the host before
    assert warm.kv_offload_blocks_from_disk_total == 6 * 4, warm
    assert warm.external_prefix_cache_hits == 6 * 4 * BLOCK and warm.prefix_cache_hits == 0, warm
    assert [list(out.outputs[0].token_ids) for out in outputs] == plain[:6]


def test_damaged_or_missing_files_are_recomputed(plain: list[list[int]], tmp_path: Path) -> None:
    llm = _tiered(tmp_path)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    num_dropped = llm.llm_engine.scheduler.get_stats().kv_offload_blocks_to_disk_total
    llm.llm_engine.engine_core.shutdown()  # writes what the device and host tiers still cache
    files = _block_files(tmp_path)
    assert len(files) == 6 * 5 > num_dropped
    for path in files[::3]:  # every third file: one byte flipped, truncated, or deleted
        choice = files.index(path) // 3 % 3
        data = bytearray(path.read_bytes())
        if choice == 0:
            data[len(data) // 2] ^= 0x01
            path.write_bytes(bytes(data))
        elif choice == 1:
            path.write_bytes(bytes(data[:-1]))
        else:
            path.unlink()
    restarted = _tiered(tmp_path)
    outputs = restarted.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert_no_leaks(restarted)
    stats = restarted.llm_engine.scheduler.get_stats()
    assert stats.kv_offload_disk_failed_loads_total > 0 and stats.kv_offload_blocks_from_disk_total > 0, stats
    assert [list(out.outputs[0].token_ids) for out in outputs] == plain[:6]


TINY_PROMPT = [1 + (5 * i) % 90 for i in range(40)]  # ids below the tiny models' vocabulary of 96
TINY_GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
# 64 device blocks, not the budget of TEST_KV_BYTES (65536 of the tiny model's 8 KiB blocks to build and zero)
TINY_POOL: dict[str, Any] = dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=256, max_num_seqs=1)


def _tiny_tiered(model: str, directory: Path) -> LLM:
    disk = dict(kv_offloading_disk_path=str(directory), kv_offloading_disk_size=0.01)
    return LLM(model=model, **TINY_POOL, kv_offloading_size=0.001, **disk)


def _tiny_tokens(llm: LLM) -> list[int]:
    (output,) = llm.generate([{"prompt_token_ids": TINY_PROMPT}], TINY_GREEDY, use_tqdm=False)
    assert_no_leaks(llm)
    return list(output.outputs[0].token_ids)


def test_a_directory_written_by_another_model_is_never_read(tmp_path: Path, tokenizer: Any) -> None:
    """Two tiny random Llamas of identical shapes (only their weights differ) share one directory: model B starts
    cold, never reads the files model A wrote (no disk hit, no failed load), leaves them as they were, and answers
    as B does with no tier at all."""
    model_a, model_b = (save_tiny_llama(tmp_path / f"tiny{seed}", seed, tokenizer) for seed in (0, 1))
    disk = tmp_path / "kv"
    a = _tiny_tiered(model_a, disk)
    a_tokens = _tiny_tokens(a)
    a.llm_engine.engine_core.shutdown()  # the flush: the prompt's 2 full blocks (40 + 7 computed tokens)
    (a_dir,) = [path for path in disk.iterdir() if path.is_dir()]
    a_files = sorted(path.name for path in a_dir.glob("*.kv"))
    assert len(a_files) == 2
    a_contents = {name: (a_dir / name).read_bytes() for name in a_files}

    b = _tiny_tiered(model_b, disk)
    b_disk = b.llm_engine.kv_cache_manager.disk_tier
    assert b_disk is not None and b_disk.num_warm_blocks == 0
    b_tokens = _tiny_tokens(b)
    stats = b.llm_engine.scheduler.get_stats()
    assert stats.kv_offload_blocks_from_disk_total == 0, stats
    assert stats.external_prefix_cache_hits == 0 and stats.kv_offload_disk_failed_loads_total == 0, stats
    b.llm_engine.engine_core.shutdown()
    assert b_tokens != a_tokens, "the two models must answer differently, or a mix-up would not show"
    assert b_tokens == _tiny_tokens(LLM(model=model_b, **TINY_POOL))  # no tier at all
    assert sorted(path.name for path in a_dir.glob("*.kv")) == a_files  # B wrote its own directory only
    assert all((a_dir / name).read_bytes() == content for name, content in a_contents.items())
    assert len([path for path in disk.iterdir() if path.is_dir()]) == 2

"""Where the data-parallel engine cores run (folio/engine/dp_client.py), without starting them: the CPU threads and
the default KV budget split among the cores, each core's slice of the GPUs, and the settings refused at start
naming the flag and the limit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from folio.config import EngineArgs, EngineConfig
from folio.engine.dp_client import check_data_parallel, plan_engines


def config(**kwargs: object) -> EngineConfig:
    return EngineArgs(**kwargs).create_engine_config("unused-model-path", 2048)  # type: ignore[arg-type]


def test_one_core_runs_as_before() -> None:
    cfg = config()
    assert plan_engines(cfg, 1, 8, []) == [(cfg, None)]


@pytest.mark.parametrize(("threads", "per_core"), [(4, 2), (5, 2), (2, 1), (1, 1)])
def test_cpu_cores_split_the_threads(threads: int, per_core: int) -> None:
    plans = plan_engines(config(device="cpu", kv_cache_memory_bytes=2**20), 2, threads, [])
    assert [placement.num_cpu_threads for _, placement in plans if placement] == [per_core, per_core]
    assert [placement.cuda_visible_devices for _, placement in plans if placement] == [None, None]
    assert [cfg.cache_config.kv_cache_memory_bytes for cfg, _ in plans] == [2**20, 2**20]  # given: per core


def test_the_default_cpu_kv_budget_is_divided_among_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Free RAM is read once and divided: other processes allocating meanwhile (here, 1 GiB less at every read)
    must not give the cores different budgets (CI caught 1493728051 against 1493477990 bytes)."""
    free = iter(range(10 * 2**30, 0, -(2**30)))
    monkeypatch.setattr("folio.worker.kv_cache_shape.mem_available_bytes", lambda: next(free))
    cfg = config(device="cpu")
    plans = plan_engines(cfg, 2, 2, [])
    budgets = [engine_cfg.cache_config.kv_cache_memory_bytes for engine_cfg, _ in plans]
    assert budgets == [int(10 * 2**30 * 0.3) // 2] * 2  # 30% of the free 10 GiB, halved
    assert cfg.cache_config.kv_cache_memory_bytes is None  # each core got its own copy
    plans = plan_engines(config(device="cpu"), 2, 2, [])  # 9 GiB free now
    assert [engine_cfg.cache_config.kv_cache_memory_bytes for engine_cfg, _ in plans] == [int(9 * 2**30 * 0.3) // 2] * 2


def test_cuda_cores_take_consecutive_gpu_slices() -> None:
    plans = plan_engines(config(device="cuda", tensor_parallel_size=2), 2, 16, ["0", "1", "2", "3"])
    assert [placement.cuda_visible_devices for _, placement in plans if placement] == ["0,1", "2,3"]
    plans = plan_engines(config(device="cuda"), 2, 16, ["4", "6"])  # the user's CUDA_VISIBLE_DEVICES order
    assert [placement.cuda_visible_devices for _, placement in plans if placement] == ["4", "6"]
    assert [placement.num_cpu_threads for _, placement in plans if placement] == [None, None]


def test_bad_settings_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data_parallel_size \(--data-parallel-size\) must be >= 1, got 0"):
        check_data_parallel(config(), 0)
    with pytest.raises(ValueError, match="names one GPU"):
        check_data_parallel(config(device="cuda:1"), 2)
    disk = config(kv_offloading_size=0.01, kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=0.01)
    with pytest.raises(ValueError, match="kv_offloading_disk_path with data_parallel_size"):
        check_data_parallel(disk, 2)
    check_data_parallel(disk, 1)  # one core owns the directory


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="this machine has the GPUs")
def test_more_ranks_than_gpus_is_refused() -> None:
    num_gpus = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"needs 4 GPUs \(one per rank\); this machine has {num_gpus}"):
        check_data_parallel(config(device="cuda", tensor_parallel_size=2), 2)

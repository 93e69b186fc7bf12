"""The host KV tier on the worker side (issue 18): the batched store / load execution against a block-by-block
torch reference, the host tier's size and RAM check, the engine flags' validation, and a real engine started with
a host tier (its size resolved, logged and reported, the copies run by the model runner)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from folio import LLM, SamplingParams
from folio.cli import build_parser, engine_args_from
from folio.config import EngineArgs
from folio.core.sched_output import SchedulerOutput
from folio.kernels.cpu_kernels import load_cpu_kernels
from folio.kernels.kv_block_copy import BlockCopy, CpuBlockCopy, aten_copy_blocks
from folio.worker.kv_cache_shape import KVCacheShape
from folio.worker.kv_offload import HostKVCache, KVTransfer, mem_available_bytes, resolve_num_host_blocks
from tests.small_engine import SMALL_ENGINE

CPU = torch.device("cpu")


def _random_caches(shape: KVCacheShape, num_device: int, num_host: int, seed: int) -> tuple[list, HostKVCache]:
    gen = torch.Generator().manual_seed(seed)
    device = shape.allocate(num_device, CPU)
    for cache in device:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(shape.dtype))
    host = HostKVCache(
        shape.num_layers,
        num_host,
        shape.block_size,
        shape.num_kv_heads,
        shape.head_dim,
        shape.dtype,
        shape.head_major,
        pin_memory=False,
    )
    for cache in host.caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(shape.dtype))
    return device, host


def _host_view(host: HostKVCache, layer: int) -> torch.Tensor:
    """A host layer cache indexed as the device's: [2, blocks, block_size, num_kv_heads, head_dim]."""
    cache = host.caches[layer]
    return cache.transpose(2, 3) if host.head_major else cache


def _reference(
    device: list[torch.Tensor], host: list[torch.Tensor], stores: list[tuple[int, int]], loads: list[tuple[int, int]]
) -> None:
    """One block at a time, in list order: every store, then every load (SchedulerOutput's contract)."""
    for dev, hst in zip(device, host, strict=True):
        for d, h in stores:
            hst[:, h] = dev[:, d]
        for h, d in loads:
            dev[:, d] = hst[:, h]


def _pairs(rng: random.Random, n: int, num_src: int, num_dst: int) -> list[tuple[int, int]]:
    """Random pairs with repeated and adjacent ids: runs of consecutive ids plus draws from a small range."""
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n:
        if rng.random() < 0.5:  # a run of adjacent blocks
            s, d, k = rng.randrange(num_src), rng.randrange(num_dst), rng.randint(1, 4)
            pairs += [((s + i) % num_src, (d + i) % num_dst) for i in range(k)]
        else:  # from a few ids only, so ids repeat (a source twice, a destination twice)
            pairs.append((rng.randrange(min(4, num_src)), rng.randrange(min(4, num_dst))))
    return pairs[:n]


def _block_copy(name: str) -> BlockCopy:
    """ATen's gather-then-scatter, or the C call of the native tier's library."""
    if name == "aten":
        return aten_copy_blocks
    copy = load_cpu_kernels(None, torch.float32).block_copy
    assert isinstance(copy, CpuBlockCopy)
    return copy


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("copier", ["aten", "folio"])
def test_batched_copies_match_the_block_by_block_reference(
    head_major: bool, dtype: torch.dtype, seed: int, copier: str
) -> None:
    shape = KVCacheShape(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, head_major=head_major)
    device, host = _random_caches(shape, num_device=12, num_host=20, seed=seed)
    ref_device = [c.clone() for c in device]
    ref_host = [_host_view(host, layer).clone() for layer in range(shape.num_layers)]
    rng = random.Random(seed)
    stores = _pairs(rng, 10, 12, 20)
    loads = _pairs(rng, 10, 20, 12)
    loads.append((stores[0][1], stores[0][0]))  # a stored block's host copy loaded back into it
    loads.append(((stores[-1][1] + 1) % 20, stores[-1][0]))  # a block stored this step is a load destination
    _reference(ref_device, ref_host, stores, loads)
    KVTransfer(device, host, CPU, _block_copy(copier)).execute(stores, loads)
    for layer in range(shape.num_layers):
        assert torch.equal(device[layer], ref_device[layer])
        assert torch.equal(_host_view(host, layer), ref_host[layer])


def test_stores_run_before_loads_into_the_same_device_block() -> None:
    """Device block 1 is stored to host block 5 and, in the same step, loaded from host block 2: host 5 gets the
    old contents, device 1 the loaded ones. Loads first would store the loaded contents instead."""
    shape = KVCacheShape(num_layers=2, block_size=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    device, host = _random_caches(shape, num_device=3, num_host=6, seed=7)
    old_device_1 = [c[:, 1].clone() for c in device]
    host_2 = [_host_view(host, layer)[:, 2].clone() for layer in range(2)]
    KVTransfer(device, host, CPU).execute(stores=[(1, 5)], loads=[(2, 1)])
    for layer in range(2):
        assert torch.equal(_host_view(host, layer)[:, 5], old_device_1[layer])
        assert torch.equal(device[layer][:, 1], host_2[layer])


def test_host_tier_layout_matches_the_device_per_block() -> None:
    """Head-major host storage like the device's: one block's K is one contiguous run in both."""
    shape = KVCacheShape(num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, head_major=True)
    host = HostKVCache(1, 3, 4, 2, 8, torch.float32, True, pin_memory=False)
    assert host.caches[0].shape == (2, 3, 2, 4, 8)
    assert host.bytes_per_block == shape.bytes_per_block
    assert host.nbytes == 3 * shape.bytes_per_block


def test_num_host_blocks_and_the_ram_check() -> None:
    assert resolve_num_host_blocks(0.0, 1000, available_bytes=10) == 0
    assert resolve_num_host_blocks(1.0, 2**20, available_bytes=2**31) == 1024
    assert resolve_num_host_blocks(0.5, 3 * 2**20, available_bytes=None) == 2**29 // (3 * 2**20)  # floor
    with pytest.raises(ValueError, match=r"--kv-offloading-size 4 GiB \(4294967296 bytes\).*available: 2\.00 GiB"):
        resolve_num_host_blocks(4.0, 2**20, available_bytes=2 * 2**30)
    with pytest.raises(ValueError, match="--kv-offloading-size 1e-09 GiB holds no KV block"):
        resolve_num_host_blocks(1e-9, 2**20, available_bytes=None)
    with pytest.raises(ValueError, match="kv_offloading_size must be >= 0"):
        resolve_num_host_blocks(-1.0, 2**20, available_bytes=None)


def test_mem_available_reads_proc_meminfo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       16000000 kB\nMemFree:         1000 kB\nMemAvailable:    2048 kB\n")
    assert mem_available_bytes(str(fake)) == 2048 * 1024
    assert mem_available_bytes(str(tmp_path / "missing")) is None
    available = mem_available_bytes()
    assert available is not None and available > 0  # Linux: the real file


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-offloading-size", "-1"], "kv_offloading_size must be >= 0"),
        (["--kv-offloading-size", "nan"], "kv_offloading_size must be >= 0"),
    ],
)
def test_flag_validation_names_the_field(argv: list[str], message: str) -> None:
    ns = build_parser().parse_args(["generate", "hi", *argv])
    with pytest.raises(ValueError, match=message):
        engine_args_from(ns).create_engine_config("model", 2048)


def test_flags_reach_the_engine_config() -> None:
    ns = build_parser().parse_args(["serve", "--kv-offloading-size", "1.5", "--preemption-mode", "recompute"])
    config = engine_args_from(ns).create_engine_config("model", 2048)
    assert config.cache_config.kv_offloading_size == 1.5
    assert config.scheduler_config.preemption_mode == "recompute"
    default = EngineArgs().create_engine_config("model", 2048)
    assert default.cache_config.kv_offloading_size == 0 and default.scheduler_config.preemption_mode is None
    with pytest.raises(SystemExit):  # argparse's choices: not a mode
        build_parser().parse_args(["serve", "--preemption-mode", "spill"])
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        EngineArgs(preemption_mode="spill").create_engine_config("model", 2048)
    with pytest.raises(ValueError, match="preemption_mode 'swap' needs a host KV tier: set kv_offloading_size"):
        EngineArgs(preemption_mode="swap").create_engine_config("model", 2048)


def test_engine_with_a_host_tier_larger_than_ram_fails_at_start() -> None:
    available = mem_available_bytes()
    assert available is not None
    too_big = 2 * available / 2**30
    with pytest.raises(ValueError, match=rf"--kv-offloading-size {too_big:g} GiB .* more than the RAM available"):
        LLM(
            dtype="float32",
            **SMALL_ENGINE,
            kv_offloading_size=too_big,
        )


def test_engine_resolves_logs_and_executes_with_a_host_tier(caplog: pytest.LogCaptureFixture) -> None:
    """A real engine with a 64 MiB host tier: num_host_blocks resolved before the core is built, logged next to
    the KV cache line; greedy output unchanged; a store and a load planned by hand run through the model runner."""
    with caplog.at_level(logging.INFO, logger="folio"):
        llm = LLM(
            dtype="float32",
            **SMALL_ENGINE,
            kv_offloading_size=1 / 16,
        )
    engine = llm.llm_engine
    worker = engine.executor.worker
    num_host = engine.config.cache_config.num_host_blocks
    assert num_host == (2**26) // worker.kv_shape.bytes_per_block > 0
    assert worker.host_kv_cache.num_blocks == num_host
    assert f"KV host tier: {num_host} blocks of 16 tokens" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base = LLM(dtype="float32", **SMALL_ENGINE)
    prompt = {"prompt_token_ids": list(range(100, 140))}
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == (
        base.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    )
    runner = worker.model_runner
    # the CPU plan's block copy, for the host tier's copies and copy-on-write alike
    assert isinstance(runner.block_copy, CpuBlockCopy) and runner.kv_transfer.block_copy is runner.block_copy
    step = SchedulerOutput.make_empty()
    step.kv_stores, step.kv_loads = [(0, num_host - 1)], [(num_host - 1, 5)]
    runner.execute_model(step)
    for layer, cache in enumerate(runner.kv_caches):
        assert torch.equal(cache[:, 5], cache[:, 0])
        assert torch.equal(_host_view(worker.host_kv_cache, layer)[:, num_host - 1], cache[:, 0].cpu())

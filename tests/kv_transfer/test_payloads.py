"""A block's bytes out of one KV cache and into another (folio/worker/kv_connector.py): float32 and bfloat16,
token-major and head-major storage, across the two; loads refused for another layout; sends to a real receiver."""

from __future__ import annotations

import socket

import pytest
import torch

from folio.core.remote_kv import RemoteKVStore
from folio.core.sched_output import KVSend, ModelRunnerOutput, RemoteLoad, SchedulerOutput
from folio.kv_transfer.receiver import KVReceiver
from folio.worker.kv_cache_shape import KVCacheShape
from folio.worker.kv_connector import RemoteKVLoader, WorkerKVConnector, gather_payloads, scatter_payloads

FP = b"L" * 32


def _caches(dtype: torch.dtype, head_major: bool, seed: int) -> tuple[KVCacheShape, list[torch.Tensor]]:
    shape = KVCacheShape(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype, head_major=head_major)
    caches = shape.allocate(6, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=generator).to(dtype))
    return shape, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("src_head_major", "dst_head_major"), [(False, False), (True, True), (True, False)])
def test_round_trip(dtype: torch.dtype, src_head_major: bool, dst_head_major: bool) -> None:
    shape, src = _caches(dtype, src_head_major, seed=0)
    _, dst = _caches(dtype, dst_head_major, seed=1)
    before = [cache.clone() for cache in dst]
    payloads = gather_payloads(src, [3, 1])
    assert payloads.dtype == torch.uint8 and payloads.shape == (2, shape.bytes_per_block)
    scatter_payloads(dst, [0, 5], payloads)
    for layer in range(3):
        assert torch.equal(dst[layer][:, 0], src[layer][:, 3]) and torch.equal(dst[layer][:, 5], src[layer][:, 1])
        for untouched in (1, 2, 3, 4):
            assert torch.equal(dst[layer][:, untouched], before[layer][:, untouched])
    if src_head_major:  # the payload is token-major whatever the storage: block 3, layer 0, K, token 1, head 1
        row = payloads[0].view(dtype).view(3, 2, 4, 2, 8)
        assert torch.equal(row[0, 0, 1, 1], src[0][0, 3, 1, 1])


def test_loader_refuses_another_layout() -> None:
    shape, src = _caches(torch.float32, False, seed=0)
    _, dst = _caches(torch.float32, False, seed=1)
    before = dst[0].clone()
    payloads = gather_payloads(src, [0, 1, 2])
    loader = RemoteKVLoader(dst, FP, shape.bytes_per_block)
    loads = [
        RemoteLoad(0xA, 4, FP, bytearray(payloads[0].numpy().tobytes())),
        RemoteLoad(0xB, 5, b"O" * 32, bytearray(payloads[1].numpy().tobytes())),  # another model's fingerprint
        RemoteLoad(0xC, 3, FP, bytearray(payloads[2].numpy().tobytes()[:-4])),  # short
    ]
    assert loader.load(loads) == [(0xB, 5), (0xC, 3)]
    assert torch.equal(dst[0][:, 4], src[0][:, 0])
    assert torch.equal(dst[0][:, 5], before[:, 5]) and torch.equal(dst[0][:, 3], before[:, 3])
    assert loader.take_num_failed() == 2 and loader.take_num_failed() == 0


def test_sends_reach_the_receiver_and_a_dead_consumer_fails_only_its_send() -> None:
    shape, caches = _caches(torch.bfloat16, True, seed=2)
    store = RemoteKVStore(1 << 20)
    receiver = KVReceiver("127.0.0.1", 0, store)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
        try:
            host, port = receiver.address
            sched = SchedulerOutput.make_empty()
            sched.kv_sends = [
                KVSend("a", host, port, [2, 4], [0x2, 0x4]),
                KVSend("dead", "127.0.0.1", dead_port, [1], [0x1]),
                KVSend("failed-load", host, port, [5], [0x5]),  # its loads failed: its K/V were never computed
            ]
            output = ModelRunnerOutput([], [], [], kv_load_failures={"failed-load": 0})
            WorkerKVConnector(caches, FP, None).finish_step(sched, output)
        finally:
            receiver.close()
    result = output.kv_transfer
    assert result is not None
    assert (result.num_sent_blocks, result.num_sent_bytes, result.num_failed_sends) == (2, 2 * shape.bytes_per_block, 1)
    assert store.hashes() == [0x4, 0x2]
    block = store.get(0x2)
    assert block is not None and block.fingerprint == FP
    assert bytes(block.payload) == gather_payloads(caches, [2]).numpy().tobytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_round_trip_between_cuda_and_cpu() -> None:
    """Payloads leave a CUDA cache as CPU bytes and land in a CUDA cache (and a CPU one) unchanged."""
    shape = KVCacheShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    src = shape.allocate(4, torch.device("cuda"))
    for cache in src:
        cache.copy_(torch.randn(cache.shape, device="cuda").to(torch.bfloat16))
    payloads = gather_payloads(src, [2])
    assert payloads.device.type == "cpu"
    for device in ("cuda", "cpu"):
        dst = shape.allocate(4, torch.device(device))
        scatter_payloads(dst, [1], payloads)
        assert all(torch.equal(d[:, 1].cpu(), s[:, 2].cpu()) for d, s in zip(dst, src, strict=True))

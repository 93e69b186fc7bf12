"""Disaggregated prefill and decode on this machine (docs/scale_out.md, "Disaggregated prefill and decode").

transfer: the KV transfer alone, in one process, for SmolLM2-135M's KV layout (30 layers, 3 KV heads of 64, blocks of
16 tokens): copy a prompt's blocks out of a KV cache (``gather_payloads``), send them over TCP on 127.0.0.1 to a real
receiver thread that stores them and acks (``wire.send_blocks``), copy them into another cache (``scatter_payloads``).
Median of --repeats per prompt length, float32 and bfloat16.

ttft: a producer `folio serve` (kv_producer), a consumer `folio serve` (kv_consumer) and `folio proxy` over them,
against one plain `folio serve`; every server float32 on 1 thread (OMP_NUM_THREADS=1) with 512 MiB of KV, so the
pair has 2 cores and the single server 1, each engine the same compute. Per prompt length, `folio bench serve`'s
client sends the same seeded random prompts one at a time (no queueing) with 16 new tokens each, to the proxy and
then to the single server; a new seed per length, so no prompt is cached anywhere. The producer's counters give the
transfer's share.

    python benchmarks/disaggregated.py transfer
    python benchmarks/disaggregated.py ttft --lengths 128 512 1000 --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from folio.bench.server_proc import wait_healthy

BLOCK = 16
SMOLLM2_KV = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}


def transfer(lengths: list[int], repeats: int) -> None:
    import torch

    from folio.core.remote_kv import RemoteKVStore
    from folio.kv_transfer import wire
    from folio.kv_transfer.receiver import KVReceiver
    from folio.worker.kv_cache_shape import KVCacheShape
    from folio.worker.kv_connector import gather_payloads, scatter_payloads

    torch.set_num_threads(1)
    for dtype in (torch.float32, torch.bfloat16):
        shape = KVCacheShape(block_size=BLOCK, dtype=dtype, **SMOLLM2_KV)
        num_blocks = max(lengths) // BLOCK + 1
        src = shape.allocate(num_blocks, torch.device("cpu"))
        dst = shape.allocate(num_blocks, torch.device("cpu"))
        store = RemoteKVStore(1 << 31)
        receiver = KVReceiver("127.0.0.1", 0, store)
        host, port = receiver.address
        try:
            for length in lengths:
                ids = list(range(length // BLOCK))
                times: dict[str, list[float]] = {"copy out": [], "send + ack": [], "copy in": []}
                for _ in range(repeats):
                    start = time.perf_counter()
                    payloads = gather_payloads(src, ids)
                    sent = time.perf_counter()
                    view = memoryview(payloads.reshape(-1).numpy().data).cast("B")
                    wire.send_blocks(host, port, b"B" * 32, ids, view, timeout_s=60)
                    acked = time.perf_counter()
                    rows = torch.stack([torch.frombuffer(store.pop(i).payload, dtype=torch.uint8) for i in ids])
                    scatter_payloads(dst, ids, rows)
                    done = time.perf_counter()
                    for key, seconds in zip(times, (sent - start, acked - sent, done - acked), strict=True):
                        times[key].append(seconds)
                medians = {key: statistics.median(values) * 1e3 for key, values in times.items()}
                total = sum(medians.values())
                print(
                    f"{str(dtype).removeprefix('torch.')} | {length} tokens = {len(ids)} blocks of "
                    f"{shape.bytes_per_block} B ({len(ids) * shape.bytes_per_block / 2**20:.1f} MiB) | "
                    + " | ".join(f"{key} {ms:.1f} ms" for key, ms in medians.items())
                    + f" | total {total:.1f} ms = {total / len(ids):.2f} ms per block",
                    flush=True,
                )
        finally:
            receiver.close()


def _folio(*args: str) -> list[str]:
    return [sys.executable, "-m", "folio.cli", *args]


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)


def _counter(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    return 0.0


def ttft(lengths: list[int], num_prompts: int) -> None:
    from folio.bench.datasets import requests_from_args
    from folio.bench.serve import add_serve_bench_args, benchmark_server, dataset_vocabulary
    from folio.bench.server_proc import free_port

    os.environ["OMP_NUM_THREADS"] = "1"
    common = ["--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(512 * 2**20)]
    common += ["--uvicorn-log-level", "warning"]
    ports = {name: free_port() for name in ("producer", "consumer", "single", "proxy", "kv")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    producer_config = {"kv_connector": "TcpConnector", "kv_role": "kv_producer"}
    consumer_config = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_port": ports["kv"]}
    with tempfile.TemporaryDirectory() as tmp:
        logs = {name: Path(tmp) / f"{name}.log" for name in ports}
        procs = {
            "producer": _start(
                _folio(
                    "serve",
                    "--port",
                    str(ports["producer"]),
                    *common,
                    "--kv-transfer-config",
                    json.dumps(producer_config),
                ),
                logs["producer"],
            ),
            "consumer": _start(
                _folio(
                    "serve",
                    "--port",
                    str(ports["consumer"]),
                    *common,
                    "--kv-transfer-config",
                    json.dumps(consumer_config),
                ),
                logs["consumer"],
            ),
            "single": _start(_folio("serve", "--port", str(ports["single"]), *common), logs["single"]),
        }
        try:
            for name, process in procs.items():
                wait_healthy(url[name], process, logs[name], 600)
            proxy_args = ["--prefill", url["producer"], "--decode", url["consumer"], "--port", str(ports["proxy"])]
            procs["proxy"] = _start(_folio("proxy", *proxy_args, "--decode-kv-port", str(ports["kv"])), logs["proxy"])
            wait_healthy(url["proxy"], procs["proxy"], logs["proxy"], 600)
            for seed, length in enumerate(lengths, start=1):
                parser = argparse.ArgumentParser()
                add_serve_bench_args(parser)
                ns = parser.parse_args(
                    ["--dataset-name", "random", "--random-input-len", str(length), "--random-output-len", "16"]
                    + ["--num-prompts", str(num_prompts), "--max-concurrency", "1", "--seed", str(seed)]
                )
                vocab_size, special_ids, tokenize = dataset_vocabulary("random", None)
                requests = requests_from_args(ns, vocab_size, special_ids, tokenize, None)
                row: dict[str, Any] = {}
                sent_before = _counter(url["producer"], "folio:kv_transfer_sent_blocks_total")
                seconds_before = _counter(url["producer"], "folio:kv_transfer_send_seconds_total")
                for target in ("proxy", "single"):
                    result, _ = benchmark_server(url[target], "SmolLM2-135M-Instruct", requests, ns, {})
                    assert result["completed"] == num_prompts, result["errors"]
                    row[target] = (result["mean_ttft_ms"], result["median_ttft_ms"], result["mean_tpot_ms"])
                blocks = _counter(url["producer"], "folio:kv_transfer_sent_blocks_total") - sent_before
                seconds = _counter(url["producer"], "folio:kv_transfer_send_seconds_total") - seconds_before
                print(
                    f"{length} tokens | proxy TTFT mean {row['proxy'][0]:.0f} ms, median {row['proxy'][1]:.0f} ms, "
                    f"TPOT {row['proxy'][2]:.1f} ms | single TTFT mean {row['single'][0]:.0f} ms, median "
                    f"{row['single'][1]:.0f} ms, TPOT {row['single'][2]:.1f} ms | producer's sends: "
                    f"{seconds / num_prompts * 1e3:.1f} ms per prompt, {seconds / blocks * 1e3:.2f} ms per block",
                    flush=True,
                )
        finally:
            for process in procs.values():
                process.terminate()
            for process in procs.values():
                process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("transfer")
    one.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1000, 2000])
    one.add_argument("--repeats", type=int, default=10)
    two = sub.add_parser("ttft")
    two.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1000])
    two.add_argument("--num-prompts", type=int, default=8)
    args = parser.parse_args()
    if args.what == "transfer":
        transfer(args.lengths, args.repeats)
    else:
        ttft(args.lengths, args.num_prompts)


if __name__ == "__main__":
    main()

"""The engine's command-line flags (vLLM's names), shared by `folio serve | generate | chat` and `folio bench`:
defined once here from EngineArgs' defaults, and turned back into EngineArgs."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from folio.config import (
    CPU_ALLREDUCE_CHOICES,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    MODEL_IMPLS,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    SUPPORTED_DTYPES,
    EngineArgs,
)
from folio.kernels.isa import CPU_ISA_CHOICES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags with vLLM's names; defaults come from EngineArgs."""
    d = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path (default: the model's)")
    g.add_argument("--dtype", default=d.dtype, choices=SUPPORTED_DTYPES, help="weights and activations type")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the engine's random state")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (default on CPU: 30%% of free RAM, at most 4 GiB; on CUDA: sized from "
        "--gpu-memory-utilization)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help=f"CUDA: fraction of GPU memory for weights, activations and KV cache (default {d.gpu_memory_utilization})",
    )
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="force the number of KV blocks")
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse the KV blocks of shared prompt prefixes across requests (default on)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help=f"most sequences in one step (default {d.max_num_seqs})",
    )
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one step (default 2048)")
    g.add_argument(
        "--scheduling-policy",
        default=d.scheduling_policy,
        choices=SCHEDULING_POLICIES,
        help="fcfs: first come first served; priority: lower 'priority' value first, then arrival (default fcfs)",
    )
    g.add_argument(
        "--kv-offloading-size",
        type=float,
        default=d.kv_offloading_size,
        metavar="GIB",
        help="GiB of host memory for a second KV tier under the device's KV cache: evicted prefix blocks and "
        "swapped-out requests move there instead of being recomputed (pinned memory on CUDA; must fit the RAM "
        "available; default 0: no host tier)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="element type of the KV cache: auto (the model's dtype) or bfloat16 (under a float32 model: half the "
        "bytes a decode step reads and twice the tokens in the same KV memory; CPU only for now)",
    )
    g.add_argument(
        "--kv-offloading-disk-path",
        default=d.kv_offloading_disk_path,
        metavar="DIR",
        help="a directory for a third KV tier under the host tier (needs --kv-offloading-size): blocks the host tier "
        "drops are written there as files named by block hash, in a subdirectory per model and KV layout, so that a "
        "restarted server finds its prefix cache warm (default: no disk tier)",
    )
    g.add_argument(
        "--kv-offloading-disk-size",
        type=float,
        default=d.kv_offloading_disk_size,
        metavar="GIB",
        help="GiB of block files in --kv-offloading-disk-path (must fit the free disk space; the least recently "
        "used files are deleted beyond it)",
    )
    g.add_argument(
        "--preemption-mode",
        default=d.preemption_mode,
        choices=PREEMPTION_MODES,
        help="when the KV cache runs out, swap: move the preempted request's blocks to the host tier and load them "
        "back on resume (needs --kv-offloading-size); recompute: free them and compute them again (default: swap "
        "when a host tier exists, else recompute)",
    )
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--model-impl",
        default=d.model_impl,
        choices=MODEL_IMPLS,
        help="auto: the checkpoint's model; noop: a stand-in of the same shapes whose forward does nothing and "
        "always predicts one token, to measure the engine's own overhead (meaningless text; default auto)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model layer by layer in Python: on the CPU instead of the fused decoder (one C call per "
        "step), on CUDA without the decode steps' CUDA graphs; the outputs are the same, for comparisons and "
        "debugging",
    )
    g.add_argument(
        "--cpu-isa",
        default=d.cpu_isa,
        choices=CPU_ISA_CHOICES,
        help="CPU: the instruction-set tier the kernels are built for; auto (default) is this CPU's best, a lower "
        "one runs the same engine as a CPU of that tier would (for tests, benchmarks and mixed fleets); avx2+avx_vnni "
        "and avx512+avx512_vnni add those instructions, as Intel's client cores and Cascade Lake / Ice Lake Xeons "
        "build their tiers, where this CPU has them",
    )
    g.add_argument(
        "--cpu-kv-prefetch-bytes",
        type=int,
        default=d.cpu_kv_prefetch_bytes,
        help="CPU fused decoder: bytes of the next layer's decode K/V that a layer's GEMMs prefetch "
        "(default: the CPU plan's, half the L3 cache from the avx512 tier on, none below; 0: off)",
    )
    g.add_argument(
        "--cpu-adaptive-threads",
        action=argparse.BooleanOptionalAction,
        default=d.cpu_adaptive_threads,
        help="CPU: run the kernels on fewer threads while other processes take cores (their run-queue wait "
        "says how many), so that a busy neighbour costs its share of the machine, not most of the throughput "
        "(default on)",
    )
    g.add_argument(
        "--cpu-huge-pages",
        action=argparse.BooleanOptionalAction,
        default=d.cpu_huge_pages,
        help="CPU: put the packed weights and the KV cache on 2 MiB pages (default on: fewer TLB misses); off "
        "starts faster on VMs where a huge page's first touch is slow, as on clouds whose hosts take freed memory "
        "back (folio serve with a 4 GiB cache: 5 s instead of 13-23 s on one)",
    )
    g.add_argument(
        "--cpu-compact-weights",
        action=argparse.BooleanOptionalAction,
        default=d.cpu_compact_weights,
        help="CPU, float32: keep each weight that is exactly 4-bit codes with a step and an offset per 32 inputs "
        "(a GGUF's Q4_1 tensors, dequantized) as those codes, widened back in registers as the GEMM reads them: "
        "the same outputs bit for bit from a sixth of the weight bytes (default on)",
    )
    g.add_argument(
        "--cpu-amx-float32",
        action=argparse.BooleanOptionalAction,
        default=d.cpu_amx_float32,
        help="CPU, float32, amx tier: run the GEMMs over weights kept as 4-bit codes (--cpu-compact-weights) on "
        "AMX's bfloat16 tiles where a step has more rows than one vector tile (8), x split into three bfloat16 "
        "parts that sum to it exactly: every product exact, float32 sums in another order, so float32 accuracy "
        "but not the float32 layout's bits (default on; off: the FMA tiles)",
    )
    g.add_argument(
        "--cpu-vnni-float32",
        action=argparse.BooleanOptionalAction,
        default=d.cpu_vnni_float32,
        help="CPU, float32, a kernel library built with AVX512-VNNI and without AMX (the native avx512_bf16 tier of "
        "Zen 4 and 5, the avx512 tier of Cascade Lake and Ice Lake) or with AVX-VNNI at the avx2 tier (the native "
        "tier of Intel's client cores since Alder Lake): run the GEMMs over weights kept as 4-bit codes "
        "(--cpu-compact-weights) through vpdpbusd where a step has more rows than one vector tile (8; 4 at avx2), "
        "x as a 22-bit fixed point per group of 32 inputs in three int8 parts: float32 accuracy but not the float32 "
        "layout's bits (default on; off: the FMA tiles)",
    )
    g.add_argument(
        "--structured-outputs-config",
        type=json_object_arg,
        default=None,
        metavar="JSON",
        help='structured outputs (JSON schema, regex, choice, grammar): {"backend": "auto" | "guidance" | '
        '"xgrammar"}; auto is llguidance (faster to compile and to mask here, see docs/performance.md)',
    )
    g.add_argument(
        "--speculative-config",
        type=json_object_arg,
        default=None,
        metavar="JSON",
        help='speculative decoding (docs/speculative_decoding.md): {"method": "ngram", "num_speculative_tokens": '
        'k, "prompt_lookup_max": n, "prompt_lookup_min": m} (vLLM\'s fields)',
    )

    g.add_argument(
        "--kv-transfer-config",
        type=json_object_arg,
        default=None,
        metavar="JSON",
        help='disaggregated prefill and decode (docs/scale_out.md): {"kv_connector": "TcpConnector", "kv_role": '
        '"kv_producer" | "kv_consumer" | "kv_both", "kv_ip": ..., "kv_port": ..., "kv_buffer_size": bytes} (vLLM\'s '
        "fields); a consumer receives blocks on kv_ip:kv_port, a producer sends there unless a request names "
        "another consumer",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="ranks that split every layer of the model (one worker process each; on the CPU they share the "
        "machine's cores, on CUDA one GPU each); it must divide the model's attention heads unless "
        "--tensor-parallel-uneven-heads (default 1)",
    )
    g.add_argument(
        "--tensor-parallel-uneven-heads",
        action="store_true",
        default=d.tensor_parallel_uneven_heads,
        help="accept a --tensor-parallel-size that does not divide the model's attention or KV heads: whole KV heads, "
        "each with its query heads, are dealt out as evenly as they go (the ranks then differ in attention work; "
        "vLLM refuses such a size) (default off: refused)",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=d.pipeline_parallel_size,
        help="stages of contiguous layers, one worker process each, activations sent from stage to stage; up to "
        "that many batches in flight so that the stages overlap; at most the model's number of layers (default 1)",
    )
    g.add_argument(
        "--distributed-executor-backend",
        default=d.distributed_executor_backend,
        choices=DISTRIBUTED_EXECUTOR_BACKENDS,
        help="uni: the worker runs in the engine core's process (one rank); mp: one worker process per rank, "
        "torch.distributed between them; ray: one Ray actor per rank, placed on the Ray cluster's nodes (needs "
        "pip install -e .[ray]) (default: uni for one rank, mp above)",
    )
    g.add_argument(
        "--ray-address",
        default=d.ray_address,
        help="with --distributed-executor-backend ray: the Ray cluster's head, host:port (default: Ray's own "
        "search: RAY_ADDRESS, else the cluster `ray start` started on this machine, else a new local one)",
    )
    g.add_argument(
        "--cpu-allreduce",
        default=d.cpu_allreduce,
        choices=CPU_ALLREDUCE_CHOICES,
        help="tensor parallelism on the CPU: the ranks' all-reduces and all-gathers through shared memory (shm) or "
        "torch.distributed's gloo over TCP (default shm; CUDA uses NCCL)",
    )


def json_object_arg(text: str) -> dict[str, object]:
    """A flag whose value is a JSON object (vLLM's --*-config flags)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    names = {f.name for f in fields(EngineArgs)}
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})

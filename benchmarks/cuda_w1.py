"""W1 on a CUDA GPU: Folio in several configurations against Hugging Face transformers, in one run.

    python benchmarks/cuda_w1.py                        # bf16: graphs, eager, torch attention; HF batch 64
    python benchmarks/cuda_w1.py --configs graphs --repeats 3 --output-json w1_cuda.json

Same weights (the default GGUF), dtype, token ids (W1: 64 prompts, 128 new tokens each, greedy, EOS ignored) on
both sides. Folio configurations, each its own engine (a warm-up generate first, then --repeats timed ones; the
best is reported): ``graphs`` (the default: Triton attention, decode steps replayed from CUDA graphs), ``eager``
(enforce_eager: the same without graphs), ``torch_batched`` (eager, attention in plain torch). It prints how many
greedy sequences each configuration shares with the first. The peer is transformers `generate` with static
batches (left-padded). Prints output tok/s for each and the ratio to the peer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from peer_transformers import run_transformers

from folio import LLM, SamplingParams
from folio.attention.backends.base import AttentionBackend
from folio.attention.backends.torch_batched import TorchBatchedBackend
from folio.attention.backends.triton_paged import TritonPagedBackend

W1 = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w1_prompts.json"
# configuration -> (enforce_eager, the attention backend to swap in; None keeps the selector's TritonPagedBackend)
CONFIGS: dict[str, tuple[bool, type[AttentionBackend] | None]] = {
    "graphs": (False, None),
    "eager": (True, None),
    "torch_batched": (True, TorchBatchedBackend),
}


def use_backend(llm: LLM, backend: AttentionBackend) -> None:
    """Points every attention layer of the engine's model at ``backend`` (both keep the same KV layout)."""
    model = llm.llm_engine.executor.worker.model
    model.attn_backend = backend
    for layer in model.model.layers:
        layer.self_attn.attn_backend = backend


def run_folio(
    prompts: list[list[int]], output_len: int, config: str, dtype: str, repeats: int
) -> tuple[float, list[list[int]]]:
    """Best output tok/s over ``repeats`` timed runs, and the first run's token ids."""
    enforce_eager, backend_class = CONFIGS[config]
    llm = LLM(device="cuda", dtype=dtype, gpu_memory_utilization=0.5, enforce_eager=enforce_eager)
    assert isinstance(llm.llm_engine.executor.worker.model.attn_backend, TritonPagedBackend)
    if backend_class is not None:
        use_backend(llm, backend_class())
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    best, tokens = 0.0, []
    for i in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        rate = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
        print(f"folio {config} run {i + 1}: {rate:.1f} output tok/s", flush=True)
        best = max(best, rate)
        if not tokens:
            tokens = [list(o.outputs[0].token_ids) for o in outputs]
    del llm
    torch.cuda.empty_cache()
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default=str(W1))
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--configs", default="graphs,eager,torch_batched")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hf-batch-sizes", default="64", help="transformers static batch sizes to try")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    prompts = [p["ids"] for p in json.loads(Path(args.workload).read_text())["prompts"]]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, W1: {len(prompts)} prompts", flush=True)

    folio: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    for config in args.configs.split(","):
        folio[config], tokens[config] = run_folio(prompts, args.output_len, config, args.dtype, args.repeats)
    names = list(tokens)
    for other in names[1:]:
        same = sum(a == b for a, b in zip(tokens[names[0]], tokens[other], strict=True))
        print(f"greedy tokens {names[0]} vs {other}: {same} of {len(prompts)} sequences identical")

    dtype = getattr(torch, args.dtype)
    peers = {}
    for batch_size in (int(b) for b in args.hf_batch_sizes.split(",")):
        peers[batch_size] = run_transformers(prompts, args.output_len, batch_size, 2, dtype, "cuda")
        print(f"transformers static batch {batch_size}: {peers[batch_size]:.1f} output tok/s", flush=True)
    best_batch = max(peers, key=lambda b: peers[b])
    print(f"\n| W1 on {torch.cuda.get_device_name()} ({args.dtype}) | output tok/s | vs transformers |")
    print("| --- | --- | --- |")
    print(f"| transformers generate, static batch {best_batch} | {peers[best_batch]:.1f} | 1.00x |")
    for config, rate in folio.items():
        print(f"| Folio, {config} | {rate:.1f} | {rate / peers[best_batch]:.2f}x |")
    if args.output_json:
        result = {"folio": folio, "transformers": {str(b): v for b, v in peers.items()}, "dtype": args.dtype}
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

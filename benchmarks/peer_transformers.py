"""Peer: Hugging Face transformers `generate` with static batching vs Folio, on W1, in one run.

    .venv/bin/python benchmarks/peer_transformers.py                    # batch sizes 8, 32, 64
    .venv/bin/python benchmarks/peer_transformers.py --batch-sizes 64 --num-prompts 64
    .venv/bin/python benchmarks/peer_transformers.py --cpu-isa avx2   # both sides as on an AVX2 CPU

Same weights (the default GGUF, dequantized to float32 by transformers), same dtype, same token ids (W1), 128
new tokens each, greedy. transformers cannot ignore EOS in generate, so `min_new_tokens` holds EOS back for it
(both sides produce exactly the same number of tokens). Needs only what the project's dev install has
(transformers, accelerate, gguf). Prints each peer's output tok/s, Folio's, and the ratio to the best peer.
With --cpu-isa below this CPU's own tier, the script re-runs itself with MKL, oneDNN and ATen held to that tier
(folio.kernels.isa.library_isa_env): transformers and the ceiling then run as on a CPU of that tier, and Folio
builds its kernels for it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from folio import LLM, SamplingParams
from folio.bench.roofline import measure_matmul_flops, workload_ceiling
from folio.kernels.cpu_config import CpuConfig
from folio.kernels.isa import cpu_info, detect_tier, library_isa_env
from folio.model.loader import default_model_path, read_model_spec

W1 = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "w1_prompts.json"


def run_transformers(
    prompts: list[list[int]],
    output_len: int,
    batch_size: int,
    pad_id: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> float:
    """Static batches, left-padded; returns output tokens per second."""
    from transformers import AutoModelForCausalLM

    directory, filename = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=dtype).to(device).eval()
    num_out = 0
    if device != "cpu":  # one short batch first: CUDA's lazy init and kernel selection stay out of the time
        with torch.inference_mode():
            model.generate(input_ids=torch.tensor([prompts[0]], device=device), max_new_tokens=4, pad_token_id=pad_id)
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i : i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad_id,
            )
            num_out += (out.shape[1] - width) * len(batch)
    return num_out / (time.perf_counter() - start)


def run_folio(prompts: list[list[int]], output_len: int, cpu_isa: str) -> float:
    llm = LLM(dtype="float32", cpu_isa=cpu_isa)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default=str(W1))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-sizes", default="8,32,64", help="transformers static batch sizes to try")
    parser.add_argument("--output-json", default=None, help="write the figures as JSON here")
    parser.add_argument("--cpu-isa", default="auto", help="the ISA tier of every side (default: this CPU's)")
    args = parser.parse_args()
    tier = CpuConfig(isa=args.cpu_isa).tier()
    held = library_isa_env(tier, detect_tier(cpu_info()[1]))
    if any(os.environ.get(name) != value for name, value in held.items()):  # before MKL / oneDNN / ATen start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **held})
    print(f"every side at ISA tier {tier.flag_name} ({held or 'the CPU as it is'})", flush=True)
    data = json.loads(Path(args.workload).read_text())
    prompts = [p["ids"] for p in data["prompts"]][: args.num_prompts]
    spec = read_model_spec(default_model_path())
    matmul = measure_matmul_flops(tier=tier)
    ceiling = workload_ceiling(spec, [(len(p), args.output_len) for p in prompts], matmul)
    print(
        f"FLOP ceiling: {ceiling.workload_flops / 1e12:.2f} TFLOP of matmuls at a measured {matmul / 1e9:.0f} GFLOP/s "
        f"(best float32 GEMM, 2048^3) -> {ceiling.output_tokens_per_second:.0f} output tok/s",
        flush=True,
    )
    folio_tps = run_folio(prompts, args.output_len, args.cpu_isa)
    print(
        f"folio: {folio_tps:.1f} output tok/s = {100 * folio_tps / ceiling.output_tokens_per_second:.0f}% of the "
        "FLOP ceiling",
        flush=True,
    )
    peers = {}
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        peers[batch_size] = run_transformers(prompts, args.output_len, batch_size, pad_id=2)
        print(f"transformers static batch {batch_size}: {peers[batch_size]:.1f} output tok/s", flush=True)
    best = max(peers, key=lambda b: peers[b])
    print(
        f"folio / best transformers (batch {best}): {folio_tps:.1f} / {peers[best]:.1f} = "
        f"{folio_tps / peers[best]:.2f}x"
    )
    if args.output_json:
        result = {
            "folio_output_tokens_per_second": folio_tps,
            "transformers_output_tokens_per_second": {str(b): v for b, v in peers.items()},
            "matmul_flops": matmul,
            "ceiling_output_tokens_per_second": ceiling.output_tokens_per_second,
        }
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

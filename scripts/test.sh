#!/usr/bin/env bash
# Set up, lint and run the whole test suite: the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "scripts/test.sh: set-up done at ${SECONDS} s"
.venv/bin/ruff check folio tests
.venv/bin/ruff format --check folio tests
.venv/bin/mypy --strict --follow-imports=silent folio/core
echo "scripts/test.sh: lint and types done at ${SECONDS} s"
# Three worker processes (pytest-xdist) on CI's two cores, one OpenMP thread each: with two, about 14% of the CPU
# time went idle while tests waited on servers and subprocess start-ups (docs/performance.md, session 21).
# Work units: tests/conftest.py. FOLIO_TEST_WORKERS=0 runs it in one process (two threads).
WORKERS=${FOLIO_TEST_WORKERS:-3}
# pytest keeps each test module's assertion-rewritten bytecode in __pycache__ (as set-up's compileall keeps the rest)
# only where Python may write bytecode: where PYTHONDONTWRITEBYTECODE is set (this machine, CI), every pytest process
# rewrote and compiled every test module again at collection, 2-3 CPU-s of its 8 (docs/performance.md, session 27).
unset PYTHONDONTWRITEBYTECODE
if [ "$WORKERS" = 0 ]; then
  .venv/bin/python -m pytest -q "$@"
else
  # Passive OpenMP waits: the kernel tests' two threads otherwise spin at every barrier while the other workers hold
  # the cores (tests/kernels, tests/attention and tests/core under -n 3: 119-121 CPU-s spinning, 95-101 passive).
  OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n "$WORKERS" --durations=15 "$@"
fi
echo "scripts/test.sh: tests done at ${SECONDS} s"

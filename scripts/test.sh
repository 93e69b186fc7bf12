#!/usr/bin/env bash
# Set up, lint and run the whole test suite: the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check folio tests
.venv/bin/ruff format --check folio tests
.venv/bin/mypy --strict --follow-imports=silent folio/core
# Two worker processes (pytest-xdist), one OpenMP thread each: the two cores stay busy through the tests' start-ups,
# servers and waits, and the suite takes about two thirds of its serial time. Work units: tests/conftest.py.
# FOLIO_TEST_WORKERS=0 runs it in one process (two threads).
WORKERS=${FOLIO_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
  .venv/bin/python -m pytest -q "$@"
else
  OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n "$WORKERS" --durations=15 "$@"
fi

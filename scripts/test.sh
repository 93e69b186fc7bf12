#!/usr/bin/env bash
# Set up, lint and run the whole test suite: the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check folio tests
.venv/bin/ruff format --check folio tests
.venv/bin/mypy --strict --follow-imports=silent folio/core
.venv/bin/python -m pytest -q "$@"

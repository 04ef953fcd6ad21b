#!/usr/bin/env bash
# The project's test command: lint, type-check, then the whole test suite.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
bash scripts/install.sh --dev
echo "== ruff"
"$PY" -m ruff check .
echo "== mypy"
"$PY" scripts/typecheck.py
echo "== pytest"
"$PY" -m pytest "$@"

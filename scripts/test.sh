#!/usr/bin/env bash
# The project's test command: lint, type-check, then the whole test suite.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --dev
# The Python install.sh chose (python3, the active virtual environment, or .venv on a
# distribution's python3), with its scripts (deltasync) first on PATH.
PY="$(bash scripts/install.sh --print-python)"
if [[ "$PY" == */* ]]; then export PATH="$(cd "$(dirname "$PY")" && pwd):$PATH"; fi
# A real vLLM for tests/test_vllm.py, in its own environment (.venv-vllm); where it cannot be
# built those tests skip, saying why.
if ! bash scripts/install_vllm.sh; then
  echo "== the vLLM environment could not be built: tests/test_vllm.py will skip"
fi
echo "== ruff"
"$PY" -m ruff check .
echo "== mypy"
"$PY" scripts/typecheck.py
echo "== pytest"
"$PY" -m pytest "$@"

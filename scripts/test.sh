#!/usr/bin/env bash
# The project's test command: lint, type-check, then the whole test suite.
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
bash scripts/install.sh --dev
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

#!/usr/bin/env bash
# The project's test command: lint, type-check, then the whole test suite.
#   bash scripts/test.sh [pytest args...]
#   bash scripts/test.sh --fast [pytest args...]
#       for a developer: builds no extra environment (.venv-vllm, .venv-verl) and runs neither
#       the tests that need one nor the slow tests (-m "not slow"); CI runs the full command.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [[ "${1:-}" == "--fast" ]]; then
  fast=1
  shift
fi
bash scripts/install.sh --dev
# The Python install.sh chose (python3, the active virtual environment, or .venv on a
# distribution's python3), with its scripts (deltasync) first on PATH.
PY="$(bash scripts/install.sh --print-python)"
if [[ "$PY" == */* ]]; then export PATH="$(cd "$(dirname "$PY")" && pwd):$PATH"; fi
# A real vLLM for tests/engines/test_vllm.py, in its own environment (.venv-vllm); where it
# cannot be built (or with --fast) those tests skip, saying why.
vllm_ready=0
if [[ "$fast" == 1 ]]; then
  export DELTASYNC_NO_VLLM="skipped by scripts/test.sh --fast"
elif bash scripts/install_vllm.sh; then
  vllm_ready=1
else
  echo "== the vLLM environment could not be built: the real-vLLM tests will skip"
fi
# Real verl, TRL, transformers and Ray for tests/integrations/, in their own environment
# (.venv-verl: verl pins its own transformers and tensordict; about 2.5 minutes to build,
# 5.5 minutes of tests measured on a busy 2-core machine, 40% of it the vLLM server test); where it
# cannot be built (or with --fast) they run in the project's environment and skip, saying why.
verl_ready=0
if [[ "$fast" == 0 ]]; then
  if bash scripts/install_verl.sh; then
    verl_ready=1
  else
    echo "== the verl environment could not be built: tests/integrations/ will skip"
  fi
fi
# A headless browser for the fleet page's test (tests/fleet/test_fleet_page.py): Debian's
# chromium and playwright in .venv-browser; where it cannot be installed, that test skips.
if [[ "$fast" == 0 ]]; then
  bash scripts/install_browser.sh || echo "== the browser could not be installed: the fleet page's test will skip"
fi
echo "== ruff"
"$PY" -m ruff check .
echo "== mypy"
"$PY" -m mypy
if [[ "$vllm_ready" == 1 && $# -eq 0 ]]; then
  # Unit tests that call vLLM's own code (its sparse patch function, its weight-transfer
  # registry) run inside its environment: their names say `vllms_own` (elsewhere they skip);
  # the real-vLLM server tests run below, from the project's environment.
  echo "== pytest (inside .venv-vllm: tests that import vLLM itself)"
  .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/engines/test_vllm_weights.py -k "vllms_own"
fi
if [[ "$verl_ready" == 1 && $# -eq 0 ]]; then
  echo "== pytest (inside .venv-verl: tests/integrations/, verl, TRL and Ray)"
  .venv-verl/bin/python -m pytest -q -p no:cacheprovider -W ignore::UserWarning tests/integrations
  set -- --ignore=tests/integrations  # ran above, with their frameworks
fi
echo "== pytest"
if [[ "$fast" == 1 ]]; then
  "$PY" -m pytest -m "not slow" "$@"
else
  "$PY" -m pytest "$@"
fi

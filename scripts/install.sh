#!/usr/bin/env bash
# Install deltasync and what it needs into the current Python environment.
#   bash scripts/install.sh          # runtime
#   bash scripts/install.sh --dev    # runtime + test, lint and type-check tools
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# torch first, pinned: an unpinned torch would pull several GB of CUDA packages.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
extra=""
if [[ "${1:-}" == "--dev" ]]; then extra="[dev]"; fi
"$PY" -m pip install --quiet -e ".${extra}"

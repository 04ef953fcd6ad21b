#!/usr/bin/env bash
# A separate environment holding real verl, Ray, transformers and TRL with deltasync, for
# tests/integrations/ and benchmarks/bench_verl.py. verl pins its own versions of
# transformers, tensordict and friends, so it does not go into the project's environment.
#   bash scripts/install_verl.sh [VENV]      # default: .venv-verl in the repository
# Facts this relies on (verl 0.9.1, x86_64, CPU only):
# - torch==2.13.0 is installed first: from the local CPU wheel where there is one (an
#   unpinned torch from PyPI is the CUDA build, several GB);
# - verl.checkpoint_engine imports verl.workers.rollout.utils, which imports uvicorn and
#   fastapi without declaring them: they are installed here;
# - verl's own delta_sharded engine module imports pyzmq and cupy at import time; both
#   import on a CPU host (cupy only warns that it finds no NCCL), which is what lets
#   benchmarks/bench_verl.py run verl's own delta encoding. Nothing here touches a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-verl}"
PY="${PYTHON:-python3}"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if ! "$VPY" -c "import verl, trl, ray, uvicorn, fastapi, zmq, cupy" >/dev/null 2>&1; then
  "$VPY" -m pip install --quiet "torch==2.13.0"
  "$VPY" -m pip install --quiet "verl==0.9.1" "trl==1.16.0" "uvicorn" "fastapi" "pyzmq" "cupy-cuda12x"
fi
# deltasync itself (editable: the tests run the checkout), the test runner, and the MiniLM
# weights benchmarks/bench_verl.py streams (the [bench] extra)
"$VPY" -m pip install --quiet -e ".[all,bench]" "pytest>=8"
"$VPY" -W ignore -c "import verl, trl, ray, transformers, deltasync; print('verl', verl.__version__, 'trl', trl.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__, 'in', '$VENV')"

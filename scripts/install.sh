#!/usr/bin/env bash
# Install deltasync and what it needs.
#   bash scripts/install.sh                  # runtime
#   bash scripts/install.sh --dev            # runtime + test, lint and type-check tools
#   bash scripts/install.sh --demo           # runtime, then run `deltasync demo`
#   bash scripts/install.sh --print-python   # only print the Python it installs into
# Into which Python: $PYTHON if set; else the active virtual environment's; else python3 when
# pip may install into it; else (a distribution's python3, e.g. Debian's or Ubuntu's, which
# refuses with externally-managed-environment) a virtual environment .venv here, created on
# first use. It says which, and how to run deltasync from there.
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0 demo=0 print_only=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --demo) demo=1 ;;
    --print-python) print_only=1 ;;
    *) echo "install.sh: unknown option $arg (--dev, --demo, --print-python)" >&2; exit 2 ;;
  esac
done

# Exit status 0 when pip may install into this Python: a virtual environment, or an
# interpreter its distribution does not manage (PEP 668's EXTERNALLY-MANAGED marker).
may_install() {
  "$1" -c 'import os, sys, sysconfig
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
sys.exit(0 if sys.prefix != sys.base_prefix or not os.path.exists(marker) else 1)' >/dev/null 2>&1
}

venv=""
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
  PY="$VIRTUAL_ENV/bin/python"
elif may_install python3; then
  PY=python3
else
  PY=.venv/bin/python venv=.venv
  if [[ ! -x .venv/bin/python ]] && ! python3 -m venv .venv >/dev/null 2>&1; then
    rm -rf .venv
    echo "install.sh: python3 cannot create a virtual environment: install the venv module (Debian/Ubuntu:" \
         "apt install python3-venv), or activate a virtual environment, or set PYTHON=/path/to/python" >&2
    exit 1
  fi
fi
if [[ "$print_only" == 1 ]]; then
  echo "$PY"
  exit 0
fi

# torch first, pinned: where a CPU wheel of it is on local disk, pip takes that one. From PyPI
# alone torch is the CUDA build (several GB): for CPU only, install torch into this same
# environment first, from PyTorch's CPU index (see the README's Quickstart).
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
extra="[all]"  # torch, boto3 and grpcio: every command works (a relay or agent host needs fewer: see pyproject)
if [[ "$dev" == 1 ]]; then extra="[dev]"; fi  # dev includes all
"$PY" -m pip install --quiet -e ".${extra}"

if [[ -n "$venv" ]]; then
  echo "deltasync is installed in $venv (this python3 is managed by its distribution): run $venv/bin/deltasync," \
       "or 'source $venv/bin/activate' first"
else
  echo "deltasync is installed for $PY"
fi
if [[ "$demo" == 1 ]]; then
  "$PY" -m deltasync demo
fi

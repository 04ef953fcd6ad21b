#!/usr/bin/env bash
# A headless browser for the fleet page's test (tests/fleet/test_fleet_page.py): Debian's
# chromium package, driven by playwright from an environment of its own (playwright is a test
# tool, not a dependency of deltasync). playwright's own browser download is not used: the
# test points it at the system chromium through executable_path.
#   bash scripts/install_browser.sh [VENV]      # default: .venv-browser in the repository
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-browser}"
PY="${PYTHON:-python3}"
if ! command -v chromium >/dev/null 2>&1; then
  if [[ $(id -u) -eq 0 ]]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "chromium is missing: apt-get install chromium (as root)" >&2
    exit 1
  fi
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet "playwright>=1.40"
"$VENV/bin/python" -c "import playwright; print('playwright in $VENV; chromium at', '$(command -v chromium)')"

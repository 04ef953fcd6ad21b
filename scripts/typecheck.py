"""Run mypy over the package as it is imported (``deltasync.storage`` lives in ``storage/``).

setuptools maps the top-level folders storage/, cli/ and rl_integration/ into the
``deltasync`` package; mypy cannot follow that mapping, so this builds a tree of symlinks
with the import layout and points mypy at it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAPPED = {"storage": "storage", "cli": "cli", "rl_integration": "rl_integration"}


def main() -> int:
    tree = ROOT / ".mypy_tree"
    shutil.rmtree(tree, ignore_errors=True)
    pkg = tree / "deltasync"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "deltasync").iterdir():
        if entry.name != "__pycache__":
            os.symlink(entry, pkg / entry.name)
    for sub, folder in MAPPED.items():
        os.symlink(ROOT / folder, pkg / sub)
    env = dict(os.environ, MYPYPATH=str(tree))
    cmd = [sys.executable, "-m", "mypy", str(pkg.relative_to(ROOT)), "tests", "benchmarks", "scripts"]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())

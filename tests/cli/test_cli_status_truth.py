"""What ``status`` and the commands around it say matches what the copy holds (issue 33)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ckpt_helpers import make_state, step_state

from deltasync import Publisher


def _publish(repo: Path, n: int) -> None:
    pub, state = Publisher(str(repo)), make_state(0)
    for i in range(n):
        pub.publish(state)
        state = step_state(state, seed=i + 1)


def _cli(tmp: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DELTASYNC_CACHE": str(tmp / "default-cache")}
    return subprocess.run([sys.executable, "-m", "deltasync.cli.main", *map(str, args)], capture_output=True,
                          text=True, cwd=tmp, env=env, timeout=120)


def test_status_after_pull_rollback_pull_describes_the_last_move(tmp_path: Path) -> None:
    _publish(tmp_path / "repo", 8)
    for args in (("pull", "c", "--repo", "repo", "--version", "7"), ("rollback", "c", "--to", "6"),
                 ("pull", "c", "--repo", "repo")):
        r = _cli(tmp_path, *args)
        assert r.returncode == 0, r.stderr
    out = _cli(tmp_path, "status", "c").stdout
    rows = {line[:12].strip(): line[12:].strip() for line in out.splitlines()}
    assert rows["version"].startswith("8,"), out
    assert rows["last update"].startswith("6 -> 8: "), out
    # The rollback's version is no target any more: no lag claimed against it.
    assert not rows["lag"].startswith(("1 ", "2 ")), out

"""A failed engine update never looks like success (issue 23, item 1).

An agent keeping a copy and an engine (or an engine alone) records the engine's version and
its last error in the state, next to the copy's (``deltasync status``, text and ``--json``);
an update that did not reach the engine is a failed update: a one-shot run fails (non-zero
exit on the command line), a following agent retries with backoff and says so, and moves
on once a version the engine can take comes. The same for rollbacks and pins.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state, step_state, write_checkpoint

from deltasync import Publisher, PublisherConfig, Repository
from deltasync.agents import Agent, AgentConfig, read_status
from deltasync.engines.torch_engine import TorchEngine
from deltasync.errors import DeltasyncError, UsageError

LAYOUT = (("model.embed.weight", (64, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))
GROWN = (("model.embed.weight", (65, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))
CONFIG = PublisherConfig(workers=2, progress=False)


def _publish(url: str, root: Path, layouts: list[tuple[tuple[str, tuple[int, ...], torch.dtype], ...]]) -> None:
    """One version per layout (a layout change is a new tensor shape: the embedding gains a row)."""
    pub = Publisher(url, CONFIG)
    n = len(Repository(url).versions()) if Repository(url).exists() else 0
    for i, layout in enumerate(layouts, start=n + 1):
        state = step_state(make_state(1, layout), seed=i)
        pub.publish_dir(write_checkpoint(root / f"ckpt{i}", state, step=i))


def _engine(url: str, layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = LAYOUT) -> TorchEngine:
    return TorchEngine({n: torch.zeros(s, dtype=d) for n, s, d in layout}, url)


def _config(**kw: object) -> AgentConfig:
    return AgentConfig(retries=1, backoff_initial=0.02, backoff_max=0.05, poll_interval=0.05, relist_interval=0.1,
                       **kw)  # type: ignore[arg-type]


def test_a_one_shot_run_whose_engine_cannot_take_the_version_fails_and_says_so(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    _publish(url, tmp_path, [GROWN])
    out = tmp_path / "copy"
    with pytest.raises(DeltasyncError, match="cannot change dtypes or shapes"):
        Agent(url, out, _config(), engine=_engine(url)).run()
    s = read_status(out)
    assert s["version"] == 1  # the copy took it; the engine did not, and status says so
    assert s["engine_kind"] == "torch" and s["engine_version"] is None and s["engine_current"] is False
    assert "cannot change dtypes or shapes" in s["engine_last_error"] and s["engine_last_error_version"] == 1
    assert "cannot change dtypes or shapes" in s["last_error"]


def test_a_following_agent_retries_with_backoff_and_moves_on(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    _publish(url, tmp_path, [LAYOUT, LAYOUT])
    out = tmp_path / "copy"
    engine = _engine(url)
    agent = Agent(url, out, _config(), engine=engine)
    thread = threading.Thread(target=agent.run, kwargs={"follow": True}, daemon=True)
    thread.start()
    try:
        _wait(lambda: read_status(out).get("engine_version") == 2)
        _publish(url, tmp_path, [GROWN])  # version 3: the engine cannot take it
        _wait(lambda: (read_status(out).get("errors_total") or 0) >= 3)  # retried, not given up
        s = read_status(out)
        # The engine stages before the copy is rewritten: neither moved, and the state says why.
        assert s["engine_version"] == 2 and s["version"] == 2 and s["engine_last_error_version"] == 3
        assert s["state"] in ("backoff", "updating") and "cannot change dtypes or shapes" in s["last_error"]
        assert engine.version == 2  # still serving what it held
        _publish(url, tmp_path, [LAYOUT])  # version 4 fits again: the agent moves on
        _wait(lambda: read_status(out).get("version") == 4)  # the engine first, then the copy
        s = read_status(out)
        assert s["version"] == 4 and s["engine_current"] is True and engine.version == 4
    finally:
        agent.stop()
        thread.join(10)


def test_a_rollback_or_pin_the_engine_cannot_take_fails_too(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    _publish(url, tmp_path, [GROWN, LAYOUT, LAYOUT])
    out = tmp_path / "copy"
    engine = _engine(url)
    assert Agent(url, out, _config(), engine=engine).run() == 3 and engine.version == 3
    with pytest.raises(DeltasyncError, match="cannot change dtypes or shapes"):
        Agent(url, out, _config(), engine=engine).rollback(1)
    assert engine.version == 3 and read_status(out)["engine_last_error_version"] == 1
    Repository(url).pin(1)
    with pytest.raises(DeltasyncError, match="cannot change dtypes or shapes"):
        Agent(url, out, _config(), engine=engine).run()
    assert engine.version == 3
    Repository(url).pin(2)  # one it can take
    assert Agent(url, out, _config(), engine=engine).run() == 2 and engine.version == 2
    assert read_status(out)["engine_current"] is True


@pytest.mark.slow
def test_cli_subscribe_with_an_engine_that_cannot_take_the_version_exits_non_zero(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    _publish(url, tmp_path, [GROWN])
    (tmp_path / "wrongshape.py").write_text(textwrap.dedent("""
        import torch

        def make():
            return {"model.embed.weight": torch.zeros(64, 32, dtype=torch.bfloat16),
                    "model.norm.bias": torch.zeros(32, dtype=torch.float32)}
    """))
    out = tmp_path / "copy"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deltasync", *args], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path)

    run = cli("subscribe", "--repo", url, "--out", str(out), "--engine", "torch:wrongshape:make", "--retries", "1",
              "--quiet")
    assert run.returncode != 0, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1 and "cannot change dtypes or shapes" in run.stderr
    text = cli("status", str(out))
    assert text.returncode == 0
    assert "engine       torch at version - (the directory holds 1)" in text.stdout
    assert "engine error" in text.stdout and "update to version 1" in text.stdout
    s = json.loads(cli("status", str(out), "--json").stdout)
    assert s["engine_version"] is None and s["version"] == 1 and "cannot change" in s["engine_last_error"]


def _wait(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(UsageError):  # no copy yet
            if cond():
                return
        time.sleep(0.02)
    raise AssertionError("timed out")

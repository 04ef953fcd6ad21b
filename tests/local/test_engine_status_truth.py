"""``status --state`` never claims a version the engine does not hold (issue 33 item 7): the
engine's version is what this process last verified it holds; until then, loading/restoring."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_engine_agent import LAYOUT, Run, agent_config, assert_same_bits, pulled, zeros_like

from deltasync.agents import EngineAgent, read_status
from deltasync.engines import SwapRecord, TorchEngine
from deltasync.engines.base import Staged


def _until(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class _Following:
    def __init__(self, agent: EngineAgent) -> None:
        self.agent = agent
        self.thread = threading.Thread(target=agent.run, kwargs={"follow": True})

    def __enter__(self) -> EngineAgent:
        self.thread.start()
        return self.agent

    def __exit__(self, *exc: object) -> None:
        self.agent.stop()
        self.thread.join(30)


@pytest.fixture
def held_two(tmp_path: Path) -> Iterator[tuple[Run, Path]]:
    """A state directory whose engine held version 2 when its agent (an earlier run) ended."""
    run = Run(tmp_path / "repo")
    run.step()
    run.step()
    engine = TorchEngine(zeros_like(run.state), str(tmp_path / "repo"))
    assert EngineAgent(engine, tmp_path / "state", agent_config()).run() == 2
    yield run, tmp_path / "state"


def test_a_restart_with_the_repository_path_missing_restores_from_the_kept_objects(
    held_two: tuple[Run, Path], tmp_path: Path
) -> None:
    run, state = held_two
    expected = pulled(tmp_path / "repo", 2)
    (tmp_path / "repo").rename(tmp_path / "elsewhere")  # a mount not there yet
    engine = TorchEngine(zeros_like(run.state), str(tmp_path / "repo"))
    with _Following(EngineAgent(engine, state, agent_config())) as agent:
        _until("the restore", lambda: agent.current() == 2)
        assert_same_bits(engine.tensors, expected)
        s = read_status(state)
        assert s["version"] == 2 and s["engine_phase"] == "serving", s


def test_a_restart_that_cannot_restore_claims_no_version(held_two: tuple[Run, Path], tmp_path: Path) -> None:
    run, state = held_two
    for pack in (p for p in (state / ".deltasync" / "objects" / "packs").rglob("*") if p.is_file()):
        data = bytearray(pack.read_bytes())
        data[len(data) // 2] ^= 0xFF
        pack.write_bytes(bytes(data))  # the kept objects damaged
    (tmp_path / "repo").rename(tmp_path / "elsewhere")  # and the repository out of reach
    engine = TorchEngine(zeros_like(run.state), str(tmp_path / "repo"))
    with _Following(EngineAgent(engine, state, agent_config())) as agent:
        _until("a failed look", lambda: (read_status(state).get("errors_total") or 0) >= 2)
        s = read_status(state)
        assert agent.current() is None
        assert s["running"] and s["version"] is None and s["engine_phase"] == "loading", s
        assert s["recorded_version"] == 2 and s["lag_versions"] is None, s
    assert read_status(state)["version"] == 2  # the agent gone: the state says what it held last


class _Watching(TorchEngine):
    """A torch engine that reads the status while it stages (the agent's first update)."""

    seen: list[dict[str, Any]]

    def _stage(self, version: int) -> Staged:
        self.seen.append(read_status(self.state_dir))  # type: ignore[attr-defined]
        return super()._stage(version)

    def load(self, version: int | None = None) -> SwapRecord:
        self.seen.append(read_status(self.state_dir))  # type: ignore[attr-defined]
        return super().load(version)


def test_during_a_restarted_runs_first_update_no_version_is_claimed(held_two: tuple[Run, Path], tmp_path: Path) -> None:
    run, state = held_two
    run.step()  # version 3: the restarted run's first update
    engine = _Watching(zeros_like(run.state), str(tmp_path / "repo"))
    engine.seen, engine.state_dir = [], state  # type: ignore[attr-defined]
    assert EngineAgent(engine, state, agent_config()).run() == 3
    assert engine.seen, "the engine staged nothing"
    first = engine.seen[0]
    assert first["version"] is None and first["engine_phase"] == "loading", first
    assert read_status(state)["version"] == 3
    assert_same_bits(engine.tensors, pulled(tmp_path / "repo", 3))
    assert LAYOUT and isinstance(engine.tensors[LAYOUT[0][0]], torch.Tensor)

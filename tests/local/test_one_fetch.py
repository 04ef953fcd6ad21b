"""A copy with an engine fetches each version once: the engine and the copy share one fetch
(docs/engines.md; issue 33 item 11), forwards and when a pin moves them back."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine_agent import CountingStore, Run, agent_config, assert_same_bits, pulled, zeros_like

from deltasync import Repository, Subscriber
from deltasync.agents import Agent
from deltasync.engines import TorchEngine
from deltasync.storage import LocalStore


def _plain_pull_bytes(repo: Path, version: int, out: Path) -> int:
    counting = CountingStore(LocalStore(str(repo)))
    Subscriber(Repository(counting), workers=2, progress=False).update_dir(out, version)
    return counting.bytes_read("packs/")


@pytest.mark.parametrize("back_to", [3, 1])
def test_a_pin_back_moves_copy_and_engine_with_one_fetch(tmp_path: Path, back_to: int) -> None:
    repo = tmp_path / "repo"
    run = Run(repo, snapshot_every=50)
    for _ in range(7):
        run.step(fraction=0.2)
    out = tmp_path / "out"
    counting = CountingStore(LocalStore(str(repo)))
    engine = TorchEngine(zeros_like(run.state), counting, copy=out)
    agent = Agent(counting, out, agent_config(keep_versions=2), engine=engine)
    assert agent.run() == 7
    before = counting.bytes_read("packs/")
    Repository(str(repo)).pin(back_to)
    assert agent.run() == back_to
    moved = counting.bytes_read("packs/") - before
    assert_same_bits(engine.tensors, pulled(repo, back_to))
    plain = _plain_pull_bytes(repo, back_to, tmp_path / "plain")
    print(f"pin 7 -> {back_to}: copy and engine fetched {moved} bytes of packs; a plain pull {plain}")
    assert moved <= 1.15 * plain, (moved, plain)


def test_forwards_across_a_snapshot_copy_and_engine_share_one_fetch(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    run = Run(repo, snapshot_every=3)
    run.step(fraction=0.2)
    out = tmp_path / "out"
    counting = CountingStore(LocalStore(str(repo)))
    engine = TorchEngine(zeros_like(run.state), counting, copy=out)
    agent = Agent(counting, out, agent_config(), engine=engine)
    assert agent.run() == 1
    _plain_pull_bytes(repo, 1, tmp_path / "plain")  # a copy at the same version, pulled alone
    for _ in range(6):
        run.step(fraction=0.2)
    before = counting.bytes_read("packs/")
    assert agent.run() == 7
    moved = counting.bytes_read("packs/") - before
    assert_same_bits(engine.tensors, pulled(repo, 7))
    plain = _plain_pull_bytes(repo, 7, tmp_path / "plain")
    print(f"1 -> 7: copy and engine fetched {moved} bytes of packs; the copy alone {plain}")
    assert moved <= 1.15 * plain, (moved, plain)

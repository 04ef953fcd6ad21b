"""What a library publisher does by default, and says."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from ckpt_helpers import make_state, step_state, write_checkpoint

from deltasync import Publisher


def test_publish_dir_without_a_base_says_once_that_every_version_is_a_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = make_state(seed=0)
    pub = Publisher(str(tmp_path / "repo"))
    kinds = []
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        for step in range(3):
            ckpt = write_checkpoint(tmp_path / f"step-{step}", state)
            kinds.append(pub.publish_dir(ckpt).kind)
            state = step_state(state, seed=step + 1)
    warned = [r for r in caplog.records if "without base_dir or cache_dir" in r.getMessage()]
    assert kinds == ["snapshot", "snapshot", "snapshot"]
    assert len(warned) == 1 and "version 2" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deltasync"):  # meant (`publish --no-cache`): nothing to say
        Publisher(str(tmp_path / "repo")).publish_dir(write_checkpoint(tmp_path / "step-9", state), snapshots=True)
    assert not [r for r in caplog.records if "without base_dir or cache_dir" in r.getMessage()]


def test_publish_dir_with_a_cache_says_nothing_and_stores_deltas(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = make_state(seed=0)
    pub = Publisher(str(tmp_path / "repo"))
    kinds = []
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        for step in range(2):
            ckpt = write_checkpoint(tmp_path / f"step-{step}", state)
            kinds.append(pub.publish_dir(ckpt, cache_dir=tmp_path / "cache").kind)
            state = step_state(state, seed=step + 1)
    assert kinds == ["snapshot", "delta"]
    assert not [r for r in caplog.records if "without base_dir or cache_dir" in r.getMessage()]

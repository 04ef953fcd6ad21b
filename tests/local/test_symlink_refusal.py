"""A pull refused because a directory of the version is a symbolic link in DIR leaves DIR as
it was (issue 23, the last of the smaller ones): no link made for some files and not the
others, no journal that a later run would replay, the served version untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint

from deltasync import Publisher, PublisherConfig, Subscriber
from deltasync.errors import CheckpointError
from deltasync.local.state import StateDB

LAYOUT = (("model.embed.weight", (64, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))


def _listing(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed): what it is, and where a link points."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes().hex()[:64]
    return out


def _publish(url: str, tmp_path: Path, *, sub_in: tuple[int, ...]) -> list[Path]:
    """Versions 1..3; those in ``sub_in`` have a file under ``sub/`` (after model.safetensors)."""
    pub = Publisher(url, PublisherConfig(workers=2, progress=False))
    state = make_state(1, LAYOUT)
    dirs: list[Path] = []
    for v in (1, 2, 3):
        ckpt = write_checkpoint(tmp_path / f"ckpt{v}", state, step=v, side_files=False)
        if v in sub_in:
            (ckpt / "sub").mkdir()
            (ckpt / "sub" / "vocab.json").write_text(f'{{"v": {v}}}\n')
        pub.publish_dir(ckpt, base_dir=dirs[-1] if dirs else None)
        dirs.append(ckpt)
        state = step_state(state, seed=v)
    return dirs


def test_a_first_pull_refused_for_a_linked_directory_leaves_dir_as_it_was(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    _publish(url, tmp_path, sub_in=(1, 2, 3))
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir()
    (out / "sub").symlink_to(elsewhere)
    before = _listing(out)
    with pytest.raises(CheckpointError, match=r"sub: is a symbolic link; deltasync does not write through links"):
        Subscriber(url).pull_to_dir(out)
    assert _listing(out) == before  # no dangling model.safetensors, no state
    assert list(elsewhere.iterdir()) == []


def test_a_pull_refused_for_a_linked_directory_keeps_serving_the_version_held(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    dirs = _publish(url, tmp_path, sub_in=(3,))
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    Subscriber(url).pull_to_dir(out, 2)
    (out / "sub").symlink_to(elsewhere)  # version 3 adds sub/vocab.json
    before = _listing(out)
    with pytest.raises(CheckpointError, match="symbolic link"):
        Subscriber(url).pull_to_dir(out, 3)
    assert _listing(out) == before
    assert {k: v for k, v in tree_digests(out).items() if not k.startswith("sub")} == tree_digests(dirs[1])
    db = StateDB.open(out, create=False)
    assert db is not None and db.wip() is None and db.state() is not None and db.state().version == 2  # type: ignore[union-attr]
    (out / "sub").unlink()  # the user removes the link: the pull goes through
    assert Subscriber(url).pull_to_dir(out, 3) == 3
    assert tree_digests(out) == tree_digests(dirs[2])


@pytest.mark.slow
def test_cli_pull_refused_for_a_linked_directory_says_so_in_one_line(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    _publish(url, tmp_path, sub_in=(1, 2, 3))
    out = tmp_path / "out"
    out.mkdir()
    (out / "sub").symlink_to(tmp_path)
    run = subprocess.run([sys.executable, "-m", "deltasync", "pull", str(out), "--repo", url, "-q"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and run.stderr.count("\n") == 1 and "symbolic link" in run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["sub"]

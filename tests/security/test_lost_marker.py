"""Losing ``deltasync.json`` does not make a repository unusable (issue 33, item 6).

The next publisher takes the identity back from the manifests (every manifest names it), or
refuses with one line when they name more than one; it never writes a new identity over
versions that name another.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint

from deltasync import Publisher, PublisherConfig, Repository, Subscriber
from deltasync.errors import RepositoryIdentityError
from deltasync.format.manifest import manifest_key
from deltasync.ops.retention import collect
from deltasync.ops.verify import verify_repository
from deltasync.repo.repository import MARKER

LAYOUT = (("model.embed.weight", (64, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))
CONFIG = PublisherConfig(workers=2, progress=False)


def _publish(url: str, ckpts: Path, n: int, *, seed: int) -> list[Path]:
    state = make_state(seed, LAYOUT)
    pub = Publisher(url, CONFIG)
    dirs: list[Path] = []
    for i in range(n):
        ckpt = write_checkpoint(ckpts / f"ckpt{i + 1}", state, step=i + 1)
        pub.publish_dir(ckpt, base_dir=dirs[-1] if dirs else None)
        dirs.append(ckpt)
        state = step_state(state, seed=seed * 100 + i)
    return dirs


def test_the_next_publish_restores_the_identity_from_the_manifests(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    dirs = _publish(url, tmp_path / "a", 2, seed=1)
    identity = Repository(url).identity()
    assert identity is not None
    (tmp_path / "repo" / MARKER).unlink()

    ckpt = write_checkpoint(tmp_path / "ckpt3", step_state(make_state(1, LAYOUT), seed=9), step=3)
    assert Publisher(url, CONFIG).publish_dir(ckpt, base_dir=dirs[-1]).version == 3
    repo = Repository(url)
    assert repo.identity() == identity
    assert json.loads((tmp_path / "repo" / MARKER).read_text())["id"] == identity.hex()
    assert {repo.manifest(v).pb.repository_id for v in repo.versions()} == {identity}
    out = tmp_path / "out"
    Subscriber(url).pull_to_dir(out, 2)
    Subscriber(url).pull_to_dir(out, 3)  # a delta on 2: the chain reads as one repository's
    assert tree_digests(out) == tree_digests(ckpt)
    verify_repository(url)
    assert collect(url, keep_last=1, grace_seconds=0).versions_kept == [1, 2, 3]  # 3 is a delta on 2 on 1


def test_manifests_naming_two_identities_refuse_the_publish_in_one_line(tmp_path: Path) -> None:
    url, other = str(tmp_path / "repo"), str(tmp_path / "other")
    dirs = _publish(url, tmp_path / "a", 2, seed=1)
    _publish(other, tmp_path / "b", 1, seed=2)
    mine, theirs = Repository(url).identity(), Repository(other).identity()
    assert mine is not None and theirs is not None and mine != theirs
    # Another repository's version 1 copied over this one's, and the marker lost.
    shutil.copyfile(tmp_path / "other" / manifest_key(1), tmp_path / "repo" / manifest_key(1))
    (tmp_path / "repo" / MARKER).unlink()
    before = sorted(p.relative_to(tmp_path / "repo") for p in (tmp_path / "repo").rglob("*") if p.is_file())

    try:
        Publisher(url, CONFIG).publish_dir(dirs[-1])
    except RepositoryIdentityError as e:
        message = str(e)
    else:
        raise AssertionError("a publish over manifests naming two identities was not refused")
    assert mine.hex() in message and theirs.hex() in message and MARKER in message
    assert not (tmp_path / "repo" / MARKER).exists()  # no identity guessed, none written
    after = sorted(p.relative_to(tmp_path / "repo") for p in (tmp_path / "repo").rglob("*") if p.is_file())
    assert [p for p in after if not str(p).startswith(("packs", "blobs", "leases"))] == \
        [p for p in before if not str(p).startswith(("packs", "blobs", "leases"))]

    run = subprocess.run([sys.executable, "-m", "deltasync", "publish", str(dirs[-1]), "--repo", url],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "more than one identity" in lines[0] and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "repo" / MARKER).exists()

"""History only moves forward (issue 33, item 3).

A repository copied with ``cp -r`` keeps its identity, so two runs grown from one copy look
alike to every identity check. Every manifest carries a cumulative history digest, and a
follower holding version N refuses a newer version whose history does not pass through its
N: copying run 2 over run 1 is refused by run 1's followers, in one line, with nothing
swapped in. gc keeps what the check needs (history records of the versions it deletes).
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint

from deltasync import Publisher, PublisherConfig, Repository, Subscriber
from deltasync.agents import Agent, AgentConfig
from deltasync.errors import CorruptObjectError, HistoryError
from deltasync.format.manifest import manifest_key, parse_manifest, seal
from deltasync.format.signing import generate_keypair
from deltasync.local.state import read_local_state
from deltasync.ops.retention import collect
from deltasync.repo.history import extends, history_key
from deltasync.v1 import manifest_pb2 as pb

LAYOUT = (("model.embed.weight", (64, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))
CONFIG = PublisherConfig(workers=2, progress=False, snapshot_every=3)


def _grow(url: str, ckpts: Path, n: int, *, seed: int, key: Path | None) -> list[Path]:
    """``n`` more versions of a checkpoint directory, each changing 1% of the elements."""
    state = make_state(seed, LAYOUT)
    pub = Publisher(Repository(url, signing_key=key) if key is not None else url, CONFIG)
    dirs: list[Path] = []
    for i in range(n):
        state = step_state(state, seed=seed * 100 + i)
        ckpt = write_checkpoint(ckpts / f"ckpt{i + 1}", state, step=i + 1)
        pub.publish_dir(ckpt, base_dir=dirs[-1] if dirs else None)
        dirs.append(ckpt)
    return dirs


def _pull(out: Path, url: str, pub: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deltasync", "pull", str(out), "--repo", url, "--trusted-key", str(pub)],
                          capture_output=True, text=True, timeout=180)


def test_every_version_extends_the_history_of_the_one_before(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    _grow(url, tmp_path / "c", 4, seed=1, key=None)
    repo = Repository(url)
    infos = [repo.manifest(v) for v in repo.versions()]
    assert [i.pb.history_parent for i in infos] == [0, 1, 2, 3]
    assert all(len(i.pb.history_digest) == 16 for i in infos)
    for older, newer in itertools.pairwise(infos):
        assert newer.pb.history_parent_digest == older.pb.history_digest
    assert extends(repo.store, 1, infos[0].pb.history_digest, infos[3]) is True
    assert extends(repo.store, 2, infos[0].pb.history_digest, infos[3]) is False
    # The fields are bound by the whole-manifest digest and checked against each other.
    m = pb.Manifest.FromString((tmp_path / "repo" / manifest_key(3)).read_bytes())
    m.history_parent_digest = infos[0].pb.history_digest
    with pytest.raises(CorruptObjectError, match="history digest does not match"):
        parse_manifest(seal(m), expect_version=3)


def test_run_2_copied_over_run_1_is_refused_by_a_trusting_follower_of_run_1(tmp_path: Path) -> None:
    key, pub, _ = generate_keypair(tmp_path / "keys" / "team")
    run1, run2 = tmp_path / "run1", tmp_path / "run2"
    base = _grow(str(run1), tmp_path / "c0", 1, seed=1, key=key)
    shutil.copytree(run1, run2)  # cp -r: the same identity, the same version 1
    assert Repository(str(run1)).identity() == Repository(str(run2)).identity()
    state1 = make_state(5, LAYOUT)
    pub1 = Publisher(Repository(str(run1), signing_key=key), CONFIG)
    pub2 = Publisher(Repository(str(run2), signing_key=key), CONFIG)
    for i in range(2):
        state1 = step_state(state1, seed=50 + i)
        ckpt = write_checkpoint(tmp_path / "r1" / f"s{i}", state1, step=i + 2)
        pub1.publish_dir(ckpt, base_dir=None if i == 0 else base[-1])
        base.append(ckpt)
    for i in range(3):
        pub2.publish_dir(write_checkpoint(tmp_path / "r2" / f"s{i}", make_state(70 + i, LAYOUT), step=i + 2))
    assert Repository(str(run1)).versions() == [1, 2, 3] and Repository(str(run2)).versions() == [1, 2, 3, 4]

    out = tmp_path / "serving"
    assert _pull(out, str(run1), pub).returncode == 0
    held = tree_digests(out)
    state = read_local_state(out)
    assert state is not None and state.version == 3 and state.history_digest

    shutil.rmtree(run1)
    shutil.copytree(run2, run1)  # run 2 copied over run 1
    run = _pull(out, str(run1), pub)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert str(run1) in lines[0] and "version 4" in lines[0] and "version 3" in lines[0] and "fork" in lines[0]
    assert tree_digests(out) == held  # nothing swapped in
    after = read_local_state(out)
    assert after is not None and after.version == 3 and after.history_digest == state.history_digest

    # A following agent: the same refusal, recorded, and the copy stays.
    agent = Agent(str(run1), out, AgentConfig(retries=1, backoff_initial=0.01, backoff_max=0.02), trusted_keys=pub)
    with pytest.raises(HistoryError, match="does not extend version 3"):
        agent.run()
    assert tree_digests(out) == held


def test_a_follower_behind_the_retention_still_checks_through_gc_records(tmp_path: Path) -> None:
    key, pub, _ = generate_keypair(tmp_path / "keys" / "team")
    url = str(tmp_path / "repo")
    _grow(url, tmp_path / "c", 2, seed=1, key=key)
    out = tmp_path / "serving"
    assert _pull(out, url, pub).returncode == 0
    _grow(url, tmp_path / "d", 6, seed=2, key=key)  # versions 3-8: snapshots 3 and 6
    report = collect(url, keep_last=1, grace_seconds=0)
    assert report.versions_deleted == [5, 4, 3, 2, 1]
    assert (tmp_path / "repo" / history_key(2)).is_file()
    run = _pull(out, url, pub)  # walks 8 -> 7 -> 6, then through gc's records 5 -> 4 -> 3 -> 2
    assert run.returncode == 0, run.stderr
    assert read_local_state(out).version == 8  # type: ignore[union-attr]

    # A record deleted (a store writer, or an older gc): a trusting follower cannot tell, refuses.
    _grow(url, tmp_path / "e", 1, seed=3, key=key)  # 9, a snapshot
    out2 = tmp_path / "second"
    Subscriber(Repository(url, trusted_keys=pub)).pull_to_dir(out2, 8)
    _grow(url, tmp_path / "f", 2, seed=4, key=key)  # 10 (a snapshot), 11
    assert collect(url, keep_last=1, grace_seconds=0).versions_deleted == [9, 8, 7, 6]
    (tmp_path / "repo" / history_key(9)).unlink()
    run = _pull(out2, url, pub)
    assert run.returncode != 0 and "cannot check that version 11 extends version 8" in run.stderr, run.stderr
    assert read_local_state(out2).version == 8  # type: ignore[union-attr]


def test_an_engine_agent_refuses_a_fork_and_its_engine_keeps_its_bits(tmp_path: Path) -> None:
    """Without keys too: a version that provably does not extend the one held is refused."""
    from deltasync.agents import EngineAgent
    from deltasync.engines import TorchEngine

    run1, run2 = tmp_path / "run1", tmp_path / "run2"
    state = make_state(1, LAYOUT)
    Publisher(str(run1), CONFIG).publish(state)
    shutil.copytree(run1, run2)
    pub1 = Publisher(str(run1), CONFIG)
    pub1.publish(state)  # version 2 of run 1 (a fresh publisher: a snapshot)
    pub2 = Publisher(str(run2), CONFIG)
    for i in range(2):
        pub2.publish(step_state(state, seed=80 + i))  # versions 2, 3 of run 2
    engine = TorchEngine({k: torch.zeros_like(v) for k, v in state.items()}, str(run1), workers=2)
    config = AgentConfig(retries=1, backoff_initial=0.01, backoff_max=0.02)
    assert EngineAgent(engine, tmp_path / "state", config).run() == 2
    held = {k: v.clone() for k, v in engine.tensors.items()}

    shutil.rmtree(run1)
    shutil.copytree(run2, run1)
    with pytest.raises(HistoryError, match=r"version 3 does not extend version 2"):
        EngineAgent(engine, tmp_path / "state", config).run()
    assert engine.version == 2
    assert all(torch.equal(engine.tensors[k].view(torch.uint8), held[k].view(torch.uint8)) for k in held)

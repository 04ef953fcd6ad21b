"""Squashes: writing them (publisher hook, library, CLI), planning with them, damage, gc, verify."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from deltasync import (
    CorruptObjectError,
    PlanesZstdCodec,
    Publisher,
    PublisherConfig,
    Repository,
    Subscriber,
    UsageError,
)
from deltasync.format.signing import generate_keypair
from deltasync.ops.retention import collect
from deltasync.ops.verify import verify_repository
from deltasync.publish.squash import verify_squash, write_squash, write_squashes
from deltasync.repo.repository import squash_key
from deltasync.storage import Store, WrappingStore, open_store
from deltasync.v1 import manifest_pb2 as pb

State = dict[str, torch.Tensor]
VERSIONS = 30
STRIDES = (5, 15)  # squashes 5->10, 10->15, ..., 25->30 and 15->30
SNAPSHOT_EVERY = 12  # snapshots 1, 13, 25: squashes 10->15 and 20->25 cross one


# -- helpers ---------------------------------------------------------------------------------


def make_stream(n: int, seed: int = 0) -> list[State]:
    """RL-like versions: each step moves 1% of the elements by one ulp, drawn from a "hot"
    6% that keep changing, so the changes of consecutive steps overlap."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-(1 << 14), 1 << 14, 64 * 256, dtype=np.int16)
    b = rng.standard_normal(1000).astype(np.float32).view(np.int32)
    hot_w = rng.choice(w.size, w.size * 6 // 100, replace=False)
    hot_b = rng.choice(b.size, 60, replace=False)
    out: list[State] = []
    for _ in range(n):
        w, b = w.copy(), b.copy()
        w[rng.choice(hot_w, w.size // 100, replace=False)] += 1
        b[rng.choice(hot_b, 10, replace=False)] += 1
        out.append({
            "w": torch.from_numpy(w.copy()).view(torch.bfloat16).reshape(64, 256),
            "b": torch.from_numpy(b.copy().view(np.float32)),
        })
    return out


def config(strides: tuple[int, ...] = STRIDES) -> PublisherConfig:
    return PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=4096), snapshot_every=SNAPSHOT_EVERY, workers=2,
                           progress=False, squash_strides=strides)


def publish_stream(url: str, states: list[State], strides: tuple[int, ...] = STRIDES) -> Publisher:
    pub = Publisher(url, config(strides))
    for s in states:
        pub.publish(s)
    return pub


@pytest.fixture(scope="module")
def states() -> list[State]:
    return make_stream(VERSIONS)


def assert_state(got: dict[str, torch.Tensor], want: State) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        a, b = got[k].contiguous().view(torch.uint8), want[k].contiguous().view(torch.uint8)
        assert a.shape == b.shape and torch.equal(a, b), k


class CountingStore(WrappingStore):
    """Delegates to ``inner`` and counts the bytes read from packs."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.pack_bytes = 0
        self._lock = threading.Lock()

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        data = self.inner.get(key, byte_range)
        if key.startswith("packs/"):
            with self._lock:
                self.pack_bytes += len(data)
        return data


def packs_of(repo: Repository, a: int, c: int) -> list[str]:
    return [p.key for p in repo.squash(a, c).pb.packs]


# -- writing -----------------------------------------------------------------------------------


def test_publisher_writes_squashes_at_its_strides(repo_url: str, states: list[State]) -> None:
    pub = Publisher(repo_url, config(STRIDES))
    results = [pub.publish(s) for s in states]
    repo = Repository(repo_url)
    assert repo.squashes() == [(5, 10), (10, 15), (15, 20), (20, 25), (15, 30), (25, 30)]
    assert [(r.a, r.c, r.outcome) for r in results[-1].squashes] == [(25, 30, "written"), (15, 30, "written")]
    assert [v for v in repo.versions() if repo.manifest(v).is_snapshot] == [1, 13, 25]
    for a, c in repo.squashes():
        sq, target = repo.squash(a, c), repo.manifest(c)
        assert sq.parent == a and sq.version == c and not sq.is_snapshot
        assert sq.pb.version_digest == target.pb.version_digest
        assert not repo.store.exists(f"manifests/{a:020d}-{c:020d}.pb")  # never a commit
        # Smaller than what a subscriber at a fetched before (deltas or a snapshot).
        assert sq.pb.stored_bytes < sum(repo.manifest(v).pb.stored_bytes for v in range(a + 1, c + 1))
    assert repo.latest() == VERSIONS and repo.versions() == list(range(1, VERSIONS + 1))


def test_config_rejects_strides_below_two() -> None:
    for bad in ((1,), (0, 5), (True,)):
        with pytest.raises(UsageError, match="squash_strides"):
            PublisherConfig(squash_strides=bad)


def test_squash_not_smaller_than_the_path_is_not_written(memory_repo_url: str, states: list[State]) -> None:
    publish_stream(memory_repo_url, states[:4], strides=())
    repo = Repository(memory_repo_url)
    before = set(repo.store.list("packs/"))
    r = write_squash(repo, 3, 4)  # exactly the delta 3 -> 4: cannot be smaller
    assert r.outcome == "not smaller" and r.path_bytes == repo.manifest(4).pb.stored_bytes
    assert repo.squashes() == [] and set(repo.store.list("packs/")) == before  # its packs are gone again
    assert write_squash(repo, 1, 4).outcome == "written"
    assert write_squash(repo, 1, 4).outcome == "exists"
    with pytest.raises(UsageError):
        write_squash(repo, 4, 1)


def test_squash_must_describe_its_target(memory_repo_url: str, states: list[State]) -> None:
    publish_stream(memory_repo_url, states[:10], strides=())
    repo = Repository(memory_repo_url)
    write_squash(repo, 5, 10)
    # A squash from elsewhere (here: the delta 9 -> 10 relabelled) is refused before use.
    forged = pb.Manifest()
    forged.CopyFrom(repo.manifest(10).pb)
    forged.parent = 4
    with pytest.raises(CorruptObjectError, match="squash 4->10"):
        repo.put_squash(forged)
    other = pb.Manifest()
    other.CopyFrom(repo.squash(5, 10).pb)
    other.version = 9
    repo.store.put(squash_key(5, 9), other.SerializeToString())
    with pytest.raises(CorruptObjectError, match="squash 5->9"):
        Repository(memory_repo_url).squash(5, 9)
    # The planner skips it (with a warning) and still pulls bit-exactly.
    sub = Subscriber(memory_repo_url)
    sub.pull(5)
    got = sub.pull(10)
    assert_state(got, states[9])
    assert got.plan.squashes == ((5, 10),)


# -- planning ----------------------------------------------------------------------------------


def test_far_behind_subscriber_fetches_fewer_bytes_through_squashes(repo_url: str, states: list[State]) -> None:
    publish_stream(repo_url, states)
    counting = CountingStore(open_store(repo_url))
    sub = Subscriber(counting)
    sub.pull(2)
    plain, _ = sub.plan(VERSIONS, 2, squashes=False)
    counting.pack_bytes = 0
    got = sub.pull(VERSIONS)
    assert_state(got, states[-1])
    plan = got.plan
    assert plan.base == 2
    assert plan.versions == (2, 3, 4, 5, 10, 15, 30)
    assert plan.squashes == ((5, 10), (10, 15), (15, 30))
    # Without squashes the chain from 2 is cut by snapshots 13 and 25: snapshot 25 and its chain.
    assert plain.base is None and plain.versions == (25, 26, 27, 28, 29, 30) and not plain.squashes
    assert plan.fetch_bytes * 4 < plain.fetch_bytes
    assert 0 < counting.pack_bytes <= plan.fetch_bytes

    # The same subscriber, one stride behind again: one squash, no snapshot.
    sub2 = Subscriber(repo_url)
    sub2.pull(20)
    got = sub2.pull(25)
    assert_state(got, states[24])  # 25 is a snapshot: the squash 20 -> 25 replaces it
    assert got.plan.squashes == ((20, 25),)
    assert got.plan.fetch_bytes < Repository(repo_url).manifest(25).pb.stored_bytes / 5


def test_plans_where_no_squash_helps_are_unchanged(memory_repo_url: str, states: list[State]) -> None:
    publish_stream(memory_repo_url, states)
    sub = Subscriber(memory_repo_url)
    for local, target in ((None, 4), (29, 30), (11, 12), (26, 28), (7, 7), (30, 4)):
        with_sq, _ = sub.plan(target, local)
        without, _ = sub.plan(target, local, squashes=False)
        assert with_sq == without
    # From nothing, a squash out of a snapshot helps too: snapshot 25, then 25 -> 30.
    fresh, _ = sub.plan(30, None)
    assert fresh.base is None and fresh.versions == (25, 30) and fresh.squashes == ((25, 30),)
    sub.pull(27)
    got = sub.pull(30)
    assert_state(got, states[29])  # 27 -> 30: plain deltas, no squash starts at 27
    assert got.plan.versions == (27, 28, 29, 30) and not got.plan.squashes


def test_partial_pull_costs_only_wanted_chunks(memory_repo_url: str, states: list[State]) -> None:
    publish_stream(memory_repo_url, states)
    sub = Subscriber(memory_repo_url)
    sub.pull(4)
    got = sub.pull(30, tensors=["b"])
    assert torch.equal(got["b"].view(torch.int32), states[29]["b"].view(torch.int32))
    partial = got.plan
    full, _ = sub.plan(30, 4)
    assert partial is not None and partial.squashes and 0 < partial.fetch_bytes < full.fetch_bytes / 5


def test_directory_pulls_use_squashes(tmp_path: Path, states: list[State]) -> None:
    from safetensors.torch import save_file

    url = str(tmp_path / "repo")
    pub = Publisher(url, config((4,)))
    for i, s in enumerate(states[:8]):
        ckpt = tmp_path / f"ckpt-{i + 1}"
        ckpt.mkdir()
        save_file(dict(s), str(ckpt / "model.safetensors"))
        (ckpt / "config.json").write_text(f'{{"step": {i + 1}}}')
        pub.publish_dir(ckpt, cache_dir=tmp_path / "cache")
    assert Repository(url).squashes() == [(4, 8)]  # built from the checkpoint files on disk
    sub = Subscriber(url)
    sub.pull_to_dir(tmp_path / "serving", 4)
    result = sub.update_dir(tmp_path / "serving", 8)  # walks the served copy of 4 forward, through the squash
    assert result.squashes == ((4, 8),) and result.walked > 0 and not result.rebuilt, result
    assert (tmp_path / "serving" / "model.safetensors").read_bytes() == (tmp_path / "ckpt-8" / "model.safetensors").read_bytes()
    assert (tmp_path / "serving" / "config.json").read_text() == '{"step": 8}'
    verify_repository(url)


# -- damage ------------------------------------------------------------------------------------


def test_damaged_squash_falls_back_to_plain_deltas(
    local_repo_url: str, states: list[State], caplog: pytest.LogCaptureFixture
) -> None:
    publish_stream(local_repo_url, states[:15])
    repo = Repository(local_repo_url)
    key = packs_of(repo, 10, 15)[0]
    path = Path(local_repo_url) / key
    raw = bytearray(path.read_bytes())
    for i in range(0, len(raw), 97):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))
    sub = Subscriber(local_repo_url)
    sub.pull(10)
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        got = sub.pull(15)
    assert_state(got, states[14])  # bit-exact anyway: the chunks came from snapshot 13
    assert got.plan.squashes == ((10, 15),)
    assert "squash 10->15 is unusable" in caplog.text
    with pytest.raises(CorruptObjectError, match=r"squash 10->15.*tensor"):
        verify_repository(local_repo_url)
    with pytest.raises(CorruptObjectError, match="squash 10->15"):
        verify_squash(repo, 10, 15)
    verify_squash(repo, 5, 10)  # the others are fine

    path.unlink()  # a missing pack is damage too: same fallback, verify names the squash
    sub = Subscriber(local_repo_url)
    sub.pull(10)
    assert_state(sub.pull(15), states[14])
    with pytest.raises(CorruptObjectError, match=r"squash 10->15: pack .* is missing"):
        verify_repository(local_repo_url)

    # Inside one chain the fallback is the plain deltas from the local version, not a snapshot.
    for key in packs_of(repo, 5, 10):
        (Path(local_repo_url) / key).unlink()
    counting = CountingStore(open_store(local_repo_url))
    sub = Subscriber(counting)
    sub.pull(5)
    counting.pack_bytes = 0
    got = sub.pull(10)
    assert_state(got, states[9])
    assert got.plan.squashes == ((5, 10),)
    assert 0 < counting.pack_bytes <= sum(repo.manifest(v).pb.stored_bytes for v in range(6, 11))


# -- gc ----------------------------------------------------------------------------------------


def test_gc_keeps_a_squash_exactly_while_both_versions_are_kept(repo_url: str, states: list[State]) -> None:
    publish_stream(repo_url, states)
    repo = Repository(repo_url)
    squash_packs = {ac: set(packs_of(repo, *ac)) for ac in repo.squashes()}
    dry = collect(repo_url, keep_last=4, keep_every=15, grace_seconds=0, dry_run=True)
    assert len(repo.squashes()) == 6  # a dry run deletes nothing
    report = collect(repo_url, keep_last=4, keep_every=15, grace_seconds=0)
    # Kept: 27..30 with their chain from snapshot 25, and 15 with its chain from snapshot 13.
    assert report.versions_kept == [13, 14, 15, 25, 26, 27, 28, 29, 30]
    gone = [(5, 10), (10, 15), (15, 20), (20, 25)]  # each touches a deleted version
    assert report.squashes_deleted == dry.squashes_deleted == gone
    assert report.squashes_kept == dry.squashes_kept == [(15, 30), (25, 30)]
    assert repo.squashes() == [(15, 30), (25, 30)]
    assert "4 squash(es)" in report.summary()
    # Their packs wait out the grace (gc never deletes what a commit may just have reused):
    # the next run deletes them.
    assert set(report.pending) >= set().union(*(squash_packs[ac] for ac in gone)) and not report.packs_deleted
    again = collect(repo_url, keep_last=4, keep_every=15, grace_seconds=0)
    left = set(repo.store.list("packs/"))
    for ac, keys in squash_packs.items():
        assert (keys <= left) if ac in report.squashes_kept else not (keys & left), ac
    assert set(again.packs_deleted) >= set().union(*(squash_packs[ac] for ac in gone))
    checked = verify_repository(repo_url)
    assert checked.squashes == [(15, 30), (25, 30)] and not checked.notes  # no orphans: squash packs count
    sub = Subscriber(repo_url)
    sub.pull(15)
    got = sub.pull(30)
    assert_state(got, states[29])
    assert got.plan.squashes == ((15, 30),)


# -- signing -----------------------------------------------------------------------------------


def test_squashes_are_signed_and_checked_like_commits(
    tmp_path: Path, states: list[State], caplog: pytest.LogCaptureFixture
) -> None:
    key, pub_key, _ = generate_keypair(tmp_path / "k")
    url = str(tmp_path / "repo")
    pub = Publisher(url, config((4,)), signing_key=key)
    for s in states[:8]:
        pub.publish(s)
    repo = Repository(url, trusted_keys=pub_key)
    assert repo.squash(4, 8).pb.signature
    # An unsigned squash (a background job without the key) is ignored by trusting readers.
    write_squash(url, 2, 8)
    sub = Subscriber(url, trusted_keys=pub_key)
    sub.pull(2)
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        got = sub.pull(8)
        assert_state(got, states[7])
    assert "ignoring squash 2->8" in caplog.text and "squash 2->8: unsigned" in caplog.text
    assert got.plan.squashes == ((4, 8),)  # the signed one only
    write_squash(url, 3, 8, signing_key=key)
    sub = Subscriber(url, trusted_keys=pub_key)
    sub.pull(3)
    got = sub.pull(8)
    assert_state(got, states[7])
    assert got.plan.squashes == ((3, 8),)


# -- command line ------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deltasync", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=120)


def test_squash_command(tmp_path: Path, states: list[State]) -> None:
    url = str(tmp_path / "repo")
    publish_stream(url, states[:12], strides=())
    r = run_cli("squash", "--repo", url, "--from", "2", "--to", "10", "-q")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("squash 2->10: ") and "stored" in r.stdout, r.stdout
    r = run_cli("squash", "--repo", url, "--from", "2", "--to", "10", "-q")
    assert r.stdout.strip() == "squash 2->10: already stored", r.stdout
    r = run_cli("squash", "--repo", url, "--stride", "4", "-q")
    assert r.returncode == 0 and r.stdout.count("squash ") == 2, r.stdout + r.stderr  # 4->8, 8->12
    r = run_cli("squash", "--repo", url, "--from", "10", "--to", "2")
    assert r.returncode == 2 and r.stderr.startswith("deltasync: error:") and "Traceback" not in r.stderr
    r = run_cli("squash", "--repo", url, "--from", "2", "--to", "99")
    assert r.returncode != 0 and "version 99 not found" in r.stderr
    assert write_squashes(url, [4]) == []  # nothing missing any more
    assert Repository(url).squashes() == [(4, 8), (2, 10), (8, 12)]
    r = run_cli("verify", "--repo", url, "-q")
    assert r.returncode == 0 and "verified 12 version(s), 3 squash(es)" in r.stdout, r.stdout + r.stderr
    out = tmp_path / "serving"
    assert run_cli("pull", "--repo", url, "--out", str(out), "--version", "2", "-q").returncode == 0
    r = run_cli("pull", "--repo", url, "--out", str(out), "--version", "12", "-q")
    assert r.returncode == 0 and "local via squash 2->10" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("classes", [0, 6])
def test_squashes_code_positions_as_the_publisher_is_configured(memory_repo_url: str, classes: int) -> None:
    # The manifest's codec version says what a decoder must read (version 3 reads magnitude
    # classes); whether a squash uses them is the publisher's choice, as for its deltas.
    cfg = PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=4096, max_classes=classes), snapshot_every=SNAPSHOT_EVERY,
                          workers=2, progress=False, squash_strides=(5,))
    # Weight-like versions: small weights (a small ulp) change more often, as under AdamW.
    rng = np.random.default_rng(1)
    w = torch.from_numpy(rng.standard_normal(64 * 1024).astype(np.float32)).to(torch.bfloat16).view(torch.int16)
    small = (w.view(torch.bfloat16).abs() < 0.3).numpy()
    stream: list[State] = []
    for _ in range(10):
        w = w.clone()
        hit = rng.random(w.numel()) < np.where(small, 0.08, 0.004)
        w[torch.from_numpy(hit)] += 1
        stream.append({"w": w.view(torch.bfloat16).reshape(64, 1024).clone()})
    pub = Publisher(memory_repo_url, cfg)
    for s in stream:
        pub.publish(s)
    repo = Repository(memory_repo_url)
    assert repo.squashes() == [(5, 10)]
    coded: list[int] = []  # the position coding of every sparse chunk, deltas and the squash
    for info in [repo.manifest(v) for v in range(2, 11)] + [repo.squash(5, 10)]:
        assert info.pb.codec.codec_version == 3
        for t in info.pb.tensors:
            for c in t.chunks:
                if c.encoding == pb.SPARSE:
                    payload = repo.store.get(info.pb.packs[c.pack].key, (c.offset, c.length))
                    coded.append(payload[1])
    assert coded and ((3 in coded) if classes else (3 not in coded))  # 3: magnitude classes
    got = Subscriber(memory_repo_url, progress=False).pull(10)
    assert_state(got, stream[9])

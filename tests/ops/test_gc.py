"""deltasync.ops.retention.collect and ``deltasync gc``: retention, chains, orphans and grace, concurrency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from deltasync import (
    DeltasyncError,
    PlanesZstdCodec,
    Publisher,
    PublisherConfig,
    Repository,
    RepositoryNotFoundError,
    Subscriber,
    UsageError,
)
from deltasync.format.manifest import manifest_key, version_from_key
from deltasync.local.state import read_local_state
from deltasync.ops.retention import PENDING, GcReport, collect
from deltasync.ops.verify import verify_repository
from deltasync.repo.repository import blob_key
from deltasync.storage import Store
from deltasync.v1 import manifest_pb2 as pb

pytest_plugins = ["s3server"]  # the s3_url fixture

State = dict[str, torch.Tensor]
VERSIONS = 10  # snapshot_every=3: snapshots 1, 4, 7, 10; deltas in between


# -- helpers ---------------------------------------------------------------------------------


def make_states(n: int, seed: int = 0) -> list[State]:
    rng = np.random.default_rng(seed)
    w = torch.from_numpy(rng.integers(0, 256, 8192, dtype=np.uint8)).view(torch.bfloat16)
    b = torch.from_numpy(rng.standard_normal(256, dtype=np.float32))
    out = [{"w": w, "b": b}]
    for _ in range(n - 1):
        raw = bytearray(bits(out[-1]["w"]))
        for i in rng.choice(len(raw), 200, replace=False):
            raw[i] ^= int(rng.integers(1, 256))
        w = torch.frombuffer(raw, dtype=torch.uint8).view(torch.bfloat16).clone()
        out.append({"w": w, "b": out[-1]["b"] + 1})
    return out


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def config() -> PublisherConfig:
    return PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=1024), snapshot_every=3, workers=2, progress=False)


def publish_all(url: str, states: list[State]) -> Publisher:
    pub = Publisher(url, config())
    for s in states:
        pub.publish(s)
    repo = Repository(url)
    kinds = "".join("S" if repo.manifest(v).is_snapshot else "D" for v in repo.versions())
    assert kinds == "SDD" * (len(states) // 3) + "SDD"[: len(states) % 3]
    return pub


def assert_state(got: Mapping[str, torch.Tensor], want: State) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and tuple(got[name].shape) == tuple(t.shape)
        assert bits(got[name]) == bits(t), name


def object_keys(store: Store) -> set[str]:
    return set(store.list("packs/")) | set(store.list("blobs/"))


def referenced_keys(url: str) -> set[str]:
    repo = Repository(url)
    out: set[str] = set()
    for v in repo.versions():
        m = repo.manifest(v).pb
        out.update(p.key for p in m.packs)
        out.update(blob_key(d) for f in m.files for d in f.blob_parts)
    return out


def crash_a_publish(pub: Publisher, state: State, monkeypatch: pytest.MonkeyPatch) -> None:
    """A publisher killed after its packs are durable, before its manifest."""

    def killed(self: Repository, manifest: pb.Manifest, **kwargs: Any) -> Any:
        raise KeyboardInterrupt("publisher killed before its manifest")

    with monkeypatch.context() as m:
        m.setattr(Repository, "commit", killed)
        with pytest.raises(KeyboardInterrupt):
            pub.publish(state)


# -- retention --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keep_last", "keep_every", "kept"),
    [
        (2, None, [7, 8, 9, 10]),  # 9 is a delta on 8 on snapshot 7
        (1, None, [10]),  # the latest is a snapshot: nothing else needed
        (2, 5, [4, 5, 7, 8, 9, 10]),  # 5 needs snapshot 4
        (3, 3, list(range(1, 11))),  # 3, 6, 9 pull in every chain: nothing to delete
        (1, 4, [4, 7, 8, 10]),  # 8 needs snapshot 7
    ],
)
def test_retention_keeps_retained_versions_and_their_chains(
    repo_url: str, keep_last: int, keep_every: int | None, kept: list[int]
) -> None:
    states = make_states(VERSIONS)
    publish_all(repo_url, states)
    check_retention(repo_url, states, keep_last, keep_every, kept)


def check_retention(url: str, states: list[State], keep_last: int, keep_every: int | None, kept: list[int]) -> None:
    repo = Repository(url)
    before = object_keys(repo.store)
    report = collect(url, keep_last=keep_last, keep_every=keep_every, grace_seconds=0)
    deleted = sorted(set(range(1, VERSIONS + 1)) - set(kept))
    assert report.versions_kept == kept
    assert sorted(report.versions_deleted) == deleted
    assert repo.versions() == kept
    assert repo.latest() == VERSIONS
    # Objects of deleted versions become unreferenced now: they wait out the grace (a publish
    # may be reusing them), so the first run deletes none and records them all.
    freed = before - referenced_keys(url)
    assert object_keys(repo.store) == before
    assert report.packs_deleted == [] and sorted(report.pending) == sorted(freed) and report.notes == []
    assert (report.bytes_freed > 0) == bool(deleted)
    assert verify_repository(url).notes == []
    for v in kept:
        assert_state(Subscriber(url).pull(v), states[v - 1])
    # The second run (grace 0) deletes them; nothing referenced is gone.
    again = collect(url, keep_last=keep_last, keep_every=keep_every, grace_seconds=0)
    remaining = object_keys(repo.store)
    assert remaining == referenced_keys(url)
    assert again.versions_deleted == [] and set(again.packs_deleted) == freed and again.pending == []
    assert verify_repository(url).notes == []
    third = collect(url, keep_last=keep_last, keep_every=keep_every, grace_seconds=0)
    assert third.packs_deleted == [] and third.bytes_freed == 0


def test_retention_on_s3(s3_url: str) -> None:
    states = make_states(VERSIONS)
    publish_all(s3_url, states)
    check_retention(s3_url, states, 2, 5, [4, 5, 7, 8, 9, 10])


def test_manifests_go_newest_first_and_every_visible_chain_stays_whole(
    repo_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_all(repo_url, make_states(VERSIONS))
    repo = Repository(repo_url)
    store_type = type(repo.store)
    original = store_type.delete
    order: list[int] = []

    def checked_delete(self: Store, key: str) -> None:
        original(self, key)
        v = version_from_key(key)
        if v is not None:
            order.append(v)
            fresh = Repository(repo_url)  # no cached manifests: what a new reader sees
            for other in fresh.versions():
                fresh.chain(other)  # raises if a visible delta lost an ancestor

    monkeypatch.setattr(store_type, "delete", checked_delete)
    report = collect(repo_url, keep_last=1, keep_every=5, grace_seconds=0)
    assert order == sorted(order, reverse=True) == report.versions_deleted == [9, 8, 7, 6, 3, 2, 1]


def test_blobs_of_deleted_versions_go_and_shared_blobs_stay(local_repo_url: str, tmp_path: Path) -> None:
    pub = Publisher(local_repo_url, config())
    states = make_states(4)
    for i, s in enumerate(states):
        ckpt = tmp_path / f"step-{i}"
        ckpt.mkdir()
        save_file(s, str(ckpt / "model.safetensors"))
        (ckpt / "config.json").write_text('{"shared": true}')
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": i}))
        pub.publish_dir(ckpt)
    store = pub.repo.store
    blobs_before = set(store.list("blobs/"))
    assert len(blobs_before) == 5  # one shared config, four trainer states
    report = collect(local_repo_url, keep_last=1, grace_seconds=0)
    assert report.versions_kept == [4] and report.blobs_deleted == []
    assert len([k for k in report.pending if k.startswith("blobs/")]) == 3  # they wait out the grace
    report = collect(local_repo_url, keep_last=1, grace_seconds=0)
    assert len(report.blobs_deleted) == 3
    assert set(store.list("blobs/")) == blobs_before - set(report.blobs_deleted)
    assert set(store.list("blobs/")) == referenced_keys(local_repo_url) & blobs_before
    out = tmp_path / "out"
    Subscriber(local_repo_url).pull_to_dir(out)
    assert (out / "config.json").read_text() == '{"shared": true}'
    assert json.loads((out / "trainer_state.json").read_text()) == {"step": 3}
    assert verify_repository(local_repo_url).notes == []


def test_dry_run_deletes_nothing_and_predicts_the_real_run(repo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    states = make_states(VERSIONS)
    pub = publish_all(repo_url, states)
    crash_a_publish(pub, make_states(2, seed=9)[1], monkeypatch)
    store = Repository(repo_url).store
    before = {k: store.get(k) for k in store.list()}
    dry = collect(repo_url, keep_last=2, grace_seconds=0, dry_run=True)
    assert {k: store.get(k) for k in store.list()} == before  # not even gc/pending.json
    assert dry.dry_run and dry.versions_deleted and dry.pending and dry.bytes_freed > 0
    assert "would delete 6 version(s)" in dry.summary()
    real = collect(repo_url, keep_last=2, grace_seconds=0)
    assert (real.versions_kept, real.versions_deleted, real.packs_deleted, real.blobs_deleted, real.bytes_freed) == (
        dry.versions_kept, dry.versions_deleted, dry.packs_deleted, dry.blobs_deleted, dry.bytes_freed
    )
    assert real.pending == dry.pending


def test_only_manifests_packs_and_blobs_are_touched(repo_url: str) -> None:
    publish_all(repo_url, make_states(5))
    store = Repository(repo_url).store
    store.put("squashes/00000000000000000003.pb", b"future manifest-like object")
    store.put("packs/not-a-pack-key", b"unknown")
    others = {k: store.get(k) for k in store.list() if not k.startswith(("manifests/", "packs/", "blobs/"))}
    assert "refs/latest" in others and "deltasync.json" in others
    for _ in range(2):
        collect(repo_url, keep_last=1, grace_seconds=0)
    # Besides, gc writes the history records of the versions it deletes (repo/history.py).
    touched = ("manifests/", "packs/", "blobs/", "history/")
    assert {k: store.get(k) for k in store.list() if not k.startswith(touched)} == others
    assert sorted(store.list("history/")) == [f"history/{v:020d}.json" for v in (1, 2, 3)]  # 4 and 5 kept
    assert store.exists("packs/not-a-pack-key")


# -- orphans and the grace period -----------------------------------------------------------------


def test_orphans_of_a_crashed_publish_wait_for_the_grace_period(repo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    states = make_states(3)
    pub = publish_all(repo_url, states)
    repo = Repository(repo_url)
    store = repo.store
    committed = object_keys(store)
    crash_a_publish(pub, make_states(4, seed=3)[3], monkeypatch)
    orphan_blob, _ = repo.put_blob(b"a config file of the crashed publish")
    orphans = object_keys(store) - committed
    assert len(orphans) >= 2 and blob_key(orphan_blob) in orphans

    clock = [1000.0]
    runs: list[GcReport] = []

    def gc(grace: float = 60) -> GcReport:
        runs.append(collect(repo_url, keep_last=5, grace_seconds=grace, clock=lambda: clock[0]))
        return runs[-1]

    assert gc().pending == sorted(orphans)  # first sight: recorded, kept
    assert object_keys(store) == committed | orphans
    assert set(json.loads(store.get(PENDING))["objects"]) == orphans
    clock[0] += 59
    assert gc().pending == sorted(orphans)  # not yet a grace period since first seen
    assert object_keys(store) == committed | orphans
    clock[0] += 1
    r = gc()
    assert sorted(r.packs_deleted + r.blobs_deleted) == sorted(orphans)
    assert r.pending == [] and r.versions_deleted == [] and r.bytes_freed > 0
    assert object_keys(store) == committed
    assert not store.exists(PENDING)
    assert verify_repository(repo_url).notes == []
    for v, s in enumerate(states, 1):
        assert_state(Subscriber(repo_url).pull(v), s)


def test_orphans_with_zero_grace_go_on_the_second_run(repo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pub = publish_all(repo_url, make_states(2))
    crash_a_publish(pub, make_states(3, seed=5)[2], monkeypatch)
    store = Repository(repo_url).store
    orphans = object_keys(store) - referenced_keys(repo_url)
    assert orphans
    assert collect(repo_url, keep_last=1, grace_seconds=0).pending == sorted(orphans)
    assert orphans <= object_keys(store)
    second = collect(repo_url, keep_last=1, grace_seconds=0)
    assert set(second.packs_deleted) == orphans and second.pending == []
    assert object_keys(store) == referenced_keys(repo_url)


def test_a_publish_in_flight_within_the_grace_period_survives(repo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    states = make_states(4)
    pub = publish_all(repo_url, states[:3])
    reached_commit, release = threading.Event(), threading.Event()
    original = Repository.commit

    def slow_commit(self: Repository, manifest: pb.Manifest, **kwargs: Any) -> Any:
        reached_commit.set()
        assert release.wait(30)
        return original(self, manifest, **kwargs)

    monkeypatch.setattr(Repository, "commit", slow_commit)
    result: list[int] = []
    th = threading.Thread(target=lambda: result.append(pub.publish(states[3])))
    th.start()
    try:
        assert reached_commit.wait(30)  # its packs are durable, its manifest is not
        in_flight = object_keys(Repository(repo_url).store) - referenced_keys(repo_url)
        assert in_flight
        for _ in range(3):
            r = collect(repo_url, keep_last=3, grace_seconds=3600)
            assert r.pending == sorted(in_flight) and not r.packs_deleted
    finally:
        release.set()
        th.join(30)
    assert result == [4]
    r = collect(repo_url, keep_last=3, grace_seconds=0)
    assert r.pending == [] and r.versions_deleted == []  # 4 is a snapshot; 2 and 3 need 1
    assert not Repository(repo_url).store.exists(PENDING)
    assert_state(Subscriber(repo_url).pull(4), states[3])
    assert verify_repository(repo_url).notes == []


@pytest.mark.parametrize("during", ["manifests/", "packs/"])
def test_version_committed_while_gc_runs_is_kept(repo_url: str, during: str, monkeypatch: pytest.MonkeyPatch) -> None:
    states = make_states(VERSIONS + 1)
    pub = publish_all(repo_url, states[:VERSIONS])
    store_type = type(Repository(repo_url).store)
    original = store_type.delete
    published: list[int] = []
    lock = threading.RLock()  # gc deletes objects on several threads; the publish deletes its lease within

    def publish_during_gc(self: Store, key: str) -> None:
        if key.startswith("leases/"):  # the publish's own lease, released on its commit thread (not gc's)
            original(self, key)
            return
        with lock:
            if key.startswith(during) and not published:
                published.append(pub.publish(states[VERSIONS]))  # a delta on 10, committed mid-gc
        original(self, key)

    if during == "packs/":
        first = collect(repo_url, keep_last=1, grace_seconds=0)  # packs of 1-9 recorded, not deleted
        assert first.packs_deleted == [] and first.pending
    monkeypatch.setattr(store_type, "delete", publish_during_gc)
    report = collect(repo_url, keep_last=1, grace_seconds=0)
    monkeypatch.undo()
    assert published == [11]
    # Committed before the objects were listed: seen and kept. After: not a candidate at all.
    assert report.versions_kept == ([10, 11] if during == "manifests/" else [10])
    assert (report.pending == []) == (during == "packs/")
    assert Repository(repo_url).versions() == [10, 11]
    assert_state(Subscriber(repo_url).pull(11), states[VERSIONS])
    assert verify_repository(repo_url).notes == []


def test_damaged_pending_record_restarts_the_grace_period(repo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pub = publish_all(repo_url, make_states(2))
    crash_a_publish(pub, make_states(3, seed=7)[2], monkeypatch)
    store = Repository(repo_url).store
    collect(repo_url, keep_last=1, grace_seconds=0)
    store.put(PENDING, b"{not json")
    r = collect(repo_url, keep_last=1, grace_seconds=0)
    assert r.pending and not r.packs_deleted and "unreadable" in r.notes[0]
    assert collect(repo_url, keep_last=1, grace_seconds=0).packs_deleted


def test_empty_repository_collects_orphans_of_a_crashed_first_publish(
    repo_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    crash_a_publish(Publisher(repo_url, config()), make_states(1)[0], monkeypatch)
    store = Repository(repo_url).store
    orphans = object_keys(store)
    assert orphans and Repository(repo_url).versions() == []
    assert collect(repo_url, keep_last=1, grace_seconds=0).pending == sorted(orphans)
    r = collect(repo_url, keep_last=1, grace_seconds=0)
    assert r.versions_kept == [] and set(r.packs_deleted) == orphans
    assert object_keys(store) == set()


# -- concurrent pulls ------------------------------------------------------------------------------


def test_pulls_of_retained_versions_run_safely_during_gc(repo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    states = make_states(VERSIONS)
    publish_all(repo_url, states)
    store_type = type(Repository(repo_url).store)
    original = store_type.delete

    def slow_delete(self: Store, key: str) -> None:
        time.sleep(0.002)  # stretch gc out so that pulls overlap every phase of it
        original(self, key)

    monkeypatch.setattr(store_type, "delete", slow_delete)
    done = threading.Event()
    errors: list[BaseException] = []
    pulls = [0]

    def puller(version: int) -> None:
        try:
            while not done.is_set():
                assert_state(Subscriber(repo_url, workers=2).pull(version), states[version - 1])
                pulls[0] += 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=puller, args=(v,)) for v in (9, 10, 5)]  # 9: chain 7, 8, 9
    for th in threads:
        th.start()
    try:
        report = collect(repo_url, keep_last=2, keep_every=5, grace_seconds=0)
    finally:
        done.set()
        for th in threads:
            th.join(30)
    assert not errors, errors
    assert pulls[0] >= 3
    assert report.versions_kept == [4, 5, 7, 8, 9, 10]


def test_pull_from_a_deleted_local_version_falls_back_to_the_snapshot(repo_url: str, tmp_path: Path) -> None:
    states = make_states(VERSIONS)
    publish_all(repo_url, states)
    out = tmp_path / "serving"
    dir_sub = Subscriber(repo_url)
    dir_sub.pull_to_dir(out, 8)
    mem_sub = Subscriber(repo_url)
    mem_sub.pull(8)
    collect(repo_url, keep_last=1, keep_every=9, grace_seconds=0)  # keeps 7, 8, 9 (chain of 9) and 10
    collect(repo_url, keep_last=1, grace_seconds=0)  # now 8 is gone too
    assert Repository(repo_url).versions() == [10]
    assert Subscriber(repo_url).pull_to_dir(out) == 10
    got = mem_sub.pull()
    assert_state(got, states[9])
    assert got.plan.base is None
    state = read_local_state(out)
    assert state is not None and state.version == 10


def test_pull_of_a_version_deleted_mid_pull_fails_cleanly(local_repo_url: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a retained version: gc may delete it under a pull. The pull fails with one error
    and the output directory keeps the version it held."""
    states = make_states(7)  # 7 is a snapshot: keep_last=1 drops 4, 5 and 6
    publish_all(local_repo_url, states)
    out = tmp_path / "serving"
    Subscriber(local_repo_url).pull_to_dir(out, 1)
    held = (out / "model.safetensors").read_bytes()
    store_type = type(Repository(local_repo_url).store)
    original = store_type.get
    ran: list[GcReport] = []

    def get_then_gc(
        self: Store, key: str, byte_range: tuple[int, int] | None = None, *, max_bytes: int | None = None
    ) -> bytes:
        data = original(self, key, byte_range, max_bytes=max_bytes)
        if key.startswith("packs/") and not ran:
            ran.append(collect(local_repo_url, keep_last=1, grace_seconds=0))
            ran.append(collect(local_repo_url, keep_last=1, grace_seconds=0))  # the freed packs go
        return data

    monkeypatch.setattr(store_type, "get", get_then_gc)
    with pytest.raises(DeltasyncError, match="pack is missing"):
        Subscriber(local_repo_url, workers=1).pull_to_dir(out, 5)
    assert ran and 5 in ran[0].versions_deleted and ran[1].packs_deleted
    assert (out / "model.safetensors").read_bytes() == held
    state = read_local_state(out)
    assert state is not None and state.version == 1


# -- arguments and the command line ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 0},
        {"keep_last": -1},
        {"keep_last": True},
        {"keep_last": 2.5},
        {"keep_last": 1, "keep_every": 0},
        {"keep_last": 1, "grace_seconds": -1},
        {"keep_last": 1, "grace_seconds": float("nan")},
        {"keep_last": 1, "grace_seconds": float("inf")},
    ],
)
def test_bad_arguments(memory_repo_url: str, kwargs: dict[str, Any]) -> None:
    publish_all(memory_repo_url, make_states(1))
    with pytest.raises(UsageError):
        collect(memory_repo_url, **kwargs)


def test_a_broken_retained_chain_stops_gc_before_it_deletes_anything(repo_url: str) -> None:
    publish_all(repo_url, make_states(VERSIONS))
    store = Repository(repo_url).store
    store.delete(manifest_key(7))  # the snapshot 8 and 9 stand on
    before = set(store.list())
    with pytest.raises(DeltasyncError, match="version 7 not found"):
        collect(repo_url, keep_last=2, grace_seconds=0)
    assert set(store.list()) == before


def test_missing_repository(tmp_path: Path) -> None:
    with pytest.raises(RepositoryNotFoundError):
        collect(str(tmp_path / "nowhere"), keep_last=1)


def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DELTASYNC_TEST_S3_URL"}
    return subprocess.run(
        [sys.executable, "-m", "deltasync.cli.main", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=120,
    )


def test_cli_gc(local_repo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    states = make_states(VERSIONS)
    pub = publish_all(local_repo_url, states)
    crash_a_publish(pub, make_states(2, seed=11)[1], monkeypatch)
    store = Repository(local_repo_url).store
    before = set(store.list())

    def ok(*args: str) -> str:
        p = run_cli("gc", "--repo", local_repo_url, *args)
        assert p.returncode == 0 and p.stderr == "", p.stderr
        lines = p.stdout.splitlines()
        assert len(lines) == 1, p.stdout
        return lines[0]

    line = ok("--keep-last", "2", "--keep-every", "5", "--dry-run")
    assert line.startswith("gc (dry run): kept 6 version(s), would delete 4 version(s)"), line
    assert set(store.list()) == before
    line = ok("--keep-last", "2", "--keep-every", "5", "--grace", "0")
    assert line.startswith("gc: kept 6 version(s), deleted 4 version(s)") and "wait for the grace period" in line
    line = ok("--keep-last", "2", "--keep-every", "5", "--grace", "0")
    assert "deleted 0 version(s)" in line and "wait for the grace period" not in line
    assert Repository(local_repo_url).versions() == [4, 5, 7, 8, 9, 10]
    assert verify_repository(local_repo_url).notes == []


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--keep-last", "0"], "keep_last must be an integer >= 1"),
        (["--keep-last", "2", "--keep-every", "0"], "keep_every must be an integer >= 1"),
        (["--keep-last", "2", "--grace", "-5"], "grace_seconds must be a finite number >= 0"),
        (["--keep-last", "2", "--repo-missing"], "repository not found"),
    ],
)
def test_cli_gc_errors_are_one_line(tmp_path: Path, args: list[str], match: str) -> None:
    repo = tmp_path / "repo"
    if "--repo-missing" in args:
        args = [a for a in args if a != "--repo-missing"]
        repo = tmp_path / "nowhere"
    else:
        publish_all(str(repo), make_states(1))
    p = run_cli("gc", "--repo", repo, *args)
    assert p.returncode != 0 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("deltasync: error: ") and match in lines[0], p.stderr



def test_the_pinned_version_and_its_chain_are_kept(repo_url: str) -> None:
    import torch

    import deltasync
    from deltasync.ops.retention import collect

    pub = deltasync.Publisher(repo_url, deltasync.PublisherConfig(snapshot_every=3, max_delta_fraction=10))
    state = {"w": torch.zeros(64)}
    for i in range(8):
        state["w"] = state["w"].clone()
        state["w"][i] = float(i + 1)
        pub.publish(state)
    repo = deltasync.Repository(repo_url)
    repo.pin(2)
    collect(repo_url, keep_last=1, grace_seconds=0)
    kept = deltasync.Repository(repo_url).versions()
    assert repo.manifest(2).pb.kind == 2  # a delta on snapshot v1
    assert 2 in kept and 1 in kept
    assert 8 in kept
    got = deltasync.Subscriber(repo_url).pull(2)["w"]
    assert got[:2].tolist() == [1.0, 2.0] and got[2:].abs().sum() == 0

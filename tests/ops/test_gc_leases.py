"""gc never deletes what a publish in flight may commit (issue 23, item 4): publish leases.

A publish writes ``leases/<id>.json`` before its first upload, renews it while it runs and
deletes it after its commit or abandon; gc deletes no pack or blob while a live lease
exists, whatever ``--grace`` says. Leases of killed publishers expire and gc removes them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint

from deltasync import Publisher, PublisherConfig, Repository, Subscriber
from deltasync.errors import StoreError
from deltasync.ops.retention import collect
from deltasync.ops.verify import verify_repository
from deltasync.relay.server import build_server
from deltasync.repo.leases import LEASE_SKEW, LEASES, MAX_LEASE_TTL, Lease, is_lease_key, read_leases
from deltasync.repo.repository import is_layout_key
from deltasync.storage import LocalStore, Store, WrappingStore
from deltasync.storage._grpc import GrpcStore

LAYOUT = (("model.embed.weight", (64, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))
CONFIG = PublisherConfig(workers=2, progress=False)
WRITE = "write-token-for-tests"


class GcBeforeTheManifest(WrappingStore):
    """A store where a gc with ``--grace 0`` runs twice (an orphan needs two runs) right before
    each manifest is written: between the publisher's last existence check and its commit."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.reports: list[Any] = []

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        if key.startswith("manifests/"):
            for _ in range(2):
                self.reports.append(collect(Repository(self.inner), keep_last=1, grace_seconds=0))
        self.inner.put(key, data, if_absent=if_absent)


def _leases(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "leases").glob("*")) if (root / "leases").is_dir() else []


def test_gc_with_grace_0_between_the_last_check_and_the_commit_deletes_nothing_it_needs(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    store = GcBeforeTheManifest(LocalStore(root))
    pub = Publisher(Repository(store), CONFIG)
    state = make_state(1, LAYOUT)
    pub.publish(state)
    state = step_state(state, seed=2)
    result = pub.publish(state)  # would fail "committed but packs/... was deleted by a concurrent gc" without a lease
    assert result.version == 2
    last = store.reports[-1]
    assert last.leases and not last.packs_deleted and not last.blobs_deleted  # it saw the publish in flight
    assert "publish(es) in flight" in last.summary()
    verify_repository(Repository(str(root)))
    assert _leases(root) == []  # deleted after the commit
    pulled = Subscriber(str(root)).pull(2)
    assert all(torch.equal(pulled[k].view(torch.uint8), state[k].view(torch.uint8)) for k in state)
    # Without publishes in flight gc works as before: the orphans it recorded go.
    collect(str(root), keep_last=1, grace_seconds=0)
    report = collect(str(root), keep_last=1, grace_seconds=0)
    assert not report.leases and report.versions_kept[-1] == 2


def test_a_live_lease_stops_every_pack_and_blob_deletion_whatever_the_grace(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    pub = Publisher(str(root), CONFIG)
    state = make_state(1, LAYOUT)
    for i in range(3):
        pub.publish_dir(write_checkpoint(tmp_path / f"c{i}", state, step=i))
        state = step_state(state, seed=i + 3)
    store = LocalStore(root)
    orphan = "packs/" + "ab" * 16 + ".pack"
    store.put(orphan, b"an upload not committed yet")
    with Lease(store, "a publish in flight"):
        for _ in range(2):
            report = collect(str(root), keep_last=1, grace_seconds=0)
        assert report.versions_deleted == [] and report.leases  # versions 1 and 2 went in the first run
        assert not report.packs_deleted and not report.blobs_deleted and orphan in report.pending
        assert store.exists(orphan)
    report = collect(str(root), keep_last=1, grace_seconds=0)  # the lease is gone: the orphans go now
    assert orphan in report.packs_deleted and not store.exists(orphan)
    verify_repository(Repository(str(root)))


def test_leases_of_killed_publishers_expire_and_gc_removes_them(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    Publisher(str(root), CONFIG).publish(make_state(1, LAYOUT))
    store = LocalStore(root)
    now = time.time()
    dead = f"{LEASES}{'0' * 32}.json"  # renewed last long ago: its publisher was killed
    store.put(dead, json.dumps({"format": 1, "started_unix": now - 9000, "expires_unix": now - LEASE_SKEW - 1}).encode())
    hostile = f"{LEASES}{'1' * 32}.json"  # claims to live for a year: not a lease of ours
    store.put(hostile, json.dumps({"format": 1, "started_unix": now, "expires_unix": now + 365 * 86400}).encode())
    junk = f"{LEASES}{'2' * 32}.json"
    store.put(junk, b"{not json")
    late = f"{LEASES}{'3' * 32}.json"  # expired, but within the clock-skew allowance: still honoured
    store.put(late, json.dumps({"format": 1, "started_unix": now - 900, "expires_unix": now - 10}).encode())
    found, bad = read_leases(store)
    assert {lease.key for lease in found if lease.live(now)} == {late} and bad == [junk]
    assert now + MAX_LEASE_TTL < now + 365 * 86400
    orphan = "blobs/" + "cd" * 16
    store.put(orphan, b"left by a killed publisher")
    report = collect(str(root), keep_last=1, grace_seconds=0)
    assert report.leases == [late] and sorted(report.leases_removed) == sorted([dead, hostile, junk])
    assert not store.exists(dead) and not store.exists(hostile) and store.exists(late)
    store.delete(late)
    collect(str(root), keep_last=1, grace_seconds=0)
    assert not store.exists(orphan)


def test_a_lease_is_renewed_while_its_publish_runs_and_removed_after_an_abandon(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "repo")
    with Lease(store, "slow publish", ttl=0.2) as lease:
        first = json.loads(store.get(lease.key))
        time.sleep(0.3)
        again = json.loads(store.get(lease.key))
        assert again["expires_unix"] > first["expires_unix"] and again["started_unix"] == first["started_unix"]
    assert not store.exists(lease.key)
    # A publish that fails after its uploads (its manifest cannot be written) leaves no lease behind.

    class NoCommit(WrappingStore):
        def _put(self, k: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
            if k.startswith("manifests/"):
                raise StoreError("simulated: the commit fails")
            self.inner.put(k, data, if_absent=if_absent)

    with pytest.raises(StoreError, match="the commit fails"):
        Publisher(Repository(NoCommit(store)), CONFIG).publish(make_state(1, LAYOUT))
    assert list(store.list(LEASES)) == []  # the lease goes with the failed publish; gc may collect its packs


def test_a_lease_deleted_by_the_relay_and_renewed_since_is_deleted_again(tmp_path: Path) -> None:
    # A relay committing the version deletes the lease (relay/uploads.py, _commit_here); the
    # publisher then only stops renewing (Lease.forget). A renewal that ended after it asked
    # may have written the lease again behind that deletion: forget deletes it then.
    store = LocalStore(tmp_path / "repo")
    with Lease(store, "a publish", ttl=0.2) as lease:
        asked = lease.renewals
        store.delete(lease.key)  # the relay's deletion
        deadline = time.monotonic() + 10
        while lease.renewals == asked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.exists(lease.key)  # written again by the renewal
        lease.forget(asked)
        assert not store.exists(lease.key)
    with Lease(store, "a publish", ttl=600) as lease:
        asked = lease.renewals
        store.delete(lease.key)
        store.put(lease.key, b"{}")  # (what no renewal wrote: forget leaves it to the relay)
        lease.forget(asked)
        assert store.exists(lease.key)
    store.delete(lease.key)


def test_a_publish_through_a_writable_relay_writes_and_removes_its_lease(tmp_path: Path) -> None:
    key = f"{LEASES}{'a' * 32}.json"
    assert is_lease_key(key) and is_layout_key(key) and not is_layout_key(f"{LEASES}x.json")
    origin = LocalStore(tmp_path / "origin")
    seen: list[str] = []

    class Watching(WrappingStore):
        def _put(self, k: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
            seen.append(k)
            self.inner.put(k, data, if_absent=if_absent)

    server = build_server(Watching(origin), "127.0.0.1:0", poll_interval=0.05, accept_writes=True,
                          write_token=WRITE).start()
    try:
        remote = GrpcStore(server.url, write_token=WRITE)
        pub = Publisher(Repository(remote), CONFIG)
        state = make_state(1, LAYOUT)
        ckpt = write_checkpoint(tmp_path / "c1", state, step=1)
        assert pub.publish_dir(ckpt).version == 1
        leases = [k for k in seen if k.startswith(LEASES)]
        assert leases and seen.index(leases[0]) < min(i for i, k in enumerate(seen) if k.startswith(("packs/", "blobs/")))
        assert list(origin.list(LEASES)) == []
        out = tmp_path / "out"
        Subscriber(str(tmp_path / "origin")).pull_to_dir(out)
        assert tree_digests(out) == tree_digests(ckpt)
    finally:
        server.stop(grace=0)


def test_a_publish_whose_lease_cannot_be_written_uploads_nothing(tmp_path: Path) -> None:
    """A lease that cannot be written fails the publish before anything is uploaded."""

    class NoLeases(WrappingStore):
        def _put(self, k: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
            if k.startswith(LEASES):
                raise StoreError("simulated: leases/ not writable")
            self.inner.put(k, data, if_absent=if_absent)

    root = tmp_path / "repo"
    with pytest.raises(StoreError, match="leases/ not writable"):
        Publisher(Repository(NoLeases(LocalStore(root))), CONFIG).publish(make_state(1, LAYOUT))
    assert not list(LocalStore(root).list("packs/")) and not list(LocalStore(root).list("manifests/"))

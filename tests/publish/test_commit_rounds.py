"""A commit's history parent, its after-commit work and its round trips (review of issue 30/33).

* A version whose newest predecessor is deleted between the listing and the read of its
  manifest (a concurrent gc) still follows it, through gc's history record; with no record,
  the commit fails with nothing visible rather than linking past it (a fork to every
  follower holding it).
* The after-commit work is given per commit: two threads committing through one Repository
  each run their own.
* A publish of the version after the latest reuses round 1's listing for the history parent:
  no listing between the pre-commit check and the manifest put (docs/DESIGN.md, the commit
  order's round trips), counted on a real LocalStore.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state, step_state
from store_helpers import RequestLog

from deltasync import Publisher, PublisherConfig, Repository
from deltasync.errors import StoreError
from deltasync.format.manifest import MAX_MANIFEST_BYTES, manifest_key
from deltasync.repo.history import extends, history_key, record
from deltasync.storage import LocalStore, Store, WrappingStore
from deltasync.v1 import manifest_pb2 as pb

LAYOUT = (("model.embed.weight", (64, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))
CONFIG = PublisherConfig(workers=2, progress=False)


def _published(store: Store, n: int) -> Publisher:
    pub = Publisher(Repository(store), CONFIG)
    state = make_state(1, LAYOUT)
    for i in range(n):
        state = step_state(state, seed=10 + i)
        pub.publish(state)
    return pub


def _next_manifest(store: Store, version: int) -> pb.Manifest:
    """Version ``version``: the newest committed one's content under a new id, its history unset."""
    newest = max(v for v in Repository(store).versions())
    m = pb.Manifest.FromString(store.get(manifest_key(newest), max_bytes=MAX_MANIFEST_BYTES))
    m.version = version
    if m.kind == pb.SNAPSHOT:
        m.snapshot = version
    for field in ("history_parent", "history_parent_digest", "history_digest", "manifest_digest", "repository_id"):
        m.ClearField(field)
    return m


class DeletedAfterListing(WrappingStore):
    """A store where, right after the first listing of ``manifests/`` once armed, the newest
    version is deleted: with gc's history record of it first (as gc does), or without one."""

    def __init__(self, inner: Store, *, with_record: bool) -> None:
        super().__init__(inner)
        self.with_record = with_record
        self.armed = False
        self.deleted: int | None = None

    def _list(self, prefix: str) -> Iterator[str]:
        keys = list(self.inner.list(prefix))
        if self.armed and prefix == "manifests/" and keys:
            self.armed = False
            newest = keys[-1]
            raw = self.inner.get(newest, max_bytes=MAX_MANIFEST_BYTES)
            m = pb.Manifest.FromString(raw)
            body = record(m)
            if self.with_record and body is not None:
                self.inner.put(history_key(m.version), body)
            self.inner.delete(newest)
            self.deleted = m.version
        return iter(keys)


def test_a_newest_version_deleted_between_listing_and_read_is_followed_through_gc_record(tmp_path: Path) -> None:
    store = DeletedAfterListing(LocalStore(tmp_path / "repo"), with_record=True)
    _published(store, 2)
    held = Repository(store).manifest(2).pb.history_digest  # what a follower holding version 2 records
    manifest = _next_manifest(store, 3)
    store.armed = True
    info = Repository(store).commit(manifest)  # a fresh Repository: nothing cached
    assert store.deleted == 2
    assert info.pb.history_parent == 2 and info.pb.history_parent_digest == held
    # The follower holding version 2 sees version 3 extend it (through gc's record), not a fork.
    assert extends(store, 2, held, Repository(store).manifest(3)) is True


def test_a_newest_version_deleted_without_a_record_fails_the_commit_with_nothing_visible(tmp_path: Path) -> None:
    store = DeletedAfterListing(LocalStore(tmp_path / "repo"), with_record=False)
    _published(store, 2)
    manifest = _next_manifest(store, 3)
    store.armed = True
    with pytest.raises(StoreError, match=r"version 3 not committed: version 2, the newest before it, was deleted"):
        Repository(store).commit(manifest)
    assert Repository(store).versions() == [1]


def test_the_known_latest_deleted_before_the_commit_is_followed_through_gc_record(tmp_path: Path) -> None:
    store = DeletedAfterListing(LocalStore(tmp_path / "repo"), with_record=True)
    _published(store, 2)
    held = Repository(store).manifest(2).pb.history_digest
    manifest = _next_manifest(store, 3)
    store.armed = True
    assert Repository(store).versions() == [1, 2]  # the caller's listing; version 2 is deleted right after
    info = Repository(store).commit(manifest, known_latest=(2,))
    assert info.pb.history_parent == 2 and info.pb.history_parent_digest == held


class ManifestPutsTogether(WrappingStore):
    """Holds each manifest put until ``parties`` commits are at that point (all in flight)."""

    def __init__(self, inner: Store, parties: int) -> None:
        super().__init__(inner)
        self.barrier = threading.Barrier(parties, timeout=30)

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        if key.startswith("manifests/"):
            self.barrier.wait()
        self.inner.put(key, data, if_absent=if_absent)


def test_two_threads_committing_through_one_repository_each_run_their_own_after_commit_work(tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "repo")
    _published(local, 1)
    store = ManifestPutsTogether(local, 2)
    repo = Repository(store)
    manifests = {v: _next_manifest(local, v) for v in (2, 3)}
    ran: dict[int, list[int]] = {2: [], 3: []}
    errors: list[BaseException] = []

    def committing(v: int) -> None:
        try:
            repo.commit(manifests[v], alongside=[lambda: ran[v].append(threading.get_ident())])
        except BaseException as e:
            errors.append(e)

    threads = {v: threading.Thread(target=committing, args=(v,)) for v in manifests}
    for t in threads.values():
        t.start()
    for t in threads.values():
        t.join(timeout=60)
    assert not errors
    assert repo.versions() == [1, 2, 3]
    assert len(ran[2]) == 1 and len(ran[3]) == 1  # each commit ran its own work, once


def _first(log: list[tuple[str, str]], op: str, prefix: str) -> int:
    return next(i for i, (o, k) in enumerate(log) if o == op and k.startswith(prefix))


def test_a_publish_lists_the_manifests_once_before_encoding_and_once_after_the_commit(tmp_path: Path) -> None:
    store = RequestLog(LocalStore(tmp_path / "repo"))
    pub = Publisher(Repository(store), CONFIG)
    state = make_state(1, LAYOUT)
    pub.publish(state)
    pub.publish(step_state(state, seed=2))
    store.log.clear()
    assert pub.publish(step_state(state, seed=3)).version == 3
    log = store.log
    lists = [i for i, (op, k) in enumerate(log) if op == "list" and k == "manifests/"]
    commit = log.index(("put", manifest_key(3)))
    first_pack = _first(log, "put", "packs/")
    last_check = max(i for i, (op, k) in enumerate(log[:commit]) if op == "size")
    # Round 1 (with refs/latest and the lease; beside the encoding and its uploads, which
    # assume it finds the publisher's own last version), then round 4 (with the ref's
    # write): nothing between the last check before the commit and the manifest put.
    assert len(lists) == 2, log
    assert lists[0] < last_check and first_pack < last_check < commit < lists[1], log
    assert [k for op, k in log if op == "get" and k == "refs/latest"] == ["refs/latest"]
    assert _first(log, "get", "refs/latest") < last_check
    assert log[last_check + 1:commit] == [], log  # no request of its own before the commit
    info = Repository(store.inner).manifest(3)
    assert info.pb.history_parent == 2
    assert info.pb.history_parent_digest == Repository(store.inner).manifest(2).pb.history_digest


def test_a_publish_of_an_id_beyond_the_next_lists_again_for_its_history_parent(tmp_path: Path) -> None:
    store = RequestLog(LocalStore(tmp_path / "repo"))
    pub = Publisher(Repository(store), CONFIG)
    state = make_state(1, LAYOUT)
    pub.publish(state)
    store.log.clear()
    assert pub.publish(step_state(state, seed=2), version=5).version == 5
    lists = [i for i, (op, k) in enumerate(store.log) if op == "list" and k == "manifests/"]
    assert len(lists) == 3  # round 1, the history parent's listing, the ref's
    assert Repository(store.inner).manifest(5).pb.history_parent == 1


def test_a_distributed_publish_takes_the_same_rounds_as_a_publisher(tmp_path: Path) -> None:
    """Rank 0 of a (one-rank, gloo) group: the lease written beside round 1's reads, no listing
    between the last check and the manifest put, the lease released beside the ref's write."""
    import torch.distributed as dist

    from deltasync import DistributedPublisher

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        store = RequestLog(LocalStore(tmp_path / "repo"))
        pub = DistributedPublisher(Repository(store), CONFIG, timeout=60)
        state = make_state(1, LAYOUT)
        pub.publish(state)
        pub.publish(step_state(state, seed=2))
        store.log.clear()
        assert pub.publish(step_state(state, seed=3)).version == 3
    finally:
        dist.destroy_process_group()
    log = store.log
    lists = [i for i, (op, k) in enumerate(log) if op == "list" and k == "manifests/"]
    commit = log.index(("put", manifest_key(3)))
    first_pack = _first(log, "put", "packs/")
    lease_put = _first(log, "put", "leases/")
    lease_delete = _first(log, "delete", "leases/")
    last_check = max(i for i, (op, k) in enumerate(log[:commit]) if op == "size")
    assert len(lists) == 2, log  # round 1 (the latest, beside the lease's write), round 4 (beside the ref's)
    assert lists[0] < first_pack < last_check < commit < lists[1], log
    assert lease_put < first_pack and commit < lease_delete, log
    assert log[last_check + 1:commit] == [], log  # no request of its own before the commit
    assert Repository(store.inner).manifest(3).pb.history_parent == 2
    assert not list(store.inner.list("leases/"))

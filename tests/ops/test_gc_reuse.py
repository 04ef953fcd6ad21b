"""gc never deletes what a commit just used (issue 33, item 2).

A publish reuses packs and blobs that exist (content-addressed objects are uploaded once).
When the versions naming such objects are the ones a gc run deletes, the run must not delete
the objects at once: a publish that starts while the run deletes can pass its own checks and
commit, and then lose them. They wait out the grace from the moment they became unreferenced
(``gc/pending.json``), so a later run sees them named by the new version.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint

from deltasync import Publisher, PublisherConfig, Repository, Subscriber
from deltasync.ops.retention import PENDING, collect, recorded_unreferenced
from deltasync.ops.verify import verify_repository
from deltasync.storage import LocalStore, Store, WrappingStore

LAYOUT = (("model.embed.weight", (64, 32), torch.bfloat16), ("model.norm.bias", (32,), torch.float32))
CONFIG = PublisherConfig(workers=2, progress=False)


class PublishWhileGcDeletes(WrappingStore):
    """Runs ``action`` once, on gc's first delete of a pack or blob or its first write of its
    record: after gc decided what is unreferenced, before it acts on it. Every other delete
    waits meanwhile (gc deletes on many threads), which widens the window to a whole publish."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.action: Any = None
        self.fired = False
        self._lock = threading.RLock()

    def _hook(self, key: str) -> None:
        if not key.startswith(("packs/", "blobs/", PENDING)):
            return  # e.g. the publish's lease, released on its own commit thread: never waits here
        with self._lock:
            if self.action is not None and not self.fired and key.startswith(("packs/", "blobs/", PENDING)):
                self.fired = True
                self.action()

    def _delete(self, key: str) -> None:
        self._hook(key)
        self.inner.delete(key)

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        if key == PENDING:
            self._hook(key)
        self.inner.put(key, data, if_absent=if_absent)


def test_a_publish_reusing_the_objects_of_versions_gc_deletes_keeps_them(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    store = PublishWhileGcDeletes(LocalStore(root))
    first = make_state(1, LAYOUT)
    ckpt1 = write_checkpoint(tmp_path / "step-1", first, step=1)
    ckpt2 = write_checkpoint(tmp_path / "step-2", step_state(first, seed=2), step=2)
    Publisher(Repository(store), CONFIG).publish_dir(ckpt1)
    Publisher(Repository(store), CONFIG).publish_dir(ckpt2)
    v1 = Repository(store).manifest(1).pb
    v1_objects = {p.key for p in v1.packs}
    assert v1_objects

    # Training went back to step 1 (a rollback, or the same data again): a fresh publisher
    # writes version 3 as a snapshot of the same bytes, so its packs and blobs are version 1's.
    published: list[int] = []
    store.action = lambda: published.append(Publisher(Repository(store), CONFIG).publish_dir(ckpt1).version)
    report = collect(Repository(store), keep_last=1, grace_seconds=0)
    assert store.fired and published == [3]
    assert report.versions_deleted == [1]
    v3 = Repository(store).manifest(3).pb
    assert {p.key for p in v3.packs} == v1_objects  # the publish did reuse them

    # The version the publish committed is whole, now and after later runs (grace 0: the
    # objects' record is old enough, but version 3 names them).
    for _ in range(2):
        verify_repository(Repository(LocalStore(root)))
        out = tmp_path / "out"
        Subscriber(Repository(LocalStore(root))).pull_to_dir(out, 3)
        assert tree_digests(out) == tree_digests(ckpt1)
        collect(Repository(LocalStore(root)), keep_last=1, grace_seconds=0)
    assert v1_objects <= set(LocalStore(root).list("packs/"))
    assert report.packs_deleted == [] and report.blobs_deleted == []  # recorded, not deleted at once


def test_objects_of_deleted_versions_wait_out_the_grace_from_that_moment(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    state = make_state(1, LAYOUT)
    Publisher(str(root), CONFIG).publish_dir(write_checkpoint(tmp_path / "a", state, step=1))
    Publisher(str(root), CONFIG).publish_dir(write_checkpoint(tmp_path / "b", make_state(2, LAYOUT), step=2))
    repo = Repository(str(root))
    freed = {p.key for p in repo.manifest(1).pb.packs} - {p.key for p in repo.manifest(2).pb.packs}
    assert freed
    clock = [1000.0]

    def gc() -> Any:
        return collect(str(root), keep_last=1, grace_seconds=60, clock=lambda: clock[0])

    first = gc()
    assert first.versions_deleted == [1] and first.packs_deleted == [] and freed <= set(first.pending)
    assert freed <= recorded_unreferenced(repo.store)
    assert verify_repository(str(root)).notes == []  # recorded by gc: not reported as damage
    clock[0] += 59
    assert gc().packs_deleted == []  # not yet a grace period since they became unreferenced
    clock[0] += 2
    second = gc()
    assert set(second.packs_deleted) == freed and second.pending == []
    assert not freed & set(repo.store.list("packs/"))

"""Issue 30 item 2: a cluster relay learns of a new version from its upstream relay's Watch
with the copies of the refs, the marker and the squashes/ listing it needs to answer readers,
and warms the version's packs by the sizes the manifest names: for one new version it asks
across its link for the manifest and the packs only."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deltasync
from deltasync.relay import build_server
from deltasync.repo.repository import Repository
from deltasync.storage._grpc import GrpcStore

MiB = 1 << 20


def _state(seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {"w": torch.from_numpy(rng.integers(0, 1 << 15, 2 * MiB, dtype=np.int16)).view(torch.bfloat16)}


class Counted:
    """Wraps a GrpcStore's reads to record (operation, key)."""

    def __init__(self, store: GrpcStore) -> None:
        self.calls: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        for name in ("_get", "_size", "_list"):
            inner = getattr(store, name)

            def counted(*args: Any, _inner: Any = inner, _name: str = name, **kw: Any) -> Any:
                with self.lock:
                    self.calls.append((_name[1:], args[0]))
                return _inner(*args, **kw)

            setattr(store, name, counted)

    def take(self) -> list[tuple[str, str]]:
        with self.lock:
            out, self.calls = self.calls, []
        return out


@pytest.fixture
def tree(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, Counted, Any, Any]]:
    """A repository, a root relay over it, and a cluster relay over the root (``request.param``:
    its options), the cluster relay's reads of the root counted: (repo, counted, cluster, root)."""
    repo = tmp_path / "origin"
    Repository(str(repo)).create()
    top = build_server(str(repo), "127.0.0.1:0", tmp_path / "cache-root").start()
    upstream = GrpcStore(f"grpc://{top.address}")
    counted = Counted(upstream)
    cluster = build_server(upstream, "127.0.0.1:0", tmp_path / "cache-cluster", **request.param).start()
    try:
        yield repo, counted, cluster, top
    finally:
        cluster.stop(grace=0)
        top.stop(grace=0)


def _next_version(watch: Any, want: int) -> None:
    for version in watch:
        if version >= want:
            return


def _reader_reads(store: GrpcStore, version: int) -> None:
    """What an agent reads for a new version: its refs, the marker, the squashes, the manifest, its packs."""
    repo = Repository(store)
    repo.pinned()
    repo.latest_ref()
    repo.ensure_exists()
    repo.squashes()
    info = repo.manifest(version)
    time.sleep(0.2)  # an agent plans its reads meanwhile: the warmer's pack fetches are under way
    for p in info.pb.packs:
        assert len(store.get(p.key)) == p.size


@pytest.mark.parametrize("tree", [{"push_bytes": 0}], indirect=True)  # (pushed packs: test_relay_push.py)
def test_a_new_version_costs_the_cluster_relay_its_manifest_and_packs_only(tree: Any) -> None:
    repo, counted, cluster, _ = tree
    pub = deltasync.Publisher(str(repo), deltasync.PublisherConfig(progress=False))
    reader = GrpcStore(f"grpc://{cluster.address}")
    watch = reader.watch(0)
    try:
        pub.publish(_state(1))
        _next_version(watch, 1)
        _reader_reads(reader, 1)
        time.sleep(0.3)  # the warmer done
        counted.take()
        pub.publish(_state(2))
        _next_version(watch, 2)
        _reader_reads(reader, 2)
        time.sleep(0.3)
        calls = counted.take()
    finally:
        watch.close()
    asked = sorted({(op, key.split("/")[0]) for op, key in calls})
    # Before: the manifest, refs/pin, refs/latest, deltasync.json, the squashes/ listing and
    # each pack's size crossed the link, each its own round trip. Now the packs only: the
    # manifest came with the event (and was checked as it landed in the cache).
    assert asked == [("get", "packs")], calls
    assert cluster.metrics()["hinted"] >= 3


@pytest.mark.parametrize("tree", [{"hint_ttl": 0.0}], indirect=True)
def test_without_hints_the_reads_go_upstream_as_before(tree: Any) -> None:
    repo, counted, cluster, _ = tree
    pub = deltasync.Publisher(str(repo), deltasync.PublisherConfig(progress=False))
    reader = GrpcStore(f"grpc://{cluster.address}")
    watch = reader.watch(0)
    try:
        pub.publish(_state(1))
        _next_version(watch, 1)
        counted.take()
        _reader_reads(reader, 1)
        calls = counted.take()
    finally:
        watch.close()
    keys = {key for _, key in calls}
    assert {"refs/pin", "refs/latest", "deltasync.json", "squashes/"} <= keys, calls


@pytest.mark.parametrize("tree", [{}], indirect=True)
def test_a_pin_moved_is_served_from_the_upstream_once_the_hints_expire(tree: Any) -> None:
    repo, _, cluster, _ = tree
    cluster_cfg_ttl = 3.0
    pub = deltasync.Publisher(str(repo), deltasync.PublisherConfig(progress=False))
    reader = GrpcStore(f"grpc://{cluster.address}")
    watch = reader.watch(0)
    try:
        pub.publish(_state(1))
        _next_version(watch, 1)
        assert Repository(reader).pinned() is None
        Repository(str(repo)).pin(1)
        time.sleep(cluster_cfg_ttl + 0.2)
        assert Repository(reader).pinned() == 1
    finally:
        watch.close()


@pytest.mark.parametrize("tree", [{}], indirect=True)
def test_a_ref_read_naming_a_newer_version_starts_its_warming(tree: Any) -> None:
    # A polling reader learns of a version before any Watch event: its manifest and packs are
    # fetched from the moment the relay passes the ref on, the reader's reads joining them.
    repo, counted, cluster, _ = tree
    pub = deltasync.Publisher(str(repo), deltasync.PublisherConfig(progress=False))
    pub.publish(_state(1))
    reader = GrpcStore(f"grpc://{cluster.address}")
    assert Repository(reader).latest_ref() == 1  # nobody watches: no feed, no event
    deadline = time.monotonic() + 10
    while cluster.metrics()["warmed_versions"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cluster.metrics()["warmed_versions"] == 1
    calls = counted.take()
    assert any(op == "get" and k.startswith("packs/") for op, k in calls), calls
    # The packs by their manifest's sizes: no size request before their reads; at most one
    # beside them, on a thread of its own, timing the upstream's round trip (relay/gauge.py).
    assert sum(op == "size" for op, _ in calls) <= 1, calls

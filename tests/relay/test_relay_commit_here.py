"""A version committed at the writable relay, in its manifest's round trip (issue 30: the
publish's last round), on real relays over loopback.

* A publisher of an unsigned repository sends its manifest with ``commit_latest``: the relay
  writes it, points ``refs/latest`` at it, deletes the publish's lease and checks the packs
  again after the write. The publisher sends nothing after its manifest.
* The ref never goes back: a newer version listed at that moment gets the ref.
* A manifest the relay refuses (a pack it names missing) moves no ref and keeps the lease;
  a lease key that is not one is refused before anything is written.
* A pack deleted right as the manifest is written (a concurrent gc) comes back in the answer:
  the publish fails naming it, the version committed. A check the relay could not run is
  said so, and the publisher runs its own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import make_state, step_state
from test_relay_writes import (
    WRITE,
    StartRelay,
    _manifest,
    pack_key,
    start_relay as start_relay,  # the fixture
)

from deltasync import Publisher, PublisherConfig, Repository
from deltasync.errors import CommittedError, MissingReferencesError, StoreError, UsageError
from deltasync.format.manifest import manifest_key
from deltasync.relay.server import RelayServer
from deltasync.repo.repository import LATEST
from deltasync.storage import LocalStore, Store, WrappingStore
from deltasync.storage._grpc import GrpcStore
from deltasync.v1 import manifest_pb2 as manifest_pb

CONFIG = PublisherConfig(workers=2, progress=False)
LEASE = "leases/" + "ab" * 16 + ".json"


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float, str, str]]:
    """Every write, delete, existence check and listing a GrpcStore makes: (start, end, what, key)."""
    log: list[tuple[float, float, str, str]] = []
    for name in ("_write", "_delete", "_exists", "_list", "_size"):
        real = getattr(GrpcStore, name, None)
        if real is None:
            continue

        def logged(self: GrpcStore, key: str, *args: Any, _real: Any = real, _name: str = name) -> Any:
            start = time.monotonic()
            try:
                return _real(self, key, *args)
            finally:
                log.append((start, time.monotonic(), _name, key))

        monkeypatch.setattr(GrpcStore, name, logged)
    return log


@contextlib.contextmanager
def _first_version(origin: Store, start_relay: StartRelay) -> Iterator[tuple[RelayServer, GrpcStore, Publisher, Any]]:
    """A writable relay on ``origin``, a publisher through it, and the first version it published
    (the publisher has learnt from it that the relay commits): the relay, store, publisher, state."""
    relay = start_relay(origin)
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    try:
        pub = Publisher(Repository(store), CONFIG)
        state = make_state(1)
        pub.publish(state)
        yield relay, store, pub, state
    finally:
        store.close()


def test_a_publish_sends_nothing_after_its_manifest(tmp_path: Path, start_relay: StartRelay,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    origin = LocalStore(tmp_path / "origin")
    with _first_version(origin, start_relay) as (relay, store, pub, state):
        assert store.commits_refs
        log = _calls(monkeypatch)
        state = step_state(state, seed=2)
        assert pub.publish(state).version == 2
        manifest_done = next(end for _, end, what, key in log if what == "_write" and key == manifest_key(2))
        after = [(what, key) for start, _, what, key in log if start >= manifest_done]
        assert after == [], after
        assert origin.get(LATEST) == b"2\n"
        assert list(origin.list("leases/")) == []  # both leases deleted by the relay
        assert relay.metrics()["commits_here"] == 2


def test_the_ref_goes_to_a_newer_version_listed_and_the_lease_is_deleted(tmp_path: Path,
                                                                         start_relay: StartRelay) -> None:
    origin = LocalStore(tmp_path / "origin")
    relay = start_relay(origin)
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    try:
        store.put(LEASE, b"{}")
        assert store.commits_refs
        origin.put(manifest_key(2), _manifest(2))  # committed meanwhile by another publisher
        assert store.put_commit(manifest_key(1), _manifest(1), release=LEASE) == []
        assert origin.exists(manifest_key(1))
        assert origin.get(LATEST) == b"2\n"  # not back to 1
        assert not origin.exists(LEASE)
    finally:
        store.close()


def test_a_refused_manifest_moves_no_ref_and_keeps_the_lease(tmp_path: Path, start_relay: StartRelay) -> None:
    origin = LocalStore(tmp_path / "origin")
    relay = start_relay(origin)
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    try:
        store.put(LEASE, b"{}")
        origin.put(LATEST, b"1\n")
        missing = _manifest(2, packs=[manifest_pb.Pack(key=pack_key(b"never uploaded"), size=14)])
        with pytest.raises(MissingReferencesError):
            store.put_commit(manifest_key(2), missing, release=LEASE)
        assert not origin.exists(manifest_key(2))
        assert origin.get(LATEST) == b"1\n" and origin.exists(LEASE)
        with pytest.raises(UsageError, match="not a lease's key"):
            store.put_commit(manifest_key(3), _manifest(3), release="refs/pin")
        assert not origin.exists(manifest_key(3)) and origin.get(LATEST) == b"1\n"
        assert relay.metrics()["commits_here"] == 0
    finally:
        store.close()


class _AfterTheFirstVersion(WrappingStore):
    """The relay's repository: :meth:`written` is called once each version's manifest after
    the first is written."""

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        super()._put(key, data, if_absent)
        if key.startswith("manifests/") and key != manifest_key(1):
            self.written(manifest_pb.Manifest.FromString(bytes(data)))

    def written(self, manifest: manifest_pb.Manifest) -> None:
        raise NotImplementedError


class _GcAtTheCommit(_AfterTheFirstVersion):
    """As a manifest is written, a concurrent gc deletes a pack it names."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.deleted: list[str] = []

    def written(self, manifest: manifest_pb.Manifest) -> None:
        victim = manifest.packs[0].key
        self.inner.delete(victim)
        self.deleted.append(victim)


def test_a_pack_deleted_as_the_manifest_is_written_fails_the_publish_naming_it(tmp_path: Path,
                                                                               start_relay: StartRelay) -> None:
    origin = _GcAtTheCommit(LocalStore(tmp_path / "origin"))
    with _first_version(origin, start_relay) as (relay, _, pub, state):
        with pytest.raises(CommittedError, match="deleted by a concurrent gc") as caught:
            pub.publish(step_state(state, seed=2))
        assert origin.deleted and origin.deleted[0] in str(caught.value)
        assert origin.exists(manifest_key(2))  # committed: the error says so
        assert relay.metrics()["commits_here"] == 2


class _CheckFailsOnce(_AfterTheFirstVersion):
    """The first existence check of a pack after a version's manifest is written fails."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.armed = False

    def written(self, manifest: manifest_pb.Manifest) -> None:
        self.armed = True

    def _size(self, key: str) -> int:
        if self.armed and key.startswith("packs/"):
            self.armed = False
            raise StoreError("simulated: the repository failed the request")
        return super()._size(key)


def test_a_check_the_relay_could_not_run_is_run_by_the_publisher(tmp_path: Path, start_relay: StartRelay,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    origin = _CheckFailsOnce(LocalStore(tmp_path / "origin"))
    with _first_version(origin, start_relay) as (_, _, pub, state):
        log = _calls(monkeypatch)
        assert pub.publish(step_state(state, seed=2)).version == 2  # committed, checked by the publisher
        manifest_done = next(end for _, end, what, key in log if what == "_write" and key == manifest_key(2))
        checked = {key for start, _, what, key in log if start >= manifest_done and what == "_size"}
        named = {p.key for p in Repository(origin).manifest(2).pb.packs}
        assert named and checked >= named
        assert origin.get(LATEST) == b"2\n"

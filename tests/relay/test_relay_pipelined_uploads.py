"""Uploads pipelined on upload sessions, and the commit's round trips through a writable relay
(issue 30, the publish half), on real relays over loopback.

* Objects put from many threads at once pipeline on a relay's upload sessions (several wait
  for their answer on one call): every one lands bit-exact, and the relay's upload memory stays
  within its budget (the credit bounds what is on its way, not the number of objects).
* A relay says it checks what a manifest names (its packs and blobs, a delta's parent): a
  publisher then sends no check of its own before its commit; a pack deleted before that
  commit makes the relay refuse the manifest, and the publisher stores it again and commits.
* A publisher whose guess of the latest version (its own last one) is wrong, because another
  publisher committed meanwhile, removes what it uploaded and commits a snapshot on the latest.
* A relay that says it waits for the uploads it is receiving of what a manifest names gets the
  manifest while the last packs are still on their way: it checks once they are stored; one
  that fails makes the publish fail with nothing visible and the attempt's packs removed. A
  manifest whose pack has not begun is checked again when another upload being received ends:
  written when the pack came meanwhile, refused when it never came.
* A manifest whose header says its packs are on their way (the publisher's store has uploads in
  flight) waits for them, a bounded time and without its turn, to land in the repository, here
  or through another relay of the same repository: written once they have, refused if not.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_helpers import make_state, step_state
from store_helpers import RequestLog
from test_relay import wait_until
from test_relay_writes import (
    WRITE,
    StartRelay,
    _manifest,
    pack_key,
    start_relay as start_relay,  # the fixture
)

from deltasync import Publisher, PublisherConfig, Repository, Subscriber
from deltasync.errors import MissingReferencesError, ObjectExistsError
from deltasync.format.manifest import manifest_key, seal
from deltasync.relay.server import RelayServer
from deltasync.storage import LocalStore, Store, WrappingStore
from deltasync.storage._grpc import GrpcStore
from deltasync.storage._grpc_upload import UploadSession
from deltasync.storage.wire import CHUNK_BYTES, method_path
from deltasync.v1 import manifest_pb2 as manifest_pb

LAYOUT = (("model.embed.weight", (256, 256), torch.bfloat16), ("model.norm.bias", (256,), torch.float32))
CONFIG = PublisherConfig(workers=2, progress=False, pack_bytes=256 << 10)


@pytest.fixture
def relay_store(tmp_path: Path, start_relay: StartRelay) -> Iterator[tuple[GrpcStore, RelayServer, LocalStore]]:
    origin = LocalStore(tmp_path / "origin")
    relay = start_relay(origin, upload_buffer=8 * CHUNK_BYTES, upload_window=4 * CHUNK_BYTES)
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    yield store, relay, origin
    store.close()


def _bits(t: object) -> bytes:
    if isinstance(t, torch.Tensor):
        return t.contiguous().view(torch.uint8).numpy().tobytes()
    return np.asarray(t).tobytes()


def _put_on(session: UploadSession, name: str, data: bytes, outcomes: dict[str, object]) -> None:
    """Put ``data`` (a pack, conditionally) on ``session``; its outcome, or its error's code, in ``outcomes[name]``."""
    import grpc

    from deltasync.format.digest import digest
    from deltasync.v1 import relay_pb2 as pb

    header = pb.PutChunk(key=pack_key(data), total_bytes=len(data), if_absent=True, digest=digest(data))
    try:
        outcomes[name] = session.put(header, memoryview(data), 30)
    except grpc.RpcError as e:
        outcomes[name] = e.code()


def _assert_pulled(repo: str | Repository, version: int, state: dict[str, torch.Tensor]) -> None:
    got = Subscriber(repo, progress=False).pull(version)
    assert {k: _bits(v) for k, v in got.items()} == {k: _bits(v) for k, v in state.items()}


def _budget(relay: RelayServer) -> tuple[int, int, int]:
    assert relay._service is not None
    budget = relay._service.uploads.budget
    return budget.used, budget.peak, budget.limit


def test_objects_put_at_once_pipeline_on_sessions_within_the_budget_and_land_bit_exact(
        relay_store: tuple[GrpcStore, RelayServer, LocalStore]) -> None:
    store, relay, origin = relay_store
    # More objects at once than sessions per relay: some wait for their answer behind others
    # on one call. Sizes across the whole-in-header, in-memory and spooled paths.
    objects = [os.urandom(n) for n in (100, 200_000, 3 * CHUNK_BYTES + 1, 5 * CHUNK_BYTES + 3) * 4]
    threads = [threading.Thread(target=store.put, args=(pack_key(d), d), kwargs={"if_absent": True})
               for d in objects]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(origin.get(pack_key(d)) == d for d in objects)
    sessions = store._relays[0]._sessions
    assert 1 <= len(sessions) <= 4
    assert max(s.most_pending for s in sessions) > 1, "no object was pipelined behind another"
    _, peak, limit = _budget(relay)
    assert peak <= limit  # however many were on their way, the relay held at most its budget
    assert relay.metrics()["uploads"] == len(objects)
    store.close()


def test_a_relay_refuses_a_delta_manifest_whose_parent_is_missing(
        relay_store: tuple[GrpcStore, RelayServer, LocalStore]) -> None:
    store, _, origin = relay_store
    delta = manifest_pb.Manifest.FromString(_manifest(3))
    delta.kind, delta.parent, delta.has_parent, delta.snapshot = manifest_pb.DELTA, 2, True, 1
    delta.ClearField("manifest_digest")
    with pytest.raises(MissingReferencesError, match=r"manifests/00000000000000000002\.pb"):
        store.put(manifest_key(3), seal(delta), if_absent=True)
    assert not origin.exists(manifest_key(3))


def test_a_publish_through_a_checking_relay_sends_no_check_before_its_commit(
        tmp_path: Path, start_relay: StartRelay) -> None:
    relay = start_relay(LocalStore(tmp_path / "origin"))
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    client = RequestLog(store)  # what the publisher asks the relay
    pub = Publisher(Repository(client), CONFIG)
    state = make_state(1, LAYOUT)
    pub.publish(state)
    assert client.checks_references  # learnt from the pack uploads' sessions
    client.log.clear()
    state = step_state(state, seed=2)
    assert pub.publish(state).kind == "delta"
    log = client.log
    commit = log.index(("put", manifest_key(2)))
    packs = [i for i, (op, k) in enumerate(log) if op == "put" and k.startswith("packs/")]
    assert packs and max(packs) < commit
    assert [k for op, k in log[:commit] if op == "size"] == [], log  # the relay checks, beside its write
    assert [k for op, k in log[commit:] if op == "size"]  # the check after the commit stays
    store.close()
    _assert_pulled(str(tmp_path / "origin"), 2, state)


class DeletesAPackAtTheManifestCheck(WrappingStore):
    """A relay's upstream where, once armed, the first existence check of a pack (the relay's
    check of a manifest, right before writing it) finds it deleted, as a gc would."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.armed = False
        self.deleted: list[str] = []

    def exists(self, key: str) -> bool:
        if self.armed and key.startswith("packs/"):
            self.armed = False
            self.inner.delete(key)
            self.deleted.append(key)
        return self.inner.exists(key)


def test_a_pack_deleted_before_the_commit_is_refused_by_the_relay_stored_again_and_committed(
        tmp_path: Path, start_relay: StartRelay) -> None:
    upstream = DeletesAPackAtTheManifestCheck(LocalStore(tmp_path / "origin"))
    relay = start_relay(upstream)
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    pub = Publisher(Repository(store), CONFIG)
    state = make_state(1, LAYOUT)
    pub.publish(state)
    upstream.armed = True
    state = step_state(state, seed=2)
    result = pub.publish(state)
    assert upstream.deleted, "no pack was deleted: the test did not test a deletion"
    assert result.version == 2
    store.close()
    repo = Repository(LocalStore(tmp_path / "origin"))
    assert all(repo.store.exists(p.key) for p in repo.manifest(2).pb.packs)
    _assert_pulled(repo, 2, state)


def test_a_wrong_guess_of_the_latest_version_commits_a_snapshot_and_leaves_no_packs_behind(
        tmp_path: Path, start_relay: StartRelay) -> None:
    origin = LocalStore(tmp_path / "origin")
    relay = start_relay(origin)
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    ours = Publisher(Repository(store), CONFIG)
    state = make_state(1, LAYOUT)
    ours.publish(state)
    Publisher(Repository(GrpcStore(relay.url, write_token=WRITE, timeout=30)), CONFIG).publish(
        step_state(state, seed=7))  # another publisher's version 2
    state = step_state(state, seed=3)
    result = ours.publish(state)  # encoded against version 1 beside round 1, which finds 2
    assert (result.version, result.kind) == (3, "snapshot")
    store.close()
    repo = Repository(origin)
    named = {p.key for v in repo.versions() for p in repo.manifest(v).pb.packs}
    assert set(origin.list("packs/")) == named  # the delta encoded against 1 was removed
    _assert_pulled(repo, 3, state)


def test_a_manifest_whose_packs_are_on_their_way_goes_on_a_session_of_manifests_only(
        relay_store: tuple[GrpcStore, RelayServer, LocalStore]) -> None:
    # A relay may hold such a manifest until its packs land; a pack queued behind it on its
    # session would never begin. So it goes on a session no pack is given, idle when it is
    # taken (reused once answered), and never one of those the packs share.
    from deltasync.format.digest import digest
    from deltasync.storage._grpc import SESSIONS_PER_RELAY
    from deltasync.v1 import relay_pb2 as pb

    store, _, origin = relay_store
    relay = store._relays[0]
    committing = relay.take_session(referring=True)
    assert committing not in relay._sessions
    assert relay.take_session(referring=True) is not committing  # taken: a second manifest gets another
    assert all(relay.take_session() is not committing for _ in range(2 * SESSIONS_PER_RELAY))
    data = os.urandom(100)
    header = pb.PutChunk(key=pack_key(data), total_bytes=len(data), digest=digest(data), data=data)
    assert committing.put(header, memoryview(data), 30)
    assert origin.get(pack_key(data)) == data
    assert relay.take_session(referring=True) is committing  # answered: idle again


def test_a_refused_object_fails_alone_and_those_pipelined_behind_it_are_sent_again(
        relay_store: tuple[GrpcStore, RelayServer, LocalStore]) -> None:
    # The relay ends a session on the object it refuses (here a conditional put of a key it
    # holds): that object gets the refusal; the one pipelined behind it was not written, and is
    # answered "not written" (sent again on another call), not with the other's error.
    import grpc

    store, _, origin = relay_store
    held, new = os.urandom(3 * CHUNK_BYTES), os.urandom(3 * CHUNK_BYTES + 1)
    store.put(pack_key(held), held, if_absent=True)
    session = store._relays[0].take_session()
    outcomes: dict[str, object] = {}
    before = session._queued  # the session the put above used, when it is taken again
    first = threading.Thread(target=_put_on, args=(session, "held", held, outcomes))
    first.start()
    wait_until(lambda: session._queued == before + 1)
    second = threading.Thread(target=_put_on, args=(session, "new", new, outcomes))
    second.start()
    first.join()
    second.join()
    assert outcomes == {"held": grpc.StatusCode.ALREADY_EXISTS, "new": False}, outcomes
    assert not origin.exists(pack_key(new))
    store.put(pack_key(new), new, if_absent=True)  # on a new session
    assert origin.get(pack_key(new)) == new


class _GatedStore(LocalStore):
    """A local repository whose pack writes wait for ``gate`` (the relay stores slowly)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        if key.startswith("packs/"):
            assert self.gate.wait(30), "the test never opened the gate"
        super().put(key, data, if_absent=if_absent)


def test_objects_a_session_closed_here_left_unanswered_may_be_stored_and_fail_over(
        tmp_path: Path, start_relay: StartRelay) -> None:
    # This side ending a session (another object's deadline, the store closing) does not know
    # what the relay stored: every object still waiting is failed over (UNAVAILABLE), never
    # answered "not written" (a manifest resent after that would be refused as existing, and
    # a committed version reported failed). Through the store, each then ends stored, once.
    import grpc

    origin = _GatedStore(tmp_path / "origin")
    relay = start_relay(origin)
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    try:
        first, second = os.urandom(2 * CHUNK_BYTES), os.urandom(2 * CHUNK_BYTES + 1)
        session = store._relays[0].take_session()
        outcomes: dict[str, object] = {}
        threads = [threading.Thread(target=_put_on, args=(session, name, data, outcomes))
                   for name, data in (("first", first), ("second", second))]
        for queued, t in enumerate(threads, start=1):
            t.start()
            wait_until(lambda: session._queued == queued)  # noqa: B023 (waited for here, in this turn)
        session.close()
        for t in threads:
            t.join()
        assert outcomes == {"first": grpc.StatusCode.UNAVAILABLE, "second": grpc.StatusCode.UNAVAILABLE}, outcomes
        origin.gate.set()
        for data in (first, second):
            with contextlib.suppress(ObjectExistsError):  # the closed call's write landed after all
                store.put(pack_key(data), data, if_absent=True)
            assert origin.get(pack_key(data)) == data
    finally:
        origin.gate.set()
        store.close()


def test_sessions_the_relay_ends_leave_no_thread_behind(
        relay_store: tuple[GrpcStore, RelayServer, LocalStore], monkeypatch: pytest.MonkeyPatch) -> None:
    # A session the relay ends (idle) lets grpc's thread reading its requests go: publishing
    # every few minutes must not gather one blocked thread per session and version.
    import sys
    import time
    import traceback

    import deltasync.relay.service as service

    monkeypatch.setattr(service, "SESSION_IDLE_SECONDS", 0.3)
    store, _, origin = relay_store

    def blocked() -> int:  # threads inside UploadSession._requests (waiting for its next object)
        return sum(any(f.f_code.co_name == "_requests" and f.f_code.co_filename.endswith("_grpc_upload.py")
                       for f, _ in traceback.walk_stack(frame))
                   for frame in sys._current_frames().values())

    for round_ in range(3):
        datas = [os.urandom(CHUNK_BYTES) + bytes([round_, i]) for i in range(4)]
        puts = [threading.Thread(target=store.put, args=(pack_key(d), d)) for d in datas]
        for t in puts:
            t.start()
        for t in puts:
            t.join()
        assert all(origin.get(pack_key(d)) == d for d in datas)
        wait_until(lambda: not any(s.alive for s in store._relays[0]._sessions))  # the relay ended them
        time.sleep(0.2)
        wait_until(lambda: blocked() == 0)


class SlowPackWrites(WrappingStore):
    """A relay's upstream whose writes of packs take ``delay`` seconds (a slow disk, a far
    bucket), failing ``failures`` times for keys in ``failing`` (forever with -1)."""

    def __init__(self, inner: Store, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay
        self.failing: set[str] = set()
        self.failures = 0
        self.lock = threading.Lock()

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        if key.startswith("packs/"):
            import time

            time.sleep(self.delay)
            with self.lock:
                fail = key in self.failing and self.failures != 0
                self.failures -= fail
            if fail:
                raise OSError(f"the disk refused {key}")
        self.inner.put(key, data, if_absent=if_absent)


def _service(relay: RelayServer) -> object:
    assert relay._service is not None
    return relay._service


def test_the_manifest_goes_while_the_last_packs_are_stored_and_the_relay_checks_after_them(
        tmp_path: Path, start_relay: StartRelay) -> None:
    origin = LocalStore(tmp_path / "origin")
    relay = start_relay(SlowPackWrites(origin, 0.3))
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    pub = Publisher(Repository(store), CONFIG)
    state = make_state(1, LAYOUT)
    pub.publish(state)
    assert store.orders_references  # learnt from the pack uploads' sessions
    waited = relay.metrics()["manifest_waits"]
    state = step_state(state, seed=2)
    assert pub.publish(state).kind == "delta"
    # The manifest came while a pack it names was being written (0.3 s each): the relay
    # waited for that upload before its check, instead of the publisher waiting for answers.
    assert relay.metrics()["manifest_waits"] > waited
    store.close()
    _assert_pulled(str(tmp_path / "origin"), 2, state)


@pytest.mark.parametrize("failures", [1, -1])
def test_a_pack_failing_while_its_manifest_waits_is_sent_again_or_fails_the_publish(
        tmp_path: Path, start_relay: StartRelay, failures: int) -> None:
    origin = LocalStore(tmp_path / "origin")
    upstream = SlowPackWrites(origin, 0.0)
    relay = start_relay(upstream)
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    pub = Publisher(Repository(store), CONFIG)
    state = make_state(1, LAYOUT)
    pub.publish(state)
    before = set(origin.list("packs/"))
    upstream.delay, upstream.failures = 0.3, failures
    # Every pack of the next version fails to be written (once, or always).
    original_put = upstream._put

    def failing_put(key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        if key.startswith("packs/") and key not in before:
            with upstream.lock:
                upstream.failing.add(key)
        original_put(key, data, if_absent)

    upstream._put = failing_put  # type: ignore[method-assign]
    state = step_state(state, seed=2)
    if failures == 1:  # the client sends the refused pack again; the manifest goes again after it
        assert pub.publish(state).version == 2
        store.close()
        _assert_pulled(str(tmp_path / "origin"), 2, state)
        return
    with pytest.raises(Exception, match="refused"):
        pub.publish(state)
    store.close()
    assert not origin.exists(manifest_key(2))  # nothing visible
    assert set(origin.list("packs/")) == before  # the attempt's packs removed


def _putting(store: Store, key: str, data: bytes) -> tuple[threading.Thread, list[BaseException | None]]:
    """A conditional put of ``data`` started on a thread, and where its outcome goes (None: stored)."""
    outcome: list[BaseException | None] = []

    def put() -> None:
        try:
            store.put(key, data, if_absent=True)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    putter = threading.Thread(target=put)
    putter.start()
    return putter, outcome


@pytest.mark.parametrize("pack_comes", [True, False])
def test_a_manifest_is_checked_again_when_another_upload_ends_and_refused_if_its_pack_never_came(
        tmp_path: Path, start_relay: StartRelay, pack_comes: bool) -> None:
    # The manifest comes while another upload is being received and its own pack has not begun
    # (queued behind that one on its session, say): the relay checks it again once that upload
    # ends, so it is written when its pack came meanwhile, and refused when it did not.
    from deltasync.errors import StoreError

    origin = _GatedStore(tmp_path / "origin")
    relay = start_relay(origin)
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    # The manifest from a store of its own, which has nothing else on its way: its header does
    # not say its packs are (references_pending; the next test has that).
    committer = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    try:
        other, data = os.urandom(CHUNK_BYTES), b"the manifest's pack"
        key = manifest_key(1)
        manifest = _manifest(1, packs=[manifest_pb.Pack(key=pack_key(data), size=len(data))])
        held = threading.Thread(target=store.put, args=(pack_key(other), other))
        held.start()  # its write waits for the gate: the relay is receiving it meanwhile
        wait_until(lambda: pack_key(other) in _service(relay).uploads.receiving)  # type: ignore[attr-defined]
        putter, outcome = _putting(committer, key, manifest)
        wait_until(lambda: relay.metrics()["manifest_rechecks"] == 1)  # missing; waiting for the other to end
        assert not origin.exists(key) and not outcome
        pack = threading.Thread(target=store.put, args=(pack_key(data), data), kwargs={"if_absent": True})
        if pack_comes:  # it begins while the manifest waits, its write held at the gate too
            pack.start()
            wait_until(lambda: pack_key(data) in _service(relay).uploads.receiving)  # type: ignore[attr-defined]
        origin.gate.set()
        held.join()
        putter.join()
        if pack_comes:
            pack.join()
            assert outcome == [None], outcome
            assert origin.get(key) == manifest
        else:
            assert isinstance(outcome[0], StoreError) and "names objects the repository lacks" in str(outcome[0])
            assert not origin.exists(key)
            assert relay.metrics()["manifest_rechecks"] == 1  # once: nothing else was being received
        assert relay.metrics()["manifest_pending_waits"] == 0
    finally:
        origin.gate.set()
        store.close()
        committer.close()


@pytest.mark.parametrize("pack_comes", [True, False])
def test_a_manifest_whose_packs_are_on_their_way_waits_for_them_through_another_relay(
        tmp_path: Path, start_relay: StartRelay, monkeypatch: pytest.MonkeyPatch, pack_comes: bool) -> None:
    # Two writable relays of one repository; a publisher's store names both. Its pack goes to
    # one (its write held there), so its manifest goes to the other, saying its packs are on
    # their way: that relay waits for the pack to land in the repository through the first
    # (written then), or refuses the manifest once it has waited its bound (the pack never
    # came). While it waits it holds no turn: with one place, another upload gets through it.
    from deltasync.errors import StoreError
    from deltasync.relay import uploads

    monkeypatch.setattr(uploads, "MANIFEST_WAIT_SECONDS", 30.0 if pack_comes else 1.0)
    origin = _GatedStore(tmp_path / "origin")
    relays = [start_relay(origin, max_uploads=1), start_relay(origin, max_uploads=1)]
    store = GrpcStore(f"grpc://{relays[0].address},{relays[1].address}", write_token=WRITE, timeout=30)
    try:
        data = os.urandom(CHUNK_BYTES)
        named = data if pack_comes else b"a pack never uploaded"
        key = manifest_key(1)
        manifest = _manifest(1, packs=[manifest_pb.Pack(key=pack_key(named), size=len(named))])
        pack = threading.Thread(target=store.put, args=(pack_key(data), data), kwargs={"if_absent": True})
        pack.start()  # its write waits for the gate
        wait_until(lambda: any(pack_key(data) in _service(r).uploads.receiving for r in relays))  # type: ignore[attr-defined]
        there = next(r for r in relays if pack_key(data) in _service(r).uploads.receiving)  # type: ignore[attr-defined]
        here = relays[1 - relays.index(there)]
        putter, outcome = _putting(store, key, manifest)
        wait_until(lambda: here.metrics()["manifest_pending_waits"] == 1)
        # Its turn is lent while it waits: another client's write gets the relay's one place.
        other = GrpcStore(here.url, write_token=WRITE, timeout=30)
        try:
            other.put("refs/pin", b"7")
        finally:
            other.close()
        assert origin.get("refs/pin") == b"7"
        if pack_comes:
            assert not outcome and not origin.exists(key)
            origin.gate.set()  # the pack lands through the other relay
            putter.join()
            pack.join()
            assert outcome == [None], outcome
            assert origin.get(key) == manifest
        else:
            putter.join()  # refused after its wait, the pack it names never having come
            assert isinstance(outcome[0], StoreError) and "names objects the repository lacks" in str(outcome[0])
            assert not origin.exists(key)
            origin.gate.set()
            pack.join()
        assert here.metrics()["manifest_rechecks"] == 0 and there.metrics()["manifest_pending_waits"] == 0
    finally:
        origin.gate.set()
        store.close()


def test_manifests_being_received_are_not_waited_for(tmp_path: Path, start_relay: StartRelay) -> None:
    # Another manifest still on its way (its client stalled mid-upload) is no reason to check a
    # manifest missing a pack again: only packs and blobs are waited for, so two manifests
    # cannot wait for each other. The complete one is refused at once.
    import grpc

    from deltasync.errors import StoreError
    from deltasync.v1 import relay_pb2 as pb

    origin = LocalStore(tmp_path / "origin")
    relay = start_relay(origin)
    store = GrpcStore(relay.url, write_token=WRITE, timeout=30)
    channel = grpc.insecure_channel(relay.address)
    put = channel.stream_unary(method_path("Put"), request_serializer=pb.PutChunk.SerializeToString,
                               response_deserializer=pb.PutResponse.FromString)
    stalled = _manifest(2, packs=[manifest_pb.Pack(key=pack_key(b"other"), size=5)])
    go = threading.Event()

    def requests() -> Iterator[pb.PutChunk]:
        yield pb.PutChunk(key=manifest_key(2), total_bytes=len(stalled), data=stalled[:10])
        go.wait(30)
        yield pb.PutChunk(data=stalled[10:])

    call = put.future(requests(), metadata=[("authorization", f"Bearer {WRITE}")], timeout=60)
    try:
        wait_until(lambda: manifest_key(2) in _service(relay).uploads.receiving)  # type: ignore[attr-defined]
        manifest = _manifest(1, packs=[manifest_pb.Pack(key=pack_key(b"missing"), size=7)])
        with pytest.raises(StoreError, match="names objects the repository lacks"):
            store.put(manifest_key(1), manifest, if_absent=True)
        assert relay.metrics()["manifest_rechecks"] == 0
        assert manifest_key(2) in _service(relay).uploads.receiving  # type: ignore[attr-defined]  # still stalled
    finally:
        go.set()
        with contextlib.suppress(grpc.RpcError):
            call.result()  # refused in its turn: its pack is missing too
        channel.close()
        store.close()
    assert not origin.exists(manifest_key(1)) and not origin.exists(manifest_key(2))

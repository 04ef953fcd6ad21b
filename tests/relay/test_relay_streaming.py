"""The relay's overlapped stages (issue 21, item 4): objects served while they are still being
fetched from the upstream, and new versions warmed into the cache before any agent asks.

Real relays on 127.0.0.1 in front of a local repository whose reads of the tail of one object
wait on an event (``Gate``): what a reader got before the tail was let through is what the
relay streamed while fetching. No timings: events and the relays' counters.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from test_relay import StartRelay, Watcher, make_state, published, raw, settle, start_relay, step, wait_until

from deltasync import Subscriber
from deltasync.errors import CorruptObjectError, StoreError
from deltasync.format.digest import digest
from deltasync.format.manifest import manifest_key, parse_manifest
from deltasync.relay.cache import ObjectCache
from deltasync.relay.server import RelayServer
from deltasync.storage import LocalStore, Store, WrappingStore
from deltasync.storage._grpc import GrpcStore
from deltasync.storage.wire import CHUNK_BYTES, method_path
from deltasync.v1 import relay_pb2 as rpb

__all__ = ["published", "start_relay"]  # the fixtures, imported from test_relay

MiB = 1 << 20


class Gate(WrappingStore):
    """Reads of the last piece of ``key`` wait until ``opened`` (``reached`` says one is
    waiting); ``failures`` of them then raise ``fail`` instead. Counts reads per (key, range)."""

    def __init__(self, inner: Store, key: str, *, fail: Exception | None = None, failures: int = 0) -> None:
        super().__init__(inner)
        self.key = key
        self.reached = threading.Event()
        self.opened = threading.Event()
        self.fail = fail
        self.failures = failures
        self.reads: Counter[tuple[str, tuple[int, int] | None]] = Counter()
        self._lock = threading.Lock()

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        with self._lock:
            self.reads[key, byte_range] += 1
        if key == self.key and byte_range is not None and sum(byte_range) == self.inner.size(key):
            self.reached.set()
            assert self.opened.wait(60), "the test never opened the gate"
            with self._lock:
                failing = self.fail is not None and self.failures > 0
                self.failures -= int(failing)
            if failing:
                assert self.fail is not None
                raise self.fail
        return self.inner.get(key, byte_range)

    def pieces_read(self, key: str) -> int:
        return sum(n for (k, _), n in self.reads.items() if k == key)


def pack_key(data: bytes) -> str:
    return f"packs/{digest(data).hex()}.pack"


@pytest.fixture
def pack(tmp_path: Path) -> tuple[LocalStore, str, bytes]:
    """An origin holding one content-addressed pack of 3 MiB and a bit (4 pieces of 1 MiB)."""
    origin = LocalStore(tmp_path / "origin")
    data = os.urandom(3 * MiB + 4321)
    key = pack_key(data)
    origin.put(key, data)
    return origin, key, data


class RawGet:
    """One Get as a client sees it, a chunk at a time (the grpc:// store reads whole objects)."""

    def __init__(self, relay: RelayServer, key: str, byte_range: tuple[int, int] | None = None) -> None:
        self.channel = grpc.insecure_channel(relay.address)
        call = self.channel.unary_stream(method_path("Get"), request_serializer=rpb.GetRequest.SerializeToString,
                                         response_deserializer=rpb.GetChunk.FromString)
        request = rpb.GetRequest(key=key)
        if byte_range is not None:
            request = rpb.GetRequest(key=key, offset=byte_range[0], length=byte_range[1], has_range=True)
        self.stream: Iterator[Any] = call(request, timeout=60)

    def next(self) -> bytes:
        return bytes(next(self.stream).data)

    def rest(self) -> bytes:
        return b"".join(bytes(chunk.data) for chunk in self.stream)

    def close(self) -> None:
        self.channel.close()


def test_an_agent_gets_the_first_bytes_while_the_relay_is_still_fetching(
    pack: tuple[LocalStore, str, bytes], start_relay: StartRelay
) -> None:
    origin, key, data = pack
    gate = Gate(origin, key)
    relay = start_relay(gate, fetch_piece_bytes=MiB)
    whole, head, tail = RawGet(relay, key), RawGet(relay, key, (10, MiB)), RawGet(relay, key, (3 * MiB, 4321))
    try:
        assert whole.next() == data[:CHUNK_BYTES]  # the first piece, while the last is held upstream
        assert head.rest() == data[10 : 10 + MiB]  # a range already covered: served whole
        assert gate.reached.wait(60) and not gate.opened.is_set()
        wait_until(lambda: relay.metrics()["streamed"] == 3)  # the tail's reader too, waiting for its range
        metrics = relay.metrics()
        assert metrics["fetching"] == 1 and metrics["cached_objects"] == 0
        late = GrpcStore(relay.url)
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(late.get(key)), daemon=True)
        reader.start()  # a reader arriving mid-fetch joins the same fetch
        gate.opened.set()
        reader.join(60)
        assert whole.rest() == data[CHUNK_BYTES:]
        assert tail.rest() == data[3 * MiB :]
        assert got == [data]
    finally:
        gate.opened.set()
        for g in (whole, head, tail):
            g.close()
    settle(relay)
    metrics = relay.metrics()
    assert gate.pieces_read(key) == 4  # the object crossed the link once, in its four pieces
    assert metrics["upstream_fetches"] == 1 and metrics["cached_objects"] == 1 and metrics["fetch_errors"] == 0
    assert GrpcStore(relay.url).get(key, (5, 7)) == data[5:12]  # then from the cache
    assert gate.pieces_read(key) == 4


def test_without_streaming_a_reader_waits_for_the_whole_object(
    pack: tuple[LocalStore, str, bytes], start_relay: StartRelay
) -> None:
    origin, key, data = pack
    gate = Gate(origin, key)
    relay = start_relay(gate, fetch_piece_bytes=MiB, stream=False)
    got: list[bytes] = []
    first = threading.Event()

    def read() -> None:
        g = RawGet(relay, key)
        try:
            got.append(g.next())
            first.set()
            got.append(g.rest())
        finally:
            g.close()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert gate.reached.wait(60)
        assert not first.is_set()  # nothing is sent before the whole object is in the cache ...
        gate.opened.set()
    finally:
        gate.opened.set()
    reader.join(60)
    assert b"".join(got) == data  # ... and all of it after
    assert relay.metrics()["streamed"] == 0


@pytest.mark.parametrize("failure", ["unreachable", "corrupt"])
def test_a_fetch_failing_mid_object_fails_its_readers_and_caches_nothing(
    tmp_path: Path, pack: tuple[LocalStore, str, bytes], start_relay: StartRelay, failure: str
) -> None:
    origin, key, data = pack
    cache = tmp_path / "cache"
    if failure == "corrupt":  # the upstream's bytes do not match the pack's name: only the end tells
        bad = bytearray(data)
        bad[-1] ^= 1
        (origin.root / key).write_bytes(bytes(bad))
        gate = Gate(origin, key)
    else:
        gate = Gate(origin, key, fail=StoreError("simulated: the link went down"), failures=1)
    relay = start_relay(gate, cache_dir=cache, fetch_piece_bytes=MiB)
    reader = RawGet(relay, key)
    try:
        assert reader.next() == data[:CHUNK_BYTES]  # already sent when the fetch fails
        gate.opened.set()
        with pytest.raises(grpc.RpcError) as info:
            reader.rest()
    finally:
        gate.opened.set()
        reader.close()
    expected = grpc.StatusCode.DATA_LOSS if failure == "corrupt" else grpc.StatusCode.UNAVAILABLE
    assert info.value.code() == expected, info.value.details()
    assert key in str(info.value.details()) or "link went down" in str(info.value.details())
    settle(relay)
    metrics = relay.metrics()
    assert metrics["fetch_errors"] == 1 and metrics["cached_objects"] == 0 and metrics["upstream_fetches"] == 0
    assert list((cache / "tmp").iterdir()) == []  # the partial download is gone
    assert [f for f in (cache / "objects").rglob("*") if f.is_file()] == []
    store = GrpcStore(relay.url)
    if failure == "corrupt":  # the client's usual error for a damaged object, never short data
        with pytest.raises(CorruptObjectError, match="do not match the digest in its name"):
            store.get(key)
        assert relay.metrics()["cached_objects"] == 0
    else:  # the link is back: the client's usual retry fetches it again, once
        assert store.get(key) == data
        settle(relay)
        assert relay.metrics()["cached_objects"] == 1
        assert gate.reads[key, (0, MiB)] == 2


def test_a_grpc_store_retries_a_stream_cut_by_an_upstream_failure(
    pack: tuple[LocalStore, str, bytes], start_relay: StartRelay
) -> None:
    """The client reading the whole object gets UNAVAILABLE after some bytes, asks again from
    where it stopped, and the relay fetches the object anew: the bytes are whole and exact."""
    origin, key, data = pack
    gate = Gate(origin, key, fail=StoreError("simulated: the link went down"), failures=1)
    gate.opened.set()
    relay = start_relay(gate, fetch_piece_bytes=MiB)
    assert GrpcStore(relay.url).get(key) == data
    settle(relay)
    assert relay.metrics()["fetch_errors"] == 1 and relay.metrics()["upstream_fetches"] == 1
    gate.failures = 2  # a link that stays down: an error, not a short read
    gone = pack_key(b"x" * (2 * MiB + 1))
    origin.put(gone, b"x" * (2 * MiB + 1))
    gate.key = gone
    with pytest.raises(StoreError, match="no relay answered"):
        GrpcStore(relay.url).get(gone)


def test_a_relay_in_front_of_a_relay_streams_too(pack: tuple[LocalStore, str, bytes], start_relay: StartRelay) -> None:
    origin, key, data = pack
    gate = Gate(origin, key)
    a = start_relay(gate, fetch_piece_bytes=MiB)
    b = start_relay(a.url, fetch_piece_bytes=MiB)
    reader = RawGet(b, key)
    try:
        assert reader.next() == data[:CHUNK_BYTES]  # through two relays, while the origin holds the tail
        assert gate.reached.wait(60) and not gate.opened.is_set()
        assert a.metrics()["fetching"] == b.metrics()["fetching"] == 1
        assert a.metrics()["streamed"] >= 1 and b.metrics()["streamed"] == 1
        gate.opened.set()
        assert reader.rest() == data[CHUNK_BYTES:]
    finally:
        gate.opened.set()
        reader.close()
    settle(a, b)
    assert a.metrics()["upstream_fetches"] == b.metrics()["upstream_fetches"] == 1  # once per hop
    assert gate.pieces_read(key) == 4


def serve(upstream: str, cache: Path) -> tuple[subprocess.Popen[str], str]:
    """``deltasync serve`` in its own process (so that it can be killed): it and its address."""
    proc = subprocess.Popen([sys.executable, "-m", "deltasync", "serve", "--repo", upstream, "--listen", "127.0.0.1:0",
                             "--cache", str(cache)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r" on (127\.0\.0\.1:\d+) ", line)
    if m is None:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the relay did not start: {line!r}")
    return proc, m.group(1)


def test_a_relay_killed_mid_fetch_restarts_with_a_consistent_cache(tmp_path: Path, start_relay: StartRelay) -> None:
    """SIGKILL while a pack is half in ``tmp/`` (and half sent): the restarted relay clears it,
    indexes nothing of it, and serves the pack whole once the upstream lets it through."""
    origin = LocalStore(tmp_path / "origin")
    data = os.urandom((8 << 20) + 4321)  # two of the relay's 8 MiB pieces: the second is held upstream
    key = pack_key(data)
    origin.put(key, data)
    gate = Gate(origin, key)
    upper = start_relay(gate, fetch_piece_bytes=MiB)
    cache = tmp_path / "cache"
    proc, address = serve(upper.url, cache)
    try:
        with grpc.insecure_channel(address) as channel:
            call = channel.unary_stream(method_path("Get"), request_serializer=rpb.GetRequest.SerializeToString,
                                        response_deserializer=rpb.GetChunk.FromString)
            stream = call(rpb.GetRequest(key=key), timeout=60)
            assert bytes(next(stream).data) == data[:CHUNK_BYTES]  # streamed from the relay's tmp/
            assert gate.reached.wait(60)
            partial = [f for f in (cache / "tmp").iterdir() if f.is_file()]
            assert [f.stat().st_size for f in partial] == [8 << 20]
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            with pytest.raises(grpc.RpcError):  # cut off: an error, not a short object
                b"".join(bytes(c.data) for c in stream)
        proc, address = serve(upper.url, cache)
        assert list((cache / "tmp").iterdir()) == []  # cleared at start
        assert [f for f in (cache / "objects").rglob("*") if f.is_file()] == []
        gate.opened.set()
        assert GrpcStore(f"grpc://{address}").get(key) == data
        wait_until(lambda: len([f for f in (cache / "objects").rglob("*") if f.is_file()]) == 1)  # renamed into place just after
    finally:
        gate.opened.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- warming ---------------------------------------------------------------------------------------


def version_objects(url: str, version: int) -> list[str]:
    info = parse_manifest(LocalStore(url).get(manifest_key(version)), expect_version=version)
    return sorted(p.key for p in info.pb.packs)


def test_a_new_version_is_fetched_before_any_agent_asks(
    published: tuple[str, Any, list[dict[str, bytes]]], start_relay: StartRelay
) -> None:
    url, pub, _ = published
    origin = Gate(LocalStore(url), "none")
    relay = start_relay(origin)
    watcher = Watcher(GrpcStore(relay.url), after=3)  # an agent waiting for news (the feed runs)
    try:
        wait_until(lambda: relay.metrics()["warmed_versions"] == 1)  # v3, the newest when the feed started
        state4 = step(make_state(0), 4)
        v4 = pub.publish(state4)
        assert watcher.next()[0] == v4
        packs = version_objects(url, v4)
        assert packs
        wait_until(lambda: relay.metrics()["warmed_versions"] == 2)
        settle(relay)
        metrics = relay.metrics()
        assert metrics["requests"] == 1  # the Watch: nobody asked for an object ...
        for key in [manifest_key(v4), *packs]:  # ... yet v4 crossed the link, once
            assert origin.pieces_read(key) == 1, key
        assert metrics["warm_fetches"] >= len(packs) + 1 and metrics["warm_errors"] == metrics["warm_skipped"] == 0
        before = metrics["upstream_fetches"]
        assert raw(Subscriber(relay.url).pull(v4)) == raw(state4)  # the agent reads the warm cache
        metrics = relay.metrics()
        assert all(origin.pieces_read(key) == 1 for key in [manifest_key(v4), *packs])
        assert metrics["cache_hits"] >= len(packs) + 1
        assert metrics["upstream_fetches"] > before  # v4's chain below it (v1 to v3) was fetched on demand
    finally:
        watcher.close()


def test_warming_is_off_with_no_warm_and_skipped_past_half_the_cache_limit(
    published: tuple[str, Any, list[dict[str, bytes]]], start_relay: StartRelay
) -> None:
    url, pub, _ = published
    cold = start_relay(url, warm=False)
    small = start_relay(url, cache_max_bytes=1024)  # a version's packs are more than half of it
    watchers = [Watcher(GrpcStore(cold.url), after=3), Watcher(GrpcStore(small.url), after=3)]
    try:
        wait_until(lambda: small.metrics()["warm_skipped"] == 1)  # v3, the newest when the feed started
        wait_until(lambda: bool(cold.metrics()["following_upstream"]))
        v4 = pub.publish(step(make_state(0), 4))
        assert all(w.next()[0] == v4 for w in watchers)
        wait_until(lambda: small.metrics()["warm_skipped"] == 2)  # then v4
        settle(cold, small)
        assert cold.metrics()["warm_fetches"] == cold.metrics()["upstream_fetches"] == 0
        assert small.metrics()["warmed_versions"] == 0
        assert small.metrics()["upstream_fetches"] == 2  # the manifests alone
    finally:
        for w in watchers:
            w.close()


def test_an_object_being_served_is_not_evicted(tmp_path: Path) -> None:
    origin = LocalStore(tmp_path / "origin")
    for name in "abc":
        origin.put(f"packs/{name}.pack", name.encode() * 1000)
    cache = ObjectCache(tmp_path / "cache", max_bytes=2500)
    try:
        cache.fetch("packs/a.pack", origin)
        cache.hold("packs/a.pack")  # a reader is streaming it
        cache.fetch("packs/b.pack", origin)
        cache.fetch("packs/c.pack", origin)  # over the limit: b goes, though a is older
        assert cache.lookup("packs/a.pack", touch=False) is not None
        assert cache.lookup("packs/b.pack", touch=False) is None
        cache.release("packs/a.pack")
        cache.fetch("packs/b.pack", origin)  # a is no longer held: the least recently used goes
        assert cache.lookup("packs/a.pack", touch=False) is None
        assert cache.lookup("packs/c.pack", touch=False) is not None
        assert cache.evictions == 2 and cache.total_bytes <= 2500
    finally:
        cache.close()


def test_pull_through_a_streaming_chain_is_bit_exact(
    published: tuple[str, Any, list[dict[str, bytes]]], start_relay: StartRelay
) -> None:
    url, _, states = published
    a = start_relay(url, fetch_piece_bytes=16 << 10)  # packs of 64 KiB: every one streams in pieces
    b = start_relay(a.url, fetch_piece_bytes=16 << 10)
    subs = [Subscriber(b.url, workers=4) for _ in range(4)]
    results: list[dict[str, bytes] | BaseException] = []

    def pull(sub: Subscriber) -> None:
        try:
            results.append(raw(sub.pull(3)))
        except BaseException as e:
            results.append(e)

    threads = [threading.Thread(target=pull, args=(s,), daemon=True) for s in subs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [states[2]] * 4
    settle(a, b)
    assert a.metrics()["upstream_fetches"] == b.metrics()["upstream_fetches"] > 0
    assert a.metrics()["fetch_errors"] == b.metrics()["fetch_errors"] == 0


def test_a_download_outliving_its_relays_loop_still_lands_and_closes_its_file(tmp_path: Path) -> None:
    """A relay stopped mid-download closes its event loop; the download thread's progress
    notes then have no one to wake, and must not stop it from closing its file descriptor,
    landing the object and leaving nothing in tmp/."""
    import asyncio

    from deltasync.relay.fetch import Flight

    origin = LocalStore(str(tmp_path / "origin"))
    data = os.urandom(3 * 1024 + 5)
    origin.put("blobs/x", data)
    loop = asyncio.new_event_loop()
    flight = Flight("blobs/x", loop)
    loop.close()  # the relay is gone
    cache = ObjectCache(tmp_path / "cache", piece_bytes=1024)
    entry = cache.fetch("blobs/x", origin, landing=flight.landing)
    assert entry.size == len(data) and Path(entry.path).read_bytes() == data
    assert flight.landing._fd == -1  # closed
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []

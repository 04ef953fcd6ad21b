"""The relay (``deltasync serve``) and ``grpc://`` repositories, over real gRPC on 127.0.0.1."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

import deltasync.relay.feed as relay_feed
import deltasync.storage._grpc as grpc_store
from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Subscriber
from deltasync.errors import CorruptObjectError, ObjectNotFoundError, StoreError, UsageError
from deltasync.relay.server import RelayServer, build_server, parse_size
from deltasync.storage import LocalStore, Store, WrappingStore, open_store
from deltasync.storage._grpc import Download, GrpcStore, VersionWatch, parse_grpc_url
from deltasync.storage.testing import ReadOnlyStoreConformance

MiB = 1 << 20
IMMUTABLE = ("packs/", "blobs/", "manifests/")

StartRelay = Callable[..., RelayServer]


@pytest.fixture
def start_relay() -> Iterator[StartRelay]:
    """Start relays on 127.0.0.1 (any free port); every one is stopped at the end of the test."""
    servers: list[RelayServer] = []

    def start(upstream: str | Store, **options: Any) -> RelayServer:
        options.setdefault("poll_interval", 0.05)
        server = build_server(upstream, "127.0.0.1:0", **options).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace=0)


class CountingStore(WrappingStore):
    """Delegates to ``inner`` and counts reads per key."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.gets: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        with self._lock:
            self.gets[key] += 1
        return self.inner.get(key, byte_range)


def make_state(seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": torch.from_numpy(rng.integers(0, 1 << 16, 96 * 1024, dtype=np.uint16).view(np.int16))
        .view(torch.bfloat16)
        .reshape(96, 1024),
        "layers.0.mlp.weight": torch.from_numpy(rng.standard_normal((128, 256)).astype(np.float32)),
        "norm.weight": torch.from_numpy(rng.standard_normal(64).astype(np.float32)),
    }


def step(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """About 1% of each tensor's elements move by one ulp, as after an optimizer step."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in state.items():
        flat = t.contiguous().reshape(-1).clone()
        ints = flat.view({2: torch.int16, 4: torch.int32}[flat.element_size()]).numpy()
        ints[rng.choice(len(ints), size=max(1, len(ints) // 100), replace=False)] += 1
        out[name] = flat.reshape(t.shape)
    return out


def raw(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in state.items()}


def publisher(repo: str | Store) -> Publisher:
    config = PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=16 << 10), pack_bytes=64 << 10, progress=False)
    return Publisher(repo, config)


@pytest.fixture
def published(tmp_path: Path) -> tuple[str, Publisher, list[dict[str, bytes]]]:
    """A local repository with a snapshot and two deltas: (url, its publisher, raw states)."""
    url = str(tmp_path / "origin")
    pub = publisher(url)
    states = [make_state(0)]
    states += [step(states[0], 1)]
    states += [step(states[1], 2)]
    for s in states:
        pub.publish(s)
    return url, pub, [raw(s) for s in states]


class Watcher:
    """Runs ``store.watch(after)`` on a thread; events land in a queue with their arrival time."""

    def __init__(self, store: GrpcStore, after: int = 0) -> None:
        self.watch = store.watch(after)
        self.events: queue.Queue[tuple[int, float] | BaseException] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for version in self.watch:
                self.events.put((version, time.monotonic()))
        except BaseException as e:
            self.events.put(e)

    def next(self, timeout: float = 30.0) -> tuple[int, float]:
        """The next version and its arrival time; the timeout only bounds a failure."""
        item = self.events.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Close the watch: its thread must end at once (10 s is slack for a loaded machine,
        far below what a watch left waiting on a relay, a pause or a stuck read would take)."""
        self.watch.close()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the watch did not end on close()"


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for ``condition`` to hold; the timeout only bounds a failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def settle(*relays: RelayServer) -> None:
    """Wait until no fetch from the upstream is in flight at ``relays``: a Get ends once its
    object is verified, and the cache indexes it (and counts it) just after, an fsync later."""
    wait_until(lambda: all(r.metrics()["fetching"] == 0 for r in relays))


class StuckCall(grpc.RpcError):  # type: ignore[misc]
    """What grpcio 1.85 sometimes makes of a Watch opened just as its relay stops: the call has
    its status (UNAVAILABLE, connection refused) but a read on it never returns, and
    ``cancel()`` does nothing since the call is over."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = threading.Event()  # a reader is blocked in it
        self.release = threading.Event()  # lets the reader go at the end of the test

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "failed to connect to all addresses; Connection refused"

    def done(self) -> bool:
        return True

    def cancel(self) -> bool:
        return False

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)

    def __iter__(self) -> StuckCall:
        return self

    def __next__(self) -> Any:
        self.reading.set()
        self.release.wait()
        raise self


# -- the store conformance suite, read side --------------------------------------------------------


class TestGrpcStore(ReadOnlyStoreConformance):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[Store]:
        yield LocalStore(tmp_path / "origin")

    @pytest.fixture
    def reader(self, backend: Store, start_relay: StartRelay) -> Iterator[Store]:
        store = open_store(start_relay(backend).url)
        assert isinstance(store, GrpcStore)
        yield store
        store.close()


def test_cached_objects(tmp_path: Path, start_relay: StartRelay) -> None:
    origin = CountingStore(LocalStore(tmp_path / "origin"))
    big = os.urandom(3 * MiB + 12345)  # several 1 MiB chunks, fetched in 1 MiB pieces
    origin.put("packs/big.pack", big)
    origin.put("manifests/empty", b"")
    relay = start_relay(origin, fetch_piece_bytes=MiB)
    store = GrpcStore(relay.url)
    assert store.get("packs/big.pack") == big
    assert origin.gets["packs/big.pack"] == 4  # ranged pieces, then never again
    for offset, length in [(0, 1), (MiB - 3, 7), (len(big) - 5, 5), (len(big), 0), (12, 2 * MiB + 1)]:
        assert store.get("packs/big.pack", (offset, length)) == big[offset : offset + length]
    assert store.size("packs/big.pack") == len(big)
    assert store.get("manifests/empty") == b""
    assert origin.gets["packs/big.pack"] == 4
    with pytest.raises(CorruptObjectError):
        store.get("packs/big.pack", (len(big) - 5, 6))
    with pytest.raises(CorruptObjectError):
        store.get("packs/big.pack", (len(big) + 1, 0))
    with pytest.raises(ObjectNotFoundError) as info:
        store.get("packs/missing.pack", (0, 1))
    assert info.value.key == "packs/missing.pack"
    origin.put("packs/missing.pack", b"late")  # absence is never cached
    assert store.get("packs/missing.pack") == b"late"
    with pytest.raises(UsageError):  # the relay validates keys too
        store._get("packs/../../etc/passwd", None)
    with pytest.raises(UsageError, match="read-only"):
        store.put("packs/x", b"1")
    with pytest.raises(UsageError, match="read-only"):
        store.delete("packs/big.pack")
    settle(relay)
    metrics = relay.metrics()
    assert metrics["upstream_fetches"] == 3
    assert metrics["cache_hits"] + metrics["coalesced"] >= 6
    store.close()


def test_urls() -> None:
    assert parse_grpc_url("grpc://a:1,b.example:2?timeout=3") == (["a:1", "b.example:2"], 3.0)
    assert parse_grpc_url("grpc://[::1]:50051") == (["[::1]:50051"], 120.0)
    for bad in ["grpc://", "grpc://host", "grpc://host:0", "grpc://h:1/path", "grpc://h:1?x=1", "grpc://h:1?timeout=-1"]:
        with pytest.raises(UsageError):
            parse_grpc_url(bad)
    assert parse_size("500G") == 500 << 30 and parse_size("1.5KiB") == 1536 and parse_size("42") == 42
    with pytest.raises(UsageError):
        parse_size("lots")
    with pytest.raises(UsageError, match="listen"):
        build_server("/tmp/x", "nohostport")


# -- pulls ---------------------------------------------------------------------------------------


def test_pull_through_relay_bit_exact(published: tuple[str, Publisher, list[dict[str, bytes]]], start_relay: StartRelay,
                                      tmp_path: Path) -> None:
    url, _, states = published
    relay = start_relay(url)
    sub = Subscriber(relay.url, workers=4)
    for version, want in enumerate(states, start=1):
        assert raw(sub.pull(version)) == want  # snapshot, then deltas on top of it
    assert sub.pull_to_dir(tmp_path / "serving") == 3
    assert Subscriber(url).pull_to_dir(tmp_path / "direct") == 3
    for f in (tmp_path / "direct").glob("*.safetensors"):
        assert (tmp_path / "serving" / f.name).read_bytes() == f.read_bytes()


def test_concurrent_pulls_read_each_object_upstream_once(
    published: tuple[str, Publisher, list[dict[str, bytes]]], start_relay: StartRelay
) -> None:
    url, _, states = published
    origin = CountingStore(LocalStore(url))
    relay = start_relay(origin)
    barrier = threading.Barrier(8, timeout=60)
    results: list[dict[str, bytes] | BaseException] = []

    def pull() -> None:
        try:
            sub = Subscriber(relay.url, workers=4)
            barrier.wait()
            results.append(raw(sub.pull(3)))
        except BaseException as e:
            results.append(e)

    threads = [threading.Thread(target=pull, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # bounds a failure only
    assert results == [states[2]] * 8
    immutable = {k: n for k, n in origin.gets.items() if k.startswith(IMMUTABLE)}
    assert any(k.startswith("packs/") for k in immutable) and any(k.startswith("manifests/") for k in immutable)
    assert immutable == dict.fromkeys(immutable, 1), "an object was read from the upstream more than once"
    settle(relay)
    metrics = relay.metrics()
    assert metrics["upstream_fetches"] == len(immutable)
    assert metrics["cache_hits"] + metrics["coalesced"] > len(immutable)


def test_relay_chain(published: tuple[str, Publisher, list[dict[str, bytes]]], start_relay: StartRelay) -> None:
    url, pub, states = published
    a = start_relay(url)
    b = start_relay(a.url)  # a second cluster's relay reads from the first relay
    assert raw(Subscriber(b.url).pull(3)) == states[2]
    settle(a, b)
    fetched = a.metrics()["upstream_fetches"]
    assert fetched == b.metrics()["upstream_fetches"] > 0  # each object crossed each hop once
    assert raw(Subscriber(b.url).pull(2)) == states[1]
    assert raw(Subscriber(b.url).pull(3)) == states[2]
    settle(a, b)
    # Served from b's cache: a was never asked for an object again.
    assert a.metrics()["upstream_fetches"] == b.metrics()["upstream_fetches"] == fetched
    assert a.metrics()["cache_hits"] == 0
    # Versions are pushed down the tree: b follows a's Watch stream.
    watcher = Watcher(GrpcStore(b.url), after=3)
    try:
        v4 = pub.publish(step(make_state(0), 4))
        version, _ = watcher.next()
        assert version == v4
    finally:
        watcher.close()


def test_failover_to_the_next_relay(published: tuple[str, Publisher, list[dict[str, bytes]]], start_relay: StartRelay) -> None:
    url, pub, states = published
    first, second = start_relay(url), start_relay(url)
    both = f"grpc://{first.address},{second.address}"
    store = GrpcStore(both)
    sub = Subscriber(store)
    assert raw(sub.pull(1)) == states[0]
    assert first.metrics()["requests"] > 0  # refs at the first; packs and manifests shard over both (issue 30)
    watcher = Watcher(store, after=3)
    try:
        first.stop(grace=0)
        assert raw(sub.pull(3)) == states[2]  # reads and the watch carry on through the second relay
        assert second.metrics()["requests"] > 0
        v4 = pub.publish(step(make_state(0), 4))
        version, _ = watcher.next()
        assert version == v4
    finally:
        watcher.close()
    assert GrpcStore(f"grpc://127.0.0.1:1,{second.address}").get("deltasync.json")  # a dead first entry


def test_a_watch_moves_on_from_a_stream_grpc_never_finishes_reading(
    published: tuple[str, Publisher, list[dict[str, bytes]]], start_relay: StartRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _, _ = published
    first, second = start_relay(url), start_relay(url)
    store = GrpcStore(f"grpc://{first.address},{second.address}")
    stuck = StuckCall()
    monkeypatch.setattr(store._relays[0], "watch", lambda request, **kw: stuck)
    watcher = Watcher(store)
    try:
        assert watcher.next()[0] == 3  # from the second relay, once the first call is seen to be over
        assert stuck.reading.is_set() and second.metrics()["watchers"] == 1
    finally:
        watcher.close()
        stuck.release.set()


@pytest.mark.parametrize("state", ["connecting", "streaming", "pausing between relays", "on a stuck read"])
def test_close_ends_a_watch_at_once_in_every_state(
    published: tuple[str, Publisher, list[dict[str, bytes]]], start_relay: StartRelay, monkeypatch: pytest.MonkeyPatch,
    state: str,
) -> None:
    url, _, _ = published
    # Each state would otherwise hold the watch far longer than Watcher.close() allows.
    monkeypatch.setattr(grpc_store, "_ROUND_PAUSE", 600.0)
    monkeypatch.setattr(grpc_store, "_READ_GRACE", 600.0)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    stuck = [StuckCall() for _ in range(4)]
    calls = iter(stuck)

    def stuck_call(request: Any, **kw: Any) -> StuckCall:
        return next(calls)

    pausing = threading.Event()
    try:
        if state == "connecting":
            store = GrpcStore(f"grpc://127.0.0.1:{silent.getsockname()[1]}")
            watcher = Watcher(store)
            silent.settimeout(30)
            conn, _ = silent.accept()  # the watch is connecting
            conn.close()
        elif state == "streaming":
            watcher = Watcher(GrpcStore(start_relay(url).url))
            assert watcher.next()[0] == 3
        elif state == "pausing between relays":
            pause = VersionWatch._pause

            def spy(self: VersionWatch, seconds: float) -> bool:
                pausing.set()
                return pause(self, seconds)

            monkeypatch.setattr(VersionWatch, "_pause", spy)
            store = GrpcStore(start_relay(url).url)
            monkeypatch.setattr(store._relays[0], "watch", stuck_call)
            monkeypatch.setattr(grpc_store, "_READ_GRACE", 0.01)  # the first stuck read is over at once
            watcher = Watcher(store)
            assert pausing.wait(30)
        else:
            store = GrpcStore(start_relay(url).url)
            monkeypatch.setattr(store._relays[0], "watch", stuck_call)
            watcher = Watcher(store)
            assert stuck[0].reading.wait(30)
        watcher.close()
        assert watcher.events.empty()  # ended: no error, no version
    finally:
        for call in stuck:
            call.release.set()
        silent.close()


def test_read_cut_off_mid_stream_resumes_on_the_next_relay(
    tmp_path: Path, start_relay: StartRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin = LocalStore(tmp_path / "origin")
    data = os.urandom(8 * MiB)
    origin.put("packs/p.pack", data)
    relays = [start_relay(origin), start_relay(origin)]
    store = GrpcStore(f"grpc://{relays[0].address},{relays[1].address}")
    first = relays[store._shard("packs/p.pack")]  # where the read starts (reads shard by key, issue 30)
    second = relays[1 - store._shard("packs/p.pack")]
    feed = Download.feed
    cut_at: list[int] = []

    def feed_then_kill_first(self: Download, chunk: Any) -> None:
        feed(self, chunk)
        if not cut_at:
            cut_at.append(self.received)
            first.stop(grace=0)  # the relay dies with the rest of the stream unsent

    monkeypatch.setattr(Download, "feed", feed_then_kill_first)
    assert store.get("packs/p.pack") == data
    assert 0 < cut_at[0] < len(data)
    assert 0 < second.metrics()["served_bytes"] < len(data)  # only the rest, from where it stopped


def test_watch_pushes_each_new_version_and_keepalives_are_not_versions(
    tmp_path: Path, start_relay: StartRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "origin")
    pub = publisher(url)
    received = threading.Semaphore(0)  # one release per message a Watch stream delivers

    class CountingStream(grpc_store._Stream):
        def __iter__(self) -> Iterator[Any]:
            for message in super().__iter__():
                received.release()
                yield message

    monkeypatch.setattr(grpc_store, "_Stream", CountingStream)
    # An empty repository: keepalives only. Once the second has arrived, the watch has dealt
    # with the first, and yielded nothing for it.
    chatty = start_relay(url, poll_interval=0.1, keepalive_interval=0.2)
    watcher = Watcher(GrpcStore(chatty.url), after=0)
    try:
        assert received.acquire(timeout=30) and received.acquire(timeout=30)
        assert watcher.events.empty()
    finally:
        watcher.close()
    # Keepalives every 60 s: a version arriving within the test's timeouts was pushed by the
    # relay as its poll (every 0.1 s) saw it.
    relay = start_relay(url, poll_interval=0.1, keepalive_interval=60)
    watcher = Watcher(GrpcStore(relay.url), after=0)
    try:
        state = make_state(0)
        for expected in (1, 2, 3):
            state = step(state, expected)
            version = pub.publish(state)
            assert watcher.next()[0] == version == expected
        assert relay.metrics()["watchers"] == 1
        late = Watcher(GrpcStore(relay.url), after=0)  # a watcher that is behind gets the newest only
        try:
            assert late.next()[0] == 3
        finally:
            late.close()
    finally:
        watcher.close()
    wait_until(lambda: relay.metrics()["watchers"] == 0)  # a closed watch ends its stream on the relay


def test_feed_stops_polling_without_watchers(tmp_path: Path, start_relay: StartRelay, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_feed, "_IDLE_STOP", 0.2)
    url = str(tmp_path / "origin")
    pub = publisher(url)
    state = make_state(0)
    pub.publish(state)
    origin = CountingStore(LocalStore(url))
    relay = start_relay(origin, poll_interval=0.02)
    watcher = Watcher(GrpcStore(relay.url))
    assert watcher.next()[0] == 1
    watcher.close()
    wait_until(lambda: not relay.metrics()["following_upstream"])
    polls = origin.gets["refs/latest"]
    time.sleep(0.3)
    assert origin.gets["refs/latest"] == polls  # idle: the upstream is left alone
    for seed in (5, 6):
        state = step(state, seed)
        pub.publish(state)
    watcher = Watcher(GrpcStore(relay.url))  # restarts the feed; hears the news fresh, newest first
    try:
        assert watcher.next()[0] == 3
        assert relay.metrics()["following_upstream"]
    finally:
        watcher.close()


# -- errors --------------------------------------------------------------------------------------


def test_dead_relay_is_a_one_line_error(published: tuple[str, Publisher, list[dict[str, bytes]]], start_relay: StartRelay,
                                        tmp_path: Path) -> None:
    url, _, _ = published
    a = start_relay(url)
    b = start_relay(a.url, upstream_grace=0.3)
    assert GrpcStore(b.url).exists("deltasync.json")
    watcher = Watcher(GrpcStore(b.url), after=0)
    assert watcher.next()[0] == 3
    a.stop(grace=0)
    # b is up but its upstream is gone: uncached reads fail, and so does b's watch (its
    # watchers are sent away once the upstream stayed unreachable for upstream_grace).
    with pytest.raises(StoreError) as info:
        GrpcStore(b.url).get("packs/never-fetched.pack")
    assert "\n" not in str(info.value) and a.address in str(info.value)
    with pytest.raises(StoreError) as info:
        watcher.next()
    assert "\n" not in str(info.value)
    watcher.close()
    b.stop(grace=0)
    with pytest.raises(StoreError) as info:
        Subscriber(b.url).pull(1)
    message = str(info.value)
    assert "\n" not in message and b.address in message and "no relay answered" in message
    p = subprocess.run(
        [sys.executable, "-m", "deltasync", "pull", "--repo", b.url, "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=60,
    )
    assert p.returncode != 0
    assert p.stderr.startswith("deltasync: error: ") and p.stderr.count("\n") == 1, p.stderr
    assert "Traceback" not in p.stderr


# -- the cache -----------------------------------------------------------------------------------


def test_cache_evicts_least_recently_used_and_survives_restart(tmp_path: Path, start_relay: StartRelay) -> None:
    origin = CountingStore(LocalStore(tmp_path / "origin"))
    for name in "abcd":
        origin.put(f"packs/{name}.pack", name.encode() * 1000)
    cache = tmp_path / "cache"
    relay = start_relay(origin, cache_dir=cache, cache_max_bytes=3500)
    store = GrpcStore(relay.url)
    for name in "abc":
        store.get(f"packs/{name}.pack")
        settle(relay)  # in the cache, in this order
    store.get("packs/a.pack", (0, 10))  # a is now more recent than b
    store.get("packs/d.pack")  # over the limit: b (least recently used) goes
    settle(relay)
    metrics = relay.metrics()
    assert metrics["evictions"] == 1 and metrics["cached_bytes"] == 3000
    with pytest.raises(UsageError, match="in use"):  # one relay per cache directory
        build_server(origin, "127.0.0.1:0", cache).start()
    with pytest.raises(UsageError, match="not a relay cache"):  # nor one that holds something else
        build_server(origin, "127.0.0.1:0", tmp_path).start()
    relay.stop(grace=0)

    before = dict(origin.gets)
    relay = start_relay(origin, cache_dir=cache, cache_max_bytes=3500)
    store = GrpcStore(relay.url)
    for name in "acd":
        assert store.get(f"packs/{name}.pack") == name.encode() * 1000
    assert origin.gets == before  # served from the files and index kept across the restart
    assert store.get("packs/b.pack") == b"b" * 1000
    assert origin.gets["packs/b.pack"] == before["packs/b.pack"] + 1
    for f in (cache / "objects").rglob("*"):  # files lost under a running relay: fetched again
        if f.is_file():
            f.unlink()
    assert store.get("packs/c.pack", (10, 5)) == b"c" * 5
    assert origin.gets["packs/c.pack"] == before["packs/c.pack"] + 1


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("options", [[], ["--no-warm", "--no-stream"]])
def test_cli_serve_then_sigterm(published: tuple[str, Publisher, list[dict[str, bytes]]], tmp_path: Path,
                                options: list[str]) -> None:
    url, _, states = published
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltasync", "serve", "--repo", url, "--listen", "127.0.0.1:0", "--cache", str(tmp_path / "c"),
         *options],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines: queue.Queue[str] = queue.Queue()

        def read_stdout() -> None:
            for line in proc.stdout or ():
                lines.put(line)

        threading.Thread(target=read_stdout, daemon=True).start()
        first = lines.get(timeout=60)
        m = re.search(r" on (127\.0\.0\.1:\d+) ", first)
        assert m, first
        assert raw(Subscriber(f"grpc://{m.group(1)}").pull(3)) == states[2]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert lines.get(timeout=5).strip() == "relay stopped"
        stderr = proc.stderr.read() if proc.stderr else ""
        assert "Traceback" not in stderr, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _FloodCall:
    """A server stream that has many messages ready at once (a relay flooding its client)."""

    def __init__(self, n: int) -> None:
        self.sent = 0
        self.n = n
        self.cancelled = threading.Event()

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            if self.cancelled.is_set():
                return
            self.sent += 1
            yield i

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        pass

    def cancel(self) -> bool:
        self.cancelled.set()
        return True

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK


def test_a_stream_reads_ahead_of_its_consumer_only_a_bounded_number_of_messages() -> None:
    call = _FloodCall(10_000)
    stream = grpc_store._Stream(call).__iter__()
    assert isinstance(stream, Generator)
    assert next(stream) == 0
    deadline = time.monotonic() + 5
    while call.sent < grpc_store._READ_AHEAD + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # a reader without flow control would race far ahead meanwhile
    assert call.sent <= grpc_store._READ_AHEAD + 2
    assert [next(stream) for _ in range(100)] == list(range(1, 101))  # then it keeps up with the consumer
    stream.close()
    assert call.cancelled.wait(5)

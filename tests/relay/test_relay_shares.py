"""Issue 30 item 3: the relays of one cluster (``cluster_relays``) fetch each object in shares,
each over its own link, and fill each other (relay/shares.py); a relay stopped mid-version
leaves the others serving everything, bit-exact; a peer's bad bytes cost one retry."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deltasync import Publisher, PublisherConfig, Subscriber
from deltasync.errors import DeltasyncError, UsageError
from deltasync.format.digest import digest
from deltasync.relay.config import RelayConfig
from deltasync.relay.server import RelayServer, build_server
from deltasync.repo.repository import Repository
from deltasync.storage import GrpcStore, LocalStore, Store, WrappingStore

MiB = 1 << 20


class Link(WrappingStore):
    """A relay's own upstream link: counts the bytes of each key read over it, optionally at
    ``rate`` bytes per second (all reads together)."""

    def __init__(self, inner: Store, rate: float | None = None) -> None:
        super().__init__(inner)
        self.bytes: Counter[str] = Counter()
        self.rate = rate
        self._free_at = time.monotonic()
        self._lock = threading.Lock()

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        data = self.inner.get(key, byte_range)
        with self._lock:
            self.bytes[key] += len(data)
            if self.rate is None:
                return data
            self._free_at = max(self._free_at, time.monotonic()) + len(data) / self.rate
            done = self._free_at
        time.sleep(max(0.0, done - time.monotonic()))
        return data

    def pack_bytes(self) -> int:
        with self._lock:
            return sum(n for k, n in self.bytes.items() if k.startswith("packs/"))


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def cluster() -> Iterator[Callable[..., tuple[list[RelayServer], list[Link], list[str]]]]:
    """``cluster(repo, n, rate=None, upstreams=None, **options)``: ``n`` relays of one cluster over
    ``repo``, each through its own :class:`Link`; all stopped at the end."""
    servers: list[RelayServer] = []

    def start(repo: Path, n: int = 2, rate: float | None = None, upstreams: list[Store] | None = None,
              members: list[str] | None = None, **options: Any) -> tuple[list[RelayServer], list[Link], list[str]]:
        members = members or [free_address() for _ in range(n)]
        links = [Link(upstreams[i] if upstreams else LocalStore(str(repo)), rate) for i in range(n)]
        options.setdefault("poll_interval", 0.05)
        options.setdefault("fetch_piece_bytes", MiB)
        for link, member in zip(links, members, strict=True):
            servers.append(build_server(link, member, cluster_relays=members, **options).start())
        return servers[-n:], links, members

    yield start
    for server in servers:
        server.stop(grace=0)


def publish(repo: Path, mib: int = 12, seed: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """One version of ``mib`` MiB of random bits (they do not compress: its pack is about that
    size), and the bytes of its packs."""
    rng = np.random.default_rng(seed)
    state = {"w": torch.from_numpy(rng.integers(0, 1 << 16, mib * MiB // 2, dtype=np.uint16).view(np.int16))}
    Publisher(str(repo), PublisherConfig(progress=False)).publish(state)
    packs = sum(p.stat().st_size for p in (repo / "packs").iterdir())
    return state, packs


def same(got: dict[str, Any], state: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(state) and all(torch.equal(torch.as_tensor(got[k]).view(torch.int16), v.view(torch.int16))
                                          for k, v in state.items())


def test_each_relay_of_a_cluster_carries_its_share_and_holds_everything(tmp_path: Path, cluster: Any) -> None:
    repo = tmp_path / "repo"
    state, packs = publish(repo)
    relays, links, members = cluster(repo, warm=False)  # fetched on demand: only the reads below move bytes
    got = Subscriber("grpc://" + ",".join(members), progress=False).pull()
    assert same(dict(got), state)
    carried = [link.pack_bytes() for link in links]
    # Every pack byte crossed exactly one relay's link, about half each (12 pieces of 1 MiB,
    # owned alternately), where before every pack went whole over the link of the relay it was read at.
    assert sum(carried) == packs
    assert all(0.35 * packs <= c <= 0.65 * packs for c in carried), carried
    for relay in relays:
        metrics = relay.metrics()
        assert metrics["peer_pieces"] > 0 and metrics["peer_fallbacks"] == 0
        assert metrics["own_bytes"] + metrics["peer_bytes"] == packs  # each relay holds the whole pack
    # Either relay serves everything now from its cache, with no byte across a link.
    before = [link.pack_bytes() for link in links]
    for member in members:
        assert same(dict(Subscriber(f"grpc://{member}", progress=False).pull()), state)
    assert [link.pack_bytes() for link in links] == before


def test_warming_cluster_relays_each_fetch_their_share(tmp_path: Path, cluster: Any) -> None:
    repo = tmp_path / "repo"
    Publisher(str(repo), PublisherConfig(progress=False)).publish({"w": torch.zeros(8)})  # an older version
    relays, links, members = cluster(repo)  # warming: each hears of new versions with no watcher of its own
    state, _ = publish(repo, seed=1)
    keys = {p.key: p.size for p in Repository(str(repo)).manifest(2).pb.packs}
    packs = sum(keys.values())
    deadline = time.monotonic() + 60
    while any(r.metrics()["warmed_versions"] < 2 for r in relays) and time.monotonic() < deadline:  # v1, then v2
        time.sleep(0.05)
    assert all(r.metrics()["warmed_versions"] >= 2 for r in relays)
    carried = [sum(link.bytes[k] for k in keys) for link in links]
    assert sum(carried) == packs and all(0.35 * packs <= c <= 0.65 * packs for c in carried), carried
    before = [link.pack_bytes() for link in links]
    assert same(dict(Subscriber("grpc://" + ",".join(members), progress=False).pull(2)), state)
    assert [link.pack_bytes() for link in links] == before  # the pull read the caches only


def test_a_cluster_relay_stopped_mid_version_leaves_the_other_serving_everything(tmp_path: Path,
                                                                                  cluster: Any) -> None:
    repo = tmp_path / "repo"
    state, packs = publish(repo)
    # Slow links (4 MB/s each: about 1.5 s for a relay's share), so the stop lands mid-transfer.
    relays, links, members = cluster(repo, rate=4e6, warm=False)
    result: dict[str, Any] = {}

    def pull() -> None:
        try:
            result["state"] = dict(Subscriber("grpc://" + ",".join(members), progress=False).pull())
        except BaseException as e:  # handed to the test
            result["error"] = e

    puller = threading.Thread(target=pull)
    puller.start()
    deadline = time.monotonic() + 60
    while links[1].pack_bytes() < MiB and time.monotonic() < deadline:  # the second relay has begun its share
        time.sleep(0.01)
    assert links[1].pack_bytes() >= MiB
    relays[1].stop(grace=0)
    assert links[1].pack_bytes() < packs // 2  # stopped before it carried its share
    puller.join(120)
    assert not puller.is_alive()
    assert "error" not in result, result.get("error")
    assert same(result["state"], state)  # bit-exact through the relay left
    metrics = relays[0].metrics()
    assert metrics["peer_fallbacks"] >= 1  # the stopped relay's pieces were read over the first's own link
    assert links[0].pack_bytes() > packs // 2
    assert metrics["own_bytes"] + metrics["peer_bytes"] == packs


class Damaging(WrappingStore):
    """An upstream whose packs have one byte flipped in their first MiB."""

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        data = self.inner.get(key, byte_range)
        start = byte_range[0] if byte_range is not None else 0
        if key.startswith("packs/") and start < 1000 <= start + len(data):
            out = bytearray(data)
            out[1000 - start] ^= 0xFF
            return bytes(out)
        return data


def test_a_peer_giving_bad_bytes_costs_one_retry_never_a_bad_version(tmp_path: Path, cluster: Any) -> None:
    repo = tmp_path / "repo"
    state, packs = publish(repo)
    (key,) = [p.key for p in Repository(str(repo)).manifest(1).pb.packs]
    members = [free_address(), free_address()]
    bad = (int.from_bytes(digest(key.encode())[:8], "big") + 0) % 2  # the relay whose link carries piece 0
    upstreams: list[Store] = [LocalStore(str(repo)), LocalStore(str(repo))]
    upstreams[bad] = Damaging(upstreams[bad])
    relays, _, _ = cluster(repo, upstreams=upstreams, members=members, warm=False)
    good = 1 - bad
    store = f"grpc://{members[good]}"  # read through the relay whose own link is sound
    with pytest.raises(DeltasyncError):
        Subscriber(store, progress=False).pull()  # the peer's damaged piece: refused, never swapped in
    got = Subscriber(store, progress=False).pull()  # the retry reads every piece over its own link
    assert same(dict(got), state)
    assert relays[good].metrics()["own_bytes"] >= packs


def test_cluster_relays_are_checked() -> None:
    with pytest.raises(UsageError, match="twice"):
        RelayConfig(listen="127.0.0.1:0", cluster_relays=["127.0.0.1:1", "127.0.0.1:1"])
    with pytest.raises(UsageError, match="at least two"):
        RelayConfig(listen="127.0.0.1:0", cluster_relays=["127.0.0.1:1"])
    with pytest.raises(UsageError, match="HOST:PORT"):
        RelayConfig(listen="127.0.0.1:0", cluster_relays=["127.0.0.1:1", "nohost"])
    with pytest.raises(UsageError, match="not among"):
        RelayConfig(listen="127.0.0.1:0", cluster_relays=["127.0.0.1:1", "127.0.0.1:2"], advertise="127.0.0.1:3")
    with pytest.raises(UsageError, match="give them too"):
        RelayConfig(listen="127.0.0.1:0", advertise="127.0.0.1:3")


def test_a_relay_not_in_its_cluster_list_refuses_to_start(tmp_path: Path) -> None:
    others = [free_address(), free_address()]
    with pytest.raises(UsageError, match="not among the cluster relays"):
        build_server(str(tmp_path), "127.0.0.1:0", cluster_relays=others).start()


def test_a_cluster_relays_link_cut_mid_version_resumes_bit_exact(tmp_path: Path) -> None:
    """Root relay -> two modelled links (real TCP proxies) -> a cluster of two relays -> a pull
    naming both; one link cut mid-version: its relay's reads resume, the pull is whole."""
    from benchmarks.wan_link import Link as WanLink

    repo = tmp_path / "repo"
    state, packs = publish(repo, mib=16)
    root = build_server(str(repo), "127.0.0.1:0").start()
    links = [WanLink(root.address, rtt=0.02, mbps=50).start() for _ in range(2)]
    members = [free_address(), free_address()]
    relays = [build_server(f"grpc://{link.address}", member, cluster_relays=members, warm=False,
                           fetch_piece_bytes=MiB).start() for link, member in zip(links, members, strict=True)]
    try:
        cut: list[float] = []
        done = threading.Event()

        def cutter() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not done.is_set():
                if links[0].counts()[1] >= 3 * MiB:
                    links[0].cut()
                    cut.append(time.monotonic())
                    return
                time.sleep(0.005)

        watcher = threading.Thread(target=cutter, daemon=True)
        watcher.start()
        got = dict(Subscriber("grpc://" + ",".join(members), progress=False).pull())
        finished = time.monotonic()
        done.set()
        watcher.join()
        assert cut and cut[0] < finished, "the link was not cut mid-version: the test did not test a cut"
        assert same(got, state)
        assert sum(link.counts()[1] for link in links) >= packs  # both links carried pieces
    finally:
        for relay in relays:
            relay.stop(grace=0)
        for link in links:
            link.stop()
        root.stop(grace=0)


class FarSizes(WrappingStore):
    """An upstream whose size requests take ``seconds`` (a long link's round trip)."""

    def __init__(self, inner: Store, seconds: float) -> None:
        super().__init__(inner)
        self.seconds = seconds

    def _size(self, key: str) -> int:
        time.sleep(self.seconds)
        return self.inner.size(key)


def test_cluster_relays_with_more_objects_than_workers_fetching_at_once_never_stall(tmp_path: Path,
                                                                                     cluster: Any) -> None:
    """Each relay asked at once for more distinct objects than it has ``workers``, the two in
    opposite orders: every download waits on pieces the other relay owns, of objects the other
    has not started yet (each size request takes 0.3 s, so every reader has asked, and each
    relay's download slots are taken by its own readers' objects, before any piece is read).
    Downloads once held the threads that serve those pieces (and start those downloads) on
    both relays, and each waited a peer read's whole deadline (120 s); a download a peer asks
    for now starts at once in a slot kept for peers, and every reader gets its object,
    bit-exact, with no peer read given up. (The bound only limits a failure.)"""
    origin = LocalStore(str(tmp_path / "origin"))
    objects: list[tuple[str, bytes]] = []
    for i in range(10):
        data = np.random.default_rng(i).bytes(3 * MiB)
        key = f"packs/{digest(data).hex()}.pack"
        origin.put(key, data)
        objects.append((key, data))
    far = FarSizes(origin, 0.3)
    relays, _, members = cluster(tmp_path, upstreams=[far, far], warm=False, workers=4)
    readers = [GrpcStore(f"grpc://{m}?timeout=300") for m in members]
    got: dict[tuple[int, str], bytes] = {}
    errors: list[BaseException] = []

    def read(i: int, key: str) -> None:
        try:
            got[i, key] = readers[i].get(key)
        except BaseException as e:  # handed to the test
            errors.append(e)

    threads = [threading.Thread(target=read, args=(i, key), daemon=True)
               for i in range(2) for key, _ in (objects if i == 0 else objects[::-1])]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 90
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    try:
        assert not any(thread.is_alive() for thread in threads), "reads of cluster relays stalled"
        assert not errors, errors
        assert all(got[i, key] == data for i in range(2) for key, data in objects)
        metrics = [relay.metrics() for relay in relays]
        assert all(m["peer_pieces"] > 0 for m in metrics)  # the objects were fetched in shares
        assert sum(m["peer_fallbacks"] for m in metrics) == 0  # and no peer read was given up
    finally:
        for store in readers:
            store.close()


def test_cluster_peers_are_read_with_the_read_token_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay whose environment holds a write token never sends it to its peers (they are only
    read): the read token when there is one, else no token."""
    from deltasync.relay.shares import PEER_METADATA, ClusterShares

    monkeypatch.setenv("DELTASYNC_RELAY_WRITE_TOKEN", "the-write-token")
    monkeypatch.delenv("DELTASYNC_RELAY_TOKEN", raising=False)
    monkeypatch.delenv("DELTASYNC_RELAY_TOKEN_FILE", raising=False)
    members = ["127.0.0.1:1", "127.0.0.1:2"]
    for token, sent in ((None, None), ("the-read-token", "Bearer the-read-token")):
        shares = ClusterShares(members, members[0], token=token)
        try:
            (peer,) = shares._peers.values()
            metadata = dict(peer._metadata)
            assert metadata.get("authorization") == sent
            assert metadata[PEER_METADATA] == "1"
        finally:
            shares.close()

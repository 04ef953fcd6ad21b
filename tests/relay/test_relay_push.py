"""Issue 30 item 2: a relay following a relay has a new version's packs pushed on the upstream's
Watch stream right after the event (relay/push.py), so none of them costs a round trip across
its link; a push that is dropped, cut, stalled, too large or not the pack's bytes is read from
the upstream as before, and nothing it does wrong reaches a reader."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_relay import wait_until
from test_relay_hints import (
    Counted,
    _next_version,
    _reader_reads,
    _state,
    tree as tree,  # the fixture
)

import deltasync
from deltasync.format.digest import digest
from deltasync.relay import push
from deltasync.relay.push import PushedPacks
from deltasync.repo.repository import Repository
from deltasync.storage import MemoryStore
from deltasync.storage._grpc import GrpcStore
from deltasync.v1 import relay_pb2 as pb

MiB = 1 << 20


def _second_version(repo: Path, reader: GrpcStore, counted: Counted, root: Any) -> int:
    """Versions 1 and 2 published and read through the cluster relay, as an agent reads them;
    the link's reads counted from version 2 only (the cluster relay may learn of version 1
    from its first poll, of version 2 from the stream it follows). The root relay's
    ``pushed_bytes`` before version 2."""
    pub = deltasync.Publisher(str(repo), deltasync.PublisherConfig(progress=False))
    watch = reader.watch(0)
    try:
        pub.publish(_state(1))
        _next_version(watch, 1)
        _reader_reads(reader, 1)
        counted.take()
        before = int(root.metrics()["pushed_bytes"])
        pub.publish(_state(2))
        _next_version(watch, 2)
        _reader_reads(reader, 2)  # each pack read whole through the cluster relay, sizes checked
    finally:
        watch.close()
    return before


@pytest.mark.parametrize("tree", [{}], indirect=True)
def test_a_new_versions_packs_come_with_its_event(tree: Any) -> None:
    repo, counted, cluster, top = tree
    reader = GrpcStore(f"grpc://{cluster.address}")
    pushed_before = _second_version(repo, reader, counted, top)
    packs = Repository(str(repo)).manifest(2).pb.packs
    for p in packs:  # the bytes the reader gets are the pack's own
        assert f"packs/{digest(reader.get(p.key)).hex()}.pack" == p.key
    wait_until(lambda: cluster.metrics()["push_landed"] >= len(packs), timeout=10)
    crossed = [k for op, k in counted.take() if op == "get" and k.startswith("packs/")]
    assert crossed == []  # no pack was asked for across the link: all came on the stream
    assert cluster.metrics()["push_missed"] == 0
    assert top.metrics()["pushed_bytes"] - pushed_before == sum(p.size for p in packs)
    # The version pulls bit for bit through the cluster relay.
    got = deltasync.Subscriber(f"grpc://{cluster.address}").pull(2)
    assert got.version == 2
    assert all(torch.equal(got[k].view(torch.int16), v.view(torch.int16)) for k, v in _state(2).items())


@pytest.mark.parametrize("tree", [{"push_bytes": 1 * MiB}], indirect=True)
def test_packs_over_the_push_size_are_read_as_before(tree: Any) -> None:
    repo, counted, cluster, top = tree
    _second_version(repo, GrpcStore(f"grpc://{cluster.address}"), counted, top)  # packs of over the 1 MiB asked for
    assert any(op == "get" and k.startswith("packs/") for op, k in counted.take())
    assert top.metrics()["pushed_bytes"] == 0
    assert cluster.metrics()["push_landed"] == 0


@pytest.mark.parametrize("tree", [{}], indirect=True)
def test_agents_are_pushed_nothing(tree: Any) -> None:
    repo, _, _, top = tree
    pieces: list[pb.PushedPiece] = []
    agent = GrpcStore(f"grpc://{top.address}")
    watch = agent.watch(0, on_piece=pieces.append)  # push_bytes 0: an agent's watch
    try:
        deltasync.Publisher(str(repo), deltasync.PublisherConfig(progress=False)).publish(_state(1))
        _next_version(watch, 1)
        assert watch.pushed == []
    finally:
        watch.close()
    assert pieces == []


# -- PushedPacks, fed by hand ----------------------------------------------------------------------


def _pack(n: int, seed: int = 0) -> tuple[str, bytes]:
    data = bytes((seed + i * 7) % 251 for i in range(n))
    return f"packs/{digest(data).hex()}.pack", data


def _pushes(*packs: tuple[str, bytes], limit: int = 64 * MiB) -> tuple[PushedPacks, MemoryStore]:
    upstream = MemoryStore()
    for key, data in packs:
        upstream.put(key, data)
    return PushedPacks(upstream, limit), upstream


def _feed(pushes: PushedPacks, key: str, data: bytes, piece: int = 1000) -> None:
    for off in range(0, len(data), piece):
        pushes.piece(pb.PushedPiece(key=key, offset=off, data=data[off : off + piece]))


def test_a_whole_pushed_pack_is_read_from_the_push() -> None:
    key, data = _pack(5000)
    pushes, upstream = _pushes((key, data))
    upstream.delete(key)  # so a read that went upstream would fail
    assert pushes.expect([pb.PushedObject(key=key, size=len(data))])
    reader = threading.Thread(target=lambda: got.append(pushes.get(key)))
    got: list[bytes] = []
    reader.start()  # it waits for the bytes
    _feed(pushes, key, data)
    reader.join(5)
    assert got == [data]
    assert pushes.get(key, (1000, 50)) == data[1000:1050]
    assert (pushes.landed, pushes.missed) == (1, 0)


@pytest.mark.parametrize("how", ["corrupt", "dropped", "gap", "overrun", "stream ended", "newer event"])
def test_a_push_gone_wrong_is_read_from_the_upstream(how: str) -> None:
    key, data = _pack(5000)
    pushes, _ = _pushes((key, data))
    pushes.expect([pb.PushedObject(key=key, size=len(data))])
    if how == "corrupt":
        _feed(pushes, key, data[:-1] + bytes([data[-1] ^ 1]))
    elif how == "dropped":
        _feed(pushes, key, data[:2000])
        pushes.piece(pb.PushedPiece(key=key, offset=2000, dropped=True))
    elif how == "gap":
        pushes.piece(pb.PushedPiece(key=key, offset=1000, data=data[1000:2000]))
    elif how == "overrun":
        pushes.piece(pb.PushedPiece(key=key, offset=0, data=data + b"x"))
    elif how == "stream ended":
        _feed(pushes, key, data[:3000])
        pushes.end()
    else:
        other, _ = _pack(10, seed=1)
        pushes.expect([pb.PushedObject(key=other, size=10)])
    assert pushes.get(key) == data  # the upstream's, not the push's
    assert (pushes.landed, pushes.missed) == (0, 1)
    _feed(pushes, key, data)  # too late: ignored
    assert pushes.landed == 0


def test_a_stalled_push_is_read_from_the_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(push, "STALL_SECONDS", 0.2)
    key, data = _pack(5000)
    pushes, _ = _pushes((key, data))
    pushes.expect([pb.PushedObject(key=key, size=len(data))])
    _feed(pushes, key, data[:1000])
    began = time.monotonic()
    assert pushes.get(key) == data
    assert 0.15 < time.monotonic() - began < 5
    assert pushes.missed == 1


def test_an_event_naming_more_than_was_asked_or_odd_keys_pushes_nothing() -> None:
    key, data = _pack(5000)
    pushes, _ = _pushes((key, data), limit=4000)
    assert pushes.expect([pb.PushedObject(key=key, size=len(data))]) == []  # over the limit
    pushes.limit = 64 * MiB
    assert pushes.expect([pb.PushedObject(key="refs/latest", size=10)]) == []  # not a pack
    assert pushes.expect([pb.PushedObject(key="packs/../x.pack", size=10)]) == []
    assert pushes.expect([pb.PushedObject(key=key, size=5000)] * 2) == []  # named twice
    _feed(pushes, key, data)  # not expected: ignored, read upstream
    assert pushes.get(key) == data
    assert pushes.landed == 0

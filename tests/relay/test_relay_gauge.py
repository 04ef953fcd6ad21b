"""Issue 30, item 2: a relay keeps as many ranged reads of its upstream in flight as the
upstream's measured round trip and rate ask for (relay/gauge.py), all fetches together,
bounded by memory; through the modelled long link, every byte still checked."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.wan_link import Link
from deltasync.format.digest import digest
from deltasync.relay import build_server
from deltasync.relay.gauge import UpstreamGauge
from deltasync.relay.server import RelayServer
from deltasync.storage import LocalStore
from deltasync.storage._grpc import GrpcStore

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _transfer(gauge: UpstreamGauge, clock: Clock, seconds: float, link_rate: float, rtt: float) -> None:
    """Pieces through a link of ``link_rate`` bytes/s and round trip ``rtt``, as many in flight
    as the gauge grants: each round trip moves min(the pieces in flight, the link's share)."""
    end = clock.now + seconds
    while clock.now < end:
        k = gauge.target
        for _ in range(k):
            gauge.acquire(0)
        moved = min(k * gauge.piece_bytes, link_rate * rtt)
        clock.now += rtt
        for _ in range(k):
            gauge.release(int(moved / k))


def test_pieces_in_flight_follow_the_measured_rate_and_round_trip() -> None:
    clock = Clock()
    gauge = UpstreamGauge(8 * MiB, most=64, clock=clock)
    assert gauge.target == 4  # before any measurement: the fixed number of before
    gauge.timed_round_trip(0.2)
    # 10 Gbit/s at 200 ms: 250 MB in flight, some 30 pieces of 8 MiB. Limited by the pieces in
    # flight at first, the rate measured is theirs per round trip: the number grows until the
    # link is the bound, then holds.
    _transfer(gauge, clock, 6.0, 1.25e9, 0.2)
    wanted = int(np.ceil(1.25 * 1.25e9 * 0.2 / (8 * MiB))) + 1  # with its quarter of headroom
    assert gauge.rate is not None and abs(gauge.rate - 1.25e9) < 0.05e9
    assert wanted - 1 <= gauge.target <= wanted + 1
    held = gauge.target
    _transfer(gauge, clock, 5.0, 1.25e9, 0.2)
    assert abs(gauge.target - held) <= 1  # stable once the link is the bound


def test_a_near_or_slow_upstream_keeps_four_and_memory_bounds_the_most() -> None:
    clock = Clock()
    near = UpstreamGauge(8 * MiB, most=32, clock=clock)
    near.timed_round_trip(0.001)
    _transfer(near, clock, 2.0, 1e9, 0.001)
    assert near.target == 4  # 1 GB/s x 1 ms is a piece: never fewer than before
    far = UpstreamGauge(8 * MiB, most=8, clock=clock)
    far.timed_round_trip(0.3)
    _transfer(far, clock, 20.0, 5e9, 0.3)
    assert far.target == 8  # the memory bound (fetch_pieces_in_flight)


def test_one_waiting_fetch_never_waits_with_nothing_in_flight() -> None:
    gauge = UpstreamGauge(MiB, most=4)
    for _ in range(4):
        gauge.acquire(0)
    got = threading.Event()

    def second_fetch() -> None:
        gauge.acquire(0)  # holds none: granted though the slots are taken
        got.set()

    t = threading.Thread(target=second_fetch)
    t.start()
    assert got.wait(5)
    t.join()
    blocked = threading.Event()

    def third() -> None:
        gauge.acquire(1)  # holds one already: waits for a slot
        blocked.set()

    t = threading.Thread(target=third)
    t.start()
    assert not blocked.wait(0.2)
    for _ in range(2):
        gauge.release(MiB)
    assert blocked.wait(5)
    t.join()


@contextlib.contextmanager
def far_relay(tmp_path: Path, mib: int, seed: int, mbps: float,
              **options: Any) -> Iterator[tuple[str, bytes, RelayServer, str]]:
    """A pack of ``mib`` MiB in a repository behind a root relay, and a cluster relay reading
    that one across a 200 ms link of ``mbps`` (``options``: the cluster relay's): (key, bytes,
    the cluster relay, the link's URL)."""
    origin = LocalStore(tmp_path / "origin")
    data = np.random.default_rng(seed).bytes(mib * MiB)
    key = f"packs/{digest(data).hex()}.pack"
    origin.put(key, data)
    root = build_server(str(tmp_path / "origin"), "127.0.0.1:0", tmp_path / "root-cache").start()
    link = Link(root.address, rtt=0.2, mbps=mbps).start()
    cluster = build_server(f"grpc://{link.address}", "127.0.0.1:0", tmp_path / "cluster-cache", **options).start()
    try:
        yield key, data, cluster, f"grpc://{link.address}"
    finally:
        cluster.stop(grace=0)
        link.stop()
        root.stop(grace=0)


def test_a_relay_reading_across_a_fast_long_link_keeps_more_pieces_in_flight(tmp_path: Path) -> None:
    with far_relay(tmp_path, 96, 3, 2400, fetch_piece_bytes=4 * MiB, warm=False) as (key, data, cluster, _):
        store = GrpcStore(cluster.url)
        assert store.get(key) == data  # streamed while it arrives, checked whole
        store.close()
        gauge = cluster.cache.gauge  # type: ignore[union-attr]
        assert gauge.round_trip is not None and 0.15 < gauge.round_trip < 1.0
        # 300 MB/s x 200 ms = 60 MB, some 15 pieces of 4 MiB: more than the fixed 4 of before
        assert gauge.peak_in_flight > 4, (gauge.peak_in_flight, gauge.rate, gauge.round_trip)


def test_fetches_that_send_no_size_request_claim_a_round_trip_timing_now_and_then() -> None:
    from deltasync.relay.gauge import ROUND_TRIP_EVERY

    clock = Clock()
    gauge = UpstreamGauge(8 * MiB, 32, clock=clock)
    assert gauge.claim_round_trip()  # none timed yet
    assert not gauge.claim_round_trip()  # one is being timed
    gauge.untimed()  # it failed: the next fetch may try
    assert gauge.claim_round_trip()
    gauge.timed_round_trip(0.2)
    assert gauge.round_trip == 0.2 and not gauge.claim_round_trip()
    clock.now += ROUND_TRIP_EVERY + 1
    assert gauge.claim_round_trip()


def test_a_piece_read_from_another_relay_holds_memory_but_no_request_slot() -> None:
    gauge = UpstreamGauge(8 * MiB, 3, least=1, start=1)
    assert gauge.try_acquire(0, 0)  # the link's one request slot
    assert not gauge.try_acquire(1, 1)  # taken
    assert gauge.try_hold(1) and gauge.try_hold(2)  # pieces of other relays: memory slots only
    assert not gauge.try_hold(3)  # the memory bound holds for them too
    gauge.written()
    assert gauge.try_hold(2)


def test_a_warming_relay_times_the_round_trip_of_its_upstream(tmp_path: Path) -> None:
    # Packs warmed by the sizes their manifest names send no size request: the round trip is
    # timed beside them, so the reads in flight follow the link (else they stay at 4).
    with far_relay(tmp_path, 24, 4, 800, warm=False) as (key, data, cluster, far):
        upstream = GrpcStore(far)
        try:
            cache = cluster.cache
            assert cache is not None and cache.gauge.round_trip is None
            entry = cache.fetch(key, upstream, size_hint=len(data))
            assert entry.path.read_bytes() == data
            deadline = time.monotonic() + 10
            while cache.gauge.round_trip is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert cache.gauge.round_trip is not None and cache.gauge.round_trip >= 0.15, cache.gauge.round_trip
        finally:
            upstream.close()

"""Issue 30: transfers across a modelled long link (benchmarks/wan_link.py, a real TCP proxy on
loopback) that is cut mid-object: a publish retries and commits whole, a read resumes, and no
partial version is ever visible."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import deltasync
from benchmarks.wan_link import Link
from deltasync.format.digest import digest
from deltasync.relay import build_server
from deltasync.storage import LocalStore
from deltasync.storage._grpc import GrpcStore

TOKEN = "wan-write-token-" + "x" * 16
MiB = 1 << 20


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[object]:
    (tmp_path / "repo").mkdir()
    server = build_server(str(tmp_path / "repo"), "127.0.0.1:0", tmp_path / "cache", accept_writes=True,
                          write_token=TOKEN, upload_window=4 * MiB).start()
    try:
        yield server
    finally:
        server.stop(grace=0)


def _cut_when(link: Link, direction: int, at_bytes: int, cuts: list[float],
              done: threading.Event) -> threading.Thread:
    """Cut every connection once ``at_bytes`` more have crossed ``direction`` (0 up, 1 down),
    unless ``done`` is set first (the transfer finished: a cut after it would test nothing)."""
    start = link.counts()[direction]

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not done.is_set():
            if link.counts()[direction] - start >= at_bytes:
                link.cut()
                cuts.append(time.monotonic())
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _state(seed: int, mib: int = 8) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {"w": torch.from_numpy(rng.integers(0, 1 << 15, mib * MiB // 2, dtype=np.int16)).view(torch.bfloat16)}


def test_a_publish_cut_mid_pack_retries_and_commits_one_whole_version(relay: object, tmp_path: Path) -> None:
    link = Link(relay.address, rtt=0.02, mbps=50).start()  # type: ignore[attr-defined]
    try:
        store = GrpcStore(f"grpc://{link.address}", write_token=TOKEN)
        pub = deltasync.Publisher(store, deltasync.PublisherConfig(progress=False))
        state = _state(1)
        cuts: list[float] = []
        done = threading.Event()
        watcher = _cut_when(link, 0, 3 * MiB, cuts, done)  # the 8 MiB of incompressible bits: mid-pack
        result = pub.publish(state)
        finished = time.monotonic()
        done.set()
        watcher.join()
        assert cuts and cuts[0] < finished, "the link was not cut mid-publish: the test did not test a cut"
        assert int(result) == 1
    finally:
        link.stop()
    local = LocalStore(tmp_path / "repo")
    assert [k for k in local.list("manifests/")] == ["manifests/00000000000000000001.pb"]
    for key in local.list("packs/"):  # whole packs only: each one's bytes match the digest in its name
        assert key == f"packs/{digest(local.get(key)).hex()}.pack"
    got = deltasync.Subscriber(str(tmp_path / "repo"), progress=False).pull()
    assert torch.equal(got["w"].view(torch.int16), state["w"].view(torch.int16))


def test_a_read_cut_mid_object_resumes_bit_exact(relay: object, tmp_path: Path) -> None:
    data = np.random.default_rng(2).bytes(12 * MiB)
    key = f"packs/{digest(data).hex()}.pack"
    LocalStore(tmp_path / "repo").put(key, data)
    link = Link(relay.address, rtt=0.02, mbps=50).start()  # type: ignore[attr-defined]
    try:
        store = GrpcStore(f"grpc://{link.address}")
        cuts: list[float] = []
        done = threading.Event()
        watcher = _cut_when(link, 1, 5 * MiB, cuts, done)
        got = store.get(key)
        finished = time.monotonic()
        done.set()
        watcher.join()
        assert cuts and cuts[0] < finished, "the link was not cut mid-read: the test did not test a cut"
        assert got == data
    finally:
        link.stop()


def test_a_cut_before_the_manifest_leaves_no_version_visible(relay: object, tmp_path: Path) -> None:
    # The link dies for good mid-upload: the publish fails, and readers see no version at all.
    link = Link(relay.address, rtt=0.02, mbps=200).start()  # type: ignore[attr-defined]
    store = GrpcStore(f"grpc://{link.address}?timeout=5", write_token=TOKEN)
    pub = deltasync.Publisher(store, deltasync.PublisherConfig(progress=False))
    cuts: list[float] = []
    start = link.counts()[0]

    def kill() -> None:
        while link.counts()[0] - start < 3 * MiB:
            time.sleep(0.005)
        link.stop()  # no new connections either
        cuts.append(time.monotonic())

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    with pytest.raises(deltasync.DeltasyncError):
        pub.publish(_state(3))
    killer.join(10)
    assert cuts
    assert list(LocalStore(tmp_path / "repo").list("manifests/")) == []
    assert deltasync.Repository(str(tmp_path / "repo")).latest() is None

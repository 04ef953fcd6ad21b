"""Packcast's node 0 reading a ``grpc://`` URL that names two relays, over real gRPC and a real
gloo group on 127.0.0.1: node 0's reads of a version's objects start at the relay each key
hashes to (``GrpcStore._read_shard``), so each relay fetches its share from the upstream and
serves it, no pack crosses two relays' upstream links, and every node ends bit-exact.

This is the mechanism the 1 TB projection (benchmarks/bench_projection.py) charges the WAN
with when a cluster's relays run without warming (``--no-warm``): a relay that warms fetches
every object of a version it learns of, whatever its share of the reads."""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import deltasync
from deltasync.format.codec import PlanesZstdCodec
from deltasync.relay.server import RelayServer, build_server
from deltasync.storage import LocalStore, Store, WrappingStore
from deltasync.testing import spawn_ranks

VERSIONS = 3
WORLD = 2


def _states() -> list[dict[str, torch.Tensor]]:
    """Versions whose every element moves: dense chunks, so each version stores several 64 KiB packs."""
    g = torch.Generator().manual_seed(11)
    out = [{f"layers.{i}.weight": torch.randn(256, 256, generator=g).bfloat16() for i in range(8)}]
    for _ in range(VERSIONS - 1):
        out.append({n: (t.float() + 0.01 * torch.randn(t.shape, generator=g)).bfloat16() for n, t in out[-1].items()})
    return out


class CountingStore(WrappingStore):
    """Delegates to ``inner``; counts the bytes read per key (a relay's upstream link)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.read: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        data = self.inner.get(key, byte_range)
        with self._lock:
            self.read[key] += len(data)
        return data


def _node(rank: int, port: int, url: str, queue: Any) -> None:
    from deltasync.engines import TorchEngine
    from deltasync.engines.packcast import PackCache, PackcastNode

    try:
        torch.set_num_threads(1)
        cache = PackCache(url)
        states = _states()
        held = {n: torch.zeros_like(t) for n, t in states[0].items()}
        engine = TorchEngine(held, cache, workers=1)
        node = PackcastNode(engine, cache, rank=rank, world=WORLD, master=f"127.0.0.1:{port}", timeout=60.0,
                            piece_bytes=16 << 10)
        exact = []
        for v in range(1, VERSIONS + 1):
            if rank == 0:
                node.update(v)
            else:
                node.follow(rounds=1)
            exact.append(all(torch.equal(held[n].view(torch.int16), t.view(torch.int16))
                             for n, t in states[v - 1].items()))
        if rank == 0:
            node.close()
        queue.put((rank, {"exact": exact, "reports": node.reports}, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


@pytest.fixture
def relays(tmp_path: Path) -> Iterator[tuple[list[RelayServer], list[CountingStore], LocalStore]]:
    """A published repository and two relays in front of it (no warming), each reading it
    through its own counted upstream link; stopped at the end."""
    repo = tmp_path / "repo"
    pub = deltasync.Publisher(str(repo), deltasync.PublisherConfig(
        codec=PlanesZstdCodec(chunk_bytes=16 << 10), pack_bytes=64 << 10, progress=False))
    for state in _states():
        pub.publish(state)
    origin = LocalStore(repo)
    links = [CountingStore(LocalStore(repo)) for _ in range(2)]
    servers = [build_server(link, "127.0.0.1:0", warm=False, poll_interval=0.05).start() for link in links]
    yield servers, links, origin
    for server in servers:
        server.stop(grace=0)


@pytest.mark.slow
def test_node_0_reads_each_pack_through_the_relay_its_key_names(
    relays: tuple[list[RelayServer], list[CountingStore], LocalStore],
) -> None:
    servers, links, origin = relays
    url = "grpc://" + ",".join(s.url.removeprefix("grpc://") for s in servers)
    out = spawn_ranks(_node, WORLD, lambda r, port, q: (r, port, url, q), timeout=300)
    for rank, res in out.items():
        assert res["exact"] == [True] * VERSIONS, rank
        assert all(rep.error is None for rep in res["reports"]), rank
    packs = {k: origin.size(k) for k in origin.list("packs/")}
    fetched = [{k for k in link.read if k.startswith("packs/")} for link in links]
    # Each relay fetched a share of the packs over its own upstream link, none fetched by both,
    # every pack of every version by one of them, each whole and once.
    assert fetched[0] and fetched[1], [len(f) for f in fetched]
    assert not fetched[0] & fetched[1]
    assert fetched[0] | fetched[1] == set(packs)
    for link in links:
        for key in link.read:
            if key.startswith("packs/"):
                assert link.read[key] == packs[key], key
    served = [s.metrics()["served_bytes"] for s in servers]
    shares = [sum(packs[k] for k in f) for f in fetched]
    for i in range(2):
        assert served[i] >= shares[i]  # what it fetched it served (ranges of it, to node 0)
    # Node 0 read the version's bytes from the two relays together; node 1 from the group.
    read = sum(rep.upstream_bytes for rep in out[0]["reports"])
    assert read >= sum(packs.values())
    assert sum(served) >= read
    assert sum(rep.upstream_bytes for rep in out[1]["reports"]) < sum(packs.values()) // 10

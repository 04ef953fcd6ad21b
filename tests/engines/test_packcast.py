"""Packcast across real gloo groups of node processes on 127.0.0.1: every node's engine bit-exact at
every version from stored bytes broadcast once; a corrupt piece, a late joiner and a dead node
all end bit-exact from the repository, and a dead node holds the others up for one timeout."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import pytest
import torch

import deltasync
from deltasync.format.codec import PlanesZstdCodec
from deltasync.testing import spawn_ranks

VERSIONS = 4


def _states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    state = {
        "w": torch.randn(96, 64, generator=g).bfloat16(),
        "b": torch.randn(64, generator=g),
        "e": torch.randn(40, 8, generator=g, dtype=torch.float64),
    }
    out = []
    for step in range(VERSIONS):
        state = {k: v.clone() for k, v in state.items()}
        if step:
            for t in state.values():
                flat = t.view(-1)
                for j in range(5):
                    flat[(step * 97 + j * 31) % flat.numel()] += 1
            if step == 2:
                state["b"] += 0.25  # every element: dense chunks
        out.append(state)
    return out


#: The membership timeout where a node dies or comes late: long enough that a node merely slow
#: to start on a loaded machine is not left out of the first round (which the checks assume).
SHORT = 8.0

def _publish(repo: str) -> None:
    pub = deltasync.Publisher(repo, deltasync.PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=1024)))
    for s in _states():
        pub.publish(s)


def _check(held: dict[str, torch.Tensor], version: int) -> None:
    for name, want in _states()[version - 1].items():
        if not torch.equal(held[name].view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)):
            raise AssertionError(f"{name} differs from version {version}")


def _node(rank: int, world: int, port: int, repo: str, scenario: str, gate: Any, queue: Any) -> None:
    from deltasync.engines import TorchEngine
    from deltasync.engines.packcast import PackCache, PackcastNode
    from deltasync.errors import GroupError

    try:
        torch.set_num_threads(1)
        if scenario == "late" and rank == world - 1:
            gate[0].wait(60)  # joins after node 0's second round
        cache = PackCache(repo)
        if scenario == "corrupt" and rank == 2:
            real = cache.offer

            def damaged(key: str, data: bytes) -> bool:  # round 2: a pack; round 3: a manifest
                hit = (key.startswith("packs/") and len(node.reports) == 1) or (
                    key.startswith("manifests/") and len(node.reports) == 2
                )
                if hit:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                return real(key, data)

            cache.offer = damaged  # type: ignore[method-assign]
        if scenario == "dies_mid" and rank == 2:
            real_offer = cache.offer

            def dies(key: str, data: bytes) -> bool:  # round 3: gone once the first pack has arrived
                if key.startswith("packs/") and len(node.reports) == 2:
                    os._exit(0)
                return real_offer(key, data)

            cache.offer = dies  # type: ignore[method-assign]
        held = {n: torch.zeros_like(t) for n, t in _states()[0].items()}
        engine = TorchEngine(held, cache, workers=1)
        timeout = SHORT if scenario in ("dead", "late", "dies_mid", "root_dies") else 30.0
        node = PackcastNode(engine, cache, rank=rank, world=world, master=f"127.0.0.1:{port}", timeout=timeout,
                            piece_bytes=512)
        if scenario == "late" and rank == world - 1:
            gate[1].set()  # joined: node 0 waits for it from its next round on
        out: dict[str, Any] = {"versions": [], "reports": node.reports, "seconds": []}
        first = 3 if scenario == "late" and rank == world - 1 else 1
        for v in range(first, VERSIONS + 1):
            if scenario == "dead" and rank == 2 and v == 3:
                os._exit(0)  # dies between rounds, without a word
            if scenario == "root_dies" and v == 3:
                if rank == 0:
                    # Once both others hold version 2 (a node late for round 2 would find node 0's
                    # store gone while it waits for that round, not for round 3).
                    gate[0].wait(60)
                    gate[1].wait(60)
                    os._exit(0)
                waiting = time.monotonic()
                try:
                    node.follow(rounds=1)
                except GroupError as e:
                    out["lost"] = (str(e), time.monotonic() - waiting)
                # ... and goes on from the repository through the same cache
                engine.update(VERSIONS)
                _check(held, VERSIONS)
                out["versions"].append(engine.version)
                break
            start = time.monotonic()
            if rank == 0:
                node.update(v)
            else:
                node.follow(rounds=1)
            out["seconds"].append(time.monotonic() - start)
            _check(held, v)
            out["versions"].append(engine.version)
            if scenario == "late" and rank == 0 and v == 2:
                gate[0].set()
                gate[1].wait(60)
            if scenario == "root_dies" and rank and v == 2:
                gate[rank - 1].set()
        if rank == 0:
            node.close()
        out["rejected"] = list(cache.rejected)
        queue.put((rank, out, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def _run(tmp_path: Any, world: int, scenario: str, expect: int | None = None) -> dict[int, Any]:
    import multiprocessing as mp

    repo = str(tmp_path / "repo")
    _publish(repo)
    ctx = mp.get_context("spawn")
    gate = (ctx.Event(), ctx.Event())
    return spawn_ranks(_node, world, lambda r, port, q: (r, world, port, repo, scenario, gate, q), expect=expect,
                       timeout=120)


@pytest.mark.slow
def test_every_node_bit_exact_from_one_fetch(tmp_path: Any) -> None:
    out = _run(tmp_path, 4, "happy")
    for rank, res in out.items():
        assert res["versions"] == [1, 2, 3, 4], rank
        for rep in res["reports"]:
            assert rep.members == (0, 1, 2, 3) and rep.broadcast_error is None and not rep.repaired
            if rank:  # followers read nothing from the repository's packs: all came over the group
                assert rep.received_bytes > 0
    # Node 0 fetched each version once; the others received what it fetched.
    for v in range(VERSIONS):
        fetched = out[0]["reports"][v].upstream_bytes
        assert fetched > 0
        for rank in (1, 2, 3):
            rep = out[rank]["reports"][v]
            assert rep.received_bytes <= fetched
            assert rep.upstream_bytes < rep.received_bytes  # a few small reads (format marker, listings)
        # The chain 0 -> 1 -> 2 -> 3: every link carries the stream once, node 0's included.
        stream = out[1]["reports"][v].link_received
        assert stream > 0 and out[0]["reports"][v].link_sent == stream
        assert [out[r]["reports"][v].link_received for r in (1, 2, 3)] == [stream] * 3
        assert [out[r]["reports"][v].link_sent for r in (1, 2, 3)] == [stream, stream, 0]


@pytest.mark.slow
def test_corrupt_pieces_are_repaired_from_the_repository(tmp_path: Any) -> None:
    out = _run(tmp_path, 3, "corrupt")
    for res in out.values():
        assert res["versions"] == [1, 2, 3, 4]
    bad = out[2]
    assert bad["rejected"] and all(k.startswith("packs/") for k in bad["rejected"])  # refused on arrival
    r2, r3 = bad["reports"][1], bad["reports"][2]
    assert r2.upstream_bytes > 0 and not r2.repaired  # the pack refused was read from the repository
    assert r3.repaired  # a manifest that does not parse: the round was staged again from the repository
    assert not any(r.repaired for r in out[1]["reports"])


@pytest.mark.slow
def test_late_joiner_catches_up_then_follows(tmp_path: Any) -> None:
    out = _run(tmp_path, 4, "late")
    assert out[3]["versions"] == [3, 4]
    first = out[3]["reports"][0]
    assert 3 in first.members and first.upstream_bytes > 0  # the chain up to v2 came from the repository
    assert out[0]["reports"][0].members == (0, 1, 2)  # round 1 went on without it, after the timeout
    assert out[0]["reports"][2].members == (0, 1, 2, 3)
    for rank in (0, 1, 2):
        assert out[rank]["versions"] == [1, 2, 3, 4]


@pytest.mark.slow
def test_dead_node_blocks_the_others_one_timeout(tmp_path: Any) -> None:
    out = _run(tmp_path, 4, "dead", expect=3)
    assert sorted(out) == [0, 1, 3]
    for res in out.values():
        assert res["versions"] == [1, 2, 3, 4]
    r3 = out[0]["reports"][2]
    assert r3.members == (0, 1, 3) and r3.broadcast_error is None
    assert out[0]["seconds"][2] < SHORT + 10.0  # the timeout, then on without it
    assert out[0]["reports"][3].members == (0, 1, 3)


@pytest.mark.slow
def test_node_dying_mid_broadcast_the_others_finish_from_the_repository(tmp_path: Any) -> None:
    out = _run(tmp_path, 4, "dies_mid", expect=3)
    assert sorted(out) == [0, 1, 3]
    for res in out.values():
        assert res["versions"] == [1, 2, 3, 4]  # bit-exact: what did not arrive came from the repository
    assert out[0]["seconds"][2] < 2 * SHORT + 10.0
    assert out[0]["reports"][3].members == (0, 1, 3)  # a fresh group without it
    for rank in (0, 1, 3):
        assert out[rank]["reports"][3].broadcast_error is None


@pytest.mark.slow
def test_node_0_dying_the_others_go_on_from_the_repository(tmp_path: Any) -> None:
    out = _run(tmp_path, 3, "root_dies", expect=2)
    for rank in (1, 2):
        assert out[rank]["versions"] == [1, 2, VERSIONS]
        message, waited = out[rank]["lost"]
        assert "node 0" in message and waited < 30.0  # told, not left waiting


def test_pack_cache_spills_beyond_its_memory_and_reads_back_exactly(tmp_path: Any) -> None:
    from deltasync.engines.packcast import PackCache
    from deltasync.format.digest import digest
    from deltasync.storage import MemoryStore

    upstream = MemoryStore()
    packs = {f"packs/{digest(d).hex()}.pack": d for d in (os.urandom(3000), os.urandom(5000), os.urandom(7000))}
    for key, data in packs.items():
        upstream.put(key, data)
    cache = PackCache(upstream, memory_bytes=4000, spill_dir=tmp_path / "spill")
    cache.expect(packs)
    for key, data in packs.items():
        assert cache.offer(key, data)
    assert cache.spilled_bytes == 12000 and len(list((tmp_path / "spill").iterdir())) == 2  # 3000 fit in memory
    first, second, third = packs
    assert cache.get(second, (100, 50)) == packs[second][100:150]  # a range of a spilled pack
    for key, data in packs.items():
        assert cache.get(key) == data  # whole: handed over, then forgotten
    assert cache.upstream_bytes == 0 and not list((tmp_path / "spill").iterdir())
    assert cache.get(third) == packs[third] and cache.upstream_bytes == 7000  # gone: read from upstream
    assert not cache.offer(first, b"not it") and cache.rejected == [first]
    cache.expect([second])
    assert cache.offer(second, packs[second])
    cache.forget()
    assert not list((tmp_path / "spill").iterdir())


def test_a_node_is_refused_what_it_cannot_do(tmp_path: Any) -> None:
    from deltasync.engines import TorchEngine
    from deltasync.engines.packcast import PackCache, PackcastNode
    from deltasync.errors import UsageError

    repo = str(tmp_path / "repo")
    _publish(repo)
    cache = PackCache(repo)
    held = {n: torch.zeros_like(t) for n, t in _states()[0].items()}
    with pytest.raises(UsageError, match="through the PackCache"):
        PackcastNode(TorchEngine(held, repo), cache, rank=0, world=2, master="127.0.0.1:1")
    engine = TorchEngine(held, cache)
    with pytest.raises(UsageError, match="rank must be"):
        PackcastNode(engine, cache, rank=2, world=2, master="127.0.0.1:1")
    with pytest.raises(UsageError, match="master"):
        PackcastNode(engine, cache, rank=0, world=2)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="nccl"):
            PackcastNode(engine, cache, rank=0, world=2, master="127.0.0.1:1", backend="nccl")

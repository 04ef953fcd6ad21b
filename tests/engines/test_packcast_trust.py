"""Packcast's store is reachable by others: node 0 listens only where told, records written into
it from outside (a plain TCPStore client) do not move followers back with a token, and a round
counter forged far ahead does not freeze them. Real gloo groups of 3 processes on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch

import deltasync
from deltasync.format.codec import PlanesZstdCodec
from deltasync.testing import free_port, spawn_ranks

VERSIONS = 4
TOKEN = b"a shared secret of this cluster"


def _states() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)}
    out = []
    for step in range(VERSIONS):
        state = {k: v.clone() for k, v in state.items()}
        state["w"][step] += 1
        out.append(state)
    return out


def _publish(repo: str) -> None:
    pub = deltasync.Publisher(repo, deltasync.PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=256)))
    for s in _states():
        pub.publish(s)


def _holds(held: dict[str, torch.Tensor], version: int) -> bool:
    return all(torch.equal(held[n], t) for n, t in _states()[version - 1].items())


def _outsider(port: int) -> Any:
    """A plain client of node 0's store, as anyone who reaches the port is."""
    import torch.distributed as dist

    plain = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=10))  # type: ignore[attr-defined]
    return dist.PrefixStore("deltasync-packcast", plain)  # type: ignore[attr-defined]


def _node(rank: int, world: int, port: int, repo: str, scenario: str, queue: Any) -> None:
    import time

    from deltasync.engines import TorchEngine
    from deltasync.engines.packcast import PackCache, PackcastNode

    try:
        torch.set_num_threads(1)
        cache = PackCache(repo)
        held = {n: torch.zeros_like(t) for n, t in _states()[0].items()}
        engine = TorchEngine(held, cache, workers=1)
        extra: dict[str, Any] = {"token": TOKEN} if scenario == "forged_header" else {}
        node = PackcastNode(engine, cache, rank=rank, world=world, master=f"127.0.0.1:{port}", timeout=4.0,
                            piece_bytes=256, **extra)
        if rank == 0 and scenario == "forged_counter":
            _outsider(port).set("next", str(10**9))  # before the followers join (they read it then)
        versions: list[int | None] = []
        for v in range(1, VERSIONS + 1):
            if rank == 0:
                if v == 3:
                    out = _outsider(port)
                    if scenario == "forged_header":
                        # Round 3 named by someone else: version 1 (older than the followers hold).
                        forged = {"version": 1, "members": list(range(world)), "epoch": 99, "classes": []}
                        out.set("round/3", json.dumps(forged))
                    out.set("next", str(10**9))
                    time.sleep(2.5)  # the followers see it (they look every 50 ms, resync every 1 s)
                node.update(v)
            else:
                node.follow(rounds=1)
            versions.append(engine.version)
            if not _holds(held, v):
                raise AssertionError(f"node {rank} does not hold version {v} after round {v}")
        if rank == 0:
            node.close()
        queue.put((rank, {"versions": versions, "members": [r.members for r in node.reports]}, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def _run(tmp_path: Any, scenario: str) -> dict[int, Any]:
    repo = str(tmp_path / "repo")
    _publish(repo)
    return spawn_ranks(_node, 3, lambda r, port, q: (r, 3, port, repo, scenario, q), timeout=90)


def test_node_0_listens_only_where_told(tmp_path: Any) -> None:
    from deltasync.engines import TorchEngine
    from deltasync.engines.packcast import PackCache, PackcastNode

    repo = str(tmp_path / "repo")
    _publish(repo)
    cache = PackCache(repo)
    engine = TorchEngine({n: torch.zeros_like(t) for n, t in _states()[0].items()}, cache, workers=1)
    port = free_port()
    node = PackcastNode(engine, cache, rank=0, world=2, master=f"127.0.0.1:{port}", timeout=2.0)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        # Another address of this machine (the loopback answers all of 127/8): nothing listens there.
        with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=2):
            pass
    finally:
        node.close()


@pytest.mark.slow
def test_a_header_written_from_outside_is_refused_with_a_token(tmp_path: Any,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    out = _run(tmp_path, "forged_header")
    for rank, res in out.items():
        assert res["versions"] == [1, 2, 3, 4], rank  # never back to the forged version 1
        assert all(m == (0, 1, 2) for m in res["members"]), (rank, res["members"])


@pytest.mark.slow
def test_a_round_counter_forged_far_ahead_does_not_freeze_followers(tmp_path: Any) -> None:
    out = _run(tmp_path, "forged_counter")
    for rank, res in out.items():
        assert res["versions"] == [1, 2, 3, 4], rank
        assert all(m == (0, 1, 2) for m in res["members"]), (rank, res["members"])


def test_a_member_without_the_token_is_not_taken_in(tmp_path: Any) -> None:
    from deltasync.engines import TorchEngine
    from deltasync.engines.packcast import PackCache, PackcastNode
    from deltasync.errors import GroupError, UsageError

    repo = str(tmp_path / "repo")
    _publish(repo)
    port = free_port()

    def make(rank: int, token: bytes | None) -> PackcastNode:
        cache = PackCache(repo)
        engine = TorchEngine({n: torch.zeros_like(t) for n, t in _states()[0].items()}, cache, workers=1)
        return PackcastNode(engine, cache, rank=rank, world=2, master=f"127.0.0.1:{port}", timeout=2.0, token=token)

    node0 = make(0, TOKEN)
    try:
        with pytest.raises(GroupError, match="token"):
            make(1, b"another secret")
        with pytest.raises(UsageError, match="empty"):
            make(1, b"")
        # A ready record from outside (no MAC) does not make rank 1 a member.
        _outsider(port).set("ready/1/1", json.dumps({"ok": True, "version": None}))
        report = node0.update(1)
        assert report.members == (0,)
    finally:
        node0.close()


# -- signed refs forwarded with each round: agents with --trusted-key ---------------------------------


def _agent(rank: int, port: int, repo: str, pub: str, state: str, events: Any, queue: Any) -> None:
    import threading
    import time

    from deltasync.agents import AgentConfig, PackcastAgent, PackcastOptions
    from deltasync.engines import TorchEngine

    try:
        torch.set_num_threads(1)
        held = {n: torch.zeros_like(t) for n, t in _states()[0].items()}
        engine = TorchEngine(held, repo, workers=1, trusted_keys=pub)
        node = PackcastOptions(rank=rank, world=2, master=f"127.0.0.1:{port}", timeout=4.0)
        agent = PackcastAgent(engine, state, AgentConfig(poll_interval=0.05), packcast=node, trusted_keys=pub)
        runner = threading.Thread(target=agent.run, kwargs={"follow": True}, daemon=True)
        runner.start()
        seen: list[int | None] = []
        for want, ev in ((3, events[0]), (4, None)):
            deadline = time.monotonic() + 60
            while agent.current() != want and time.monotonic() < deadline:
                seen.append(agent.current())
                time.sleep(0.05)
            if agent.current() != want or not _holds(held, want):
                raise AssertionError(f"node {rank} holds {agent.current()}, not {want}")
            if ev is not None and rank == 1:
                ev.set()  # at 3: the test forges a round, waits, then publishes 4
                while not events[1].is_set():
                    seen.append(agent.current())
                    time.sleep(0.02)
        events[2].wait(60)
        agent.stop()
        runner.join(30)
        queue.put((rank, {"seen": seen}, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


@pytest.mark.slow
def test_a_trusting_follower_refuses_a_round_its_signed_refs_do_not_name(tmp_path: Any) -> None:
    import multiprocessing as mp
    import threading
    import time

    from deltasync.format.signing import generate_keypair

    key, pub, _ = generate_keypair(tmp_path / "keys" / "k")
    repo = str(tmp_path / "repo")
    publisher = deltasync.Publisher(repo, deltasync.PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=256)),
                                    signing_key=key)
    states = _states()
    publisher.publish(states[0])
    old_latest = (tmp_path / "repo" / "refs" / "latest").read_text()  # signed, naming version 1
    for s in states[1:3]:
        publisher.publish(s)
    ctx = mp.get_context("spawn")
    events = (ctx.Event(), ctx.Event(), ctx.Event())
    result: dict[str, Any] = {}

    def drive(port: int) -> None:
        try:
            if not events[0].wait(90):
                return
            store = _outsider(port)
            n = int(store.get("next"))
            forged = {"version": 1, "members": [0, 1], "epoch": 99, "classes": [],
                      "note": {"latest": 1, "refs": {"refs/latest": old_latest, "refs/pin": None}}}
            store.set(f"round/{n}", json.dumps(forged))  # a replayed signed ref naming version 1
            time.sleep(3)
            store.set(f"round/{n + 1}", json.dumps({**forged, "note": {}}))  # no refs at all
            time.sleep(3)
            publisher.publish(states[3])
        except BaseException as e:
            result["error"] = e
        finally:
            events[1].set()

    ports: list[int] = []

    def args(r: int, port: int, q: Any) -> tuple[Any, ...]:
        if not ports:
            ports.append(port)
            threading.Thread(target=drive, args=(port,), daemon=True).start()
        return (r, port, repo, str(pub), str(tmp_path / f"state{r}"), events, q)

    def finish() -> None:
        events[1].wait(120)
        time.sleep(6)
        events[2].set()

    threading.Thread(target=finish, daemon=True).start()
    out = spawn_ranks(_agent, 2, args, timeout=150)
    assert "error" not in result, result
    assert 1 not in out[1]["seen"] and 2 not in [v for v in out[1]["seen"][out[1]["seen"].index(3):]], out[1]["seen"]


def test_the_token_file_is_read_or_refused_with_its_name(tmp_path: Any) -> None:
    from deltasync.agents.packcast_spec import read_token
    from deltasync.errors import UsageError

    good = tmp_path / "token"
    good.write_text("  s3cret\n")
    assert read_token(good) == b"s3cret"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(UsageError, match="empty"):
        read_token(empty)
    with pytest.raises(UsageError, match="missing"):
        read_token(tmp_path / "missing")


def test_subscribe_reads_the_token_file_from_the_flag_or_the_environment(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    (tmp_path / "empty").write_text("")
    base = [sys.executable, "-m", "deltasync", "subscribe", "--repo", str(tmp_path / "repo"), "--state", "S",
            "--engine", "torch:m:f", "--packcast", "0/2@127.0.0.1:1"]
    for extra, env in ((["--packcast-token-file", "empty"], {}), ([], {"DELTASYNC_PACKCAST_TOKEN_FILE": "empty"})):
        done = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                              env={**os.environ, **env})
        assert done.returncode != 0 and "--packcast-token-file empty is empty" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr

"""Packcast in the agents and the command line: `subscribe --packcast` on real node processes
(each a real gloo member, its own state directory), shard-aware nodes receiving only their share
of each version, and what is refused up front."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import deltasync
from deltasync.errors import UsageError
from deltasync.format.codec import PlanesZstdCodec
from deltasync.testing import free_port, spawn_ranks

VERSIONS = 4


def _states(versions: int = VERSIONS) -> list[dict[str, torch.Tensor]]:
    """Versions of a small model: 1% of the elements of every tensor change per version (rows
    all over each tensor), and at version 3 every element of ``b`` (dense chunks)."""
    g = torch.Generator().manual_seed(5)
    state = {
        "w": torch.randn(1024, 256, generator=g).bfloat16(),
        "b": torch.randn(256, generator=g),
        "e": torch.randn(64, 32, generator=g, dtype=torch.float64),
        "s": torch.randn(3, generator=g),  # fewer rows than shards: held whole by every shard
    }
    out = []
    for step in range(versions):
        state = {k: v.clone() for k, v in state.items()}
        if step:
            for t in state.values():
                flat = t.view(-1)
                at = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=g)
                flat[at] += 1
            if step == 2:
                state["b"] += 0.25
        out.append(state)
    return out


def _publisher(repo: str) -> deltasync.Publisher:
    return deltasync.Publisher(repo, deltasync.PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=8192)))


# -- shard-aware nodes, library form ----------------------------------------------------------------

#: What each rank holds: None, every tensor; (I, N), the I-th of N row slices of each; a tuple
#: of names, those tensors whole (as `--tensors` picks them).
SHARDS: dict[int, tuple[int, int] | tuple[str, ...] | None] = {0: None, 1: (0, 4), 2: (3, 4), 3: (3, 4), 4: ("e", "s")}


def _shard_node(rank: int, world: int, port: int, repo: str, queue: Any) -> None:
    from deltasync.engines import TorchEngine
    from deltasync.engines.packcast import PackCache, PackcastNode
    from deltasync.format.slices import Slice

    try:
        torch.set_num_threads(1)
        full = {n: torch.zeros_like(t) for n, t in _states()[0].items()}
        shard = SHARDS[rank]
        held: dict[str, Any] = dict(full)
        if shard is not None and isinstance(shard[0], str):
            held = {name: full[name] for name in shard}
        elif shard is not None:
            i, n = shard
            assert isinstance(i, int) and isinstance(n, int)
            for name, t in full.items():
                rows = t.shape[0]
                if rows >= n:
                    start, stop = i * rows // n, (i + 1) * rows // n
                    held[name] = Slice(t[start:stop], (start, *(0,) * (t.dim() - 1)), tuple(t.shape))
        cache = PackCache(repo)
        engine = TorchEngine(held, cache, workers=1)
        node = PackcastNode(engine, cache, rank=rank, world=world, master=f"127.0.0.1:{port}", timeout=30.0,
                            piece_bytes=7000)
        out: dict[str, Any] = {"versions": []}
        for v in range(1, VERSIONS + 1):
            if rank == 0:
                node.update(v)
            else:
                node.follow(rounds=1)
            want = _states()[v - 1]
            for name, value in held.items():
                got, ref = (value.tensor, want[name][value.offsets[0] : value.offsets[0] + value.tensor.shape[0]]) \
                    if isinstance(value, Slice) else (value, want[name])
                if not torch.equal(got.contiguous().view(-1).view(torch.uint8), ref.contiguous().view(-1).view(torch.uint8)):
                    raise AssertionError(f"rank {rank}: {name} differs from version {v}")
            out["versions"].append(engine.version)
        if rank == 0:
            node.close()
        out["reports"] = node.reports
        queue.put((rank, out, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


@pytest.mark.slow
def test_shard_nodes_receive_only_their_share_bit_exact(tmp_path: Path) -> None:
    repo = str(tmp_path / "repo")
    pub = _publisher(repo)
    for s in _states():
        pub.publish(s)
    out = spawn_ranks(_shard_node, 5, lambda r, port, q: (r, 5, port, repo, q), timeout=150)
    for rank, res in out.items():
        assert res["versions"] == [1, 2, 3, 4], rank  # and every held slice checked bit-exact at each
    for v in range(VERSIONS):
        whole = out[0]["reports"][v]
        # Node 0 read the version from the repository once (its manifest, the packs it needs).
        assert whole.upstream_bytes > 0 and whole.members == (0, 1, 2, 3, 4) and whole.broadcast_error is None
        manifest = (Path(repo) / "manifests" / f"{v + 1:020d}.pb").stat().st_size  # every node receives it whole
        packs = whole.received_bytes - manifest
        first, last, twin = (out[r]["reports"][v] for r in (1, 2, 3))
        for rep in (first, last, twin):
            assert not rep.repaired and rep.broadcast_error is None
            # A quarter of each tensor's rows (and the small tensor whole): well under what a
            # whole node receives; what else it reads (the format marker), from the relay.
            assert 0 < rep.received_bytes - manifest < 0.5 * packs, (v, rep, whole)
            assert rep.upstream_bytes < 1000
        assert last.received_bytes == twin.received_bytes  # one class, one stream
        # Two small tensors of four (w is 97% of the model): the chunks of those alone.
        some = out[4]["reports"][v]
        assert not some.repaired and 0 < some.received_bytes - manifest < 0.2 * packs, (v, some, whole)
        assert (first.received_bytes - manifest) + (last.received_bytes - manifest) < 0.75 * packs


# -- the command line: three node processes ---------------------------------------------------------

FACTORY = '''
import torch

def build():
    g = torch.Generator().manual_seed(11)
    return {"w": torch.randn(1024, 256, generator=g).bfloat16(), "b": torch.zeros(256),
            "e": torch.zeros(64, 32, dtype=torch.float64), "s": torch.zeros(3)}
'''


class _Nodes:
    def __init__(self, tmp_path: Path, repo: str, world: int, extra: dict[int, list[str]] | None = None) -> None:
        (tmp_path / "packcast_factory.py").write_text(FACTORY)
        self.tmp, self.repo, self.world, self.extra = tmp_path, repo, world, extra or {}
        self.port = free_port()
        self.env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "TORCH_CPP_LOG_LEVEL": "ERROR"}
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.logs: dict[int, list[str]] = {}

    def start(self, rank: int) -> None:
        log = self.tmp / f"node{rank}-{len(self.logs.get(rank, []))}.log"
        self.logs.setdefault(rank, []).append(str(log))
        cmd = [sys.executable, "-m", "deltasync", "subscribe", "--repo", self.repo, "--engine",
               "torch:packcast_factory:build", "--state", str(self.state(rank)), "--packcast",
               f"{rank}/{self.world}@127.0.0.1:{self.port}", "--packcast-timeout", "8", "--follow", "--quiet",
               "--poll-interval", "0.2", *self.extra.get(rank, [])]
        with open(log, "w") as fh:
            self.procs[rank] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, env=self.env,
                                                cwd=self.tmp)

    def state(self, rank: int) -> Path:
        return self.tmp / f"state{rank}"

    def status(self, rank: int) -> dict[str, Any]:
        done = subprocess.run([sys.executable, "-m", "deltasync", "status", "--state", str(self.state(rank)), "--json"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    def wait_for(self, ranks: list[int], version: int, timeout: float = 120.0) -> None:
        from deltasync.agents import read_status

        def at(r: int) -> bool:
            try:
                return bool(read_status(self.state(r)).get("version") == version)
            except UsageError:  # the node's agent made its directory but not its state yet
                return False

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(at(r) for r in ranks):
                return
            for r in ranks:
                if self.procs[r].poll() is not None:
                    raise AssertionError(f"node {r} exited: {self.output(r)}")
            time.sleep(0.2)
        raise AssertionError(f"nodes {ranks} not at version {version}: " + "\n".join(self.output(r) for r in ranks))

    def output(self, rank: int) -> str:
        return "".join(Path(p).read_text() for p in self.logs.get(rank, []))

    def stop(self) -> dict[int, int]:
        codes = {}
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for r, p in self.procs.items():
            try:
                codes[r] = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[r] = p.wait()
        return codes


@pytest.mark.slow
def test_three_cli_nodes_follow_every_version_a_killed_node_catches_up_node_0_comes_back(tmp_path: Path) -> None:
    repo = str(tmp_path / "repo")
    pub = _publisher(repo)
    states = _states(8)
    pub.publish(states[0])
    nodes = _Nodes(tmp_path, repo, 3, extra={2: ["--shard", "1/2"]})
    try:
        for r in range(3):
            nodes.start(r)
        nodes.wait_for([0, 1, 2], 1)
        for v in (2, 3):
            pub.publish(states[v - 1])
            nodes.wait_for([0, 1, 2], v)
        # Node 1 killed as version 4's round starts: the others go on without it (after the
        # timeout at most), and it is left behind ...
        pub.publish(states[3])
        time.sleep(0.3)
        nodes.procs[1].kill()
        nodes.procs[1].wait()
        nodes.wait_for([0, 2], 4)
        pub.publish(states[4])
        nodes.wait_for([0, 2], 5)
        assert nodes.status(1)["version"] in (3, 4)
        # ... until it starts again: node 0 takes it in with a round of its own, and it
        # reaches the latest from the versions it kept and the relay, bit-exact (digests).
        nodes.start(1)
        nodes.wait_for([0, 1, 2], 5)
        pub.publish(states[5])
        nodes.wait_for([0, 1, 2], 6)
        for r in range(3):
            s = nodes.status(r)
            assert s["version"] == 6 and s["engine_version"] == 6 and s["lag_versions"] == 0, s
            assert s["version_digest"] == s["engine_version_digest"] and s["running"], s
            assert s["latest_version"] == 6 and s["target_version"] == 6, s
        # Node 0 killed: the others follow the repository themselves ...
        nodes.procs[0].kill()
        nodes.procs[0].wait()
        pub.publish(states[6])
        nodes.wait_for([1, 2], 7)
        # ... and join it again once it is back.
        nodes.start(0)
        nodes.wait_for([0], 7)
        pub.publish(states[7])
        nodes.wait_for([0, 1, 2], 8)
        for r in range(3):
            s = nodes.status(r)
            assert s["version"] == 8 and s["engine_version"] == 8 and s["lag_versions"] == 0, s
        # A pin (back to 6) reaches every node through node 0's rounds, and so does its end.
        deltasync.Repository(repo).pin(6)
        nodes.wait_for([0, 1, 2], 6)
        for r in range(3):
            s = nodes.status(r)
            assert s["pinned_version"] == 6 and s["target_version"] == 6 and s["lag_versions"] == 0, s
        deltasync.Repository(repo).pin(None)
        nodes.wait_for([0, 1, 2], 8)
    finally:
        codes = nodes.stop()
    assert codes == {0: 0, 1: 0, 2: 0}, codes  # SIGTERM: a clean stop on every node
    for r in range(3):
        text = nodes.output(r)
        assert "stopped at version 8" in text, text
    for r in (1, 2):
        text = nodes.output(r)
        assert "following the repository until it is back" in text and "joined node 0" in text, text
        # the last version came through the group again
        assert _received(text)[max(_received(text))] > 0, text
    assert all("Traceback" not in nodes.output(r) for r in range(3))
    # Node 2 holds half the rows of each tensor (--shard 1/2): it receives about half of what
    # node 1, which holds every tensor, receives in the same rounds.
    # Which rounds carried a version to both depends on timing (a round for a node joining may
    # carry nothing; a restarted node gets its catch-up in its own stream): the rounds where
    # both received something, and the shard node less in the first of them, as in every
    # round where both went from one version to the next.
    whole, half = _received(nodes.output(1)), _received(nodes.output(2))
    both = sorted(r for r in whole if whole[r] > 0 and half.get(r, 0) > 0)
    assert both, (half, whole)
    assert half[both[0]] < 0.75 * whole[both[0]], (both, half, whole)


def _received(output: str) -> dict[int, float]:
    """Bytes received from the group, by round, from a node's `packcast round ...` lines."""
    import re

    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    found = re.findall(r"packcast round (\d+), version \d+ \([^)]*\): ([\d.]+) (B|KiB|MiB|GiB) received", output)
    return {int(r): float(n) * units[u] for r, n, u in found}


def test_a_node_with_no_node_0_is_told_so(tmp_path: Path) -> None:
    from deltasync.agents import PackcastAgent, PackcastOptions
    from deltasync.engines import TorchEngine

    repo = str(tmp_path / "repo")
    _publisher(repo).publish(_states(1)[0])
    engine = TorchEngine({n: torch.zeros_like(t) for n, t in _states(1)[0].items()}, repo)
    with pytest.raises(UsageError, match="is node 0 running"):
        PackcastAgent(engine, tmp_path / "state",
                      packcast=PackcastOptions(rank=1, world=2, master=f"127.0.0.1:{free_port()}", timeout=1.0))
    with pytest.raises(UsageError, match="rank must be"):
        PackcastAgent(engine, tmp_path / "state", packcast=PackcastOptions(rank=2, world=2, master="127.0.0.1:1"))


def test_packcast_spec() -> None:
    from deltasync.agents.packcast_spec import parse_packcast

    assert parse_packcast("3/32@node0:29600") == (3, 32, "node0:29600")
    env = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "trainer-0", "MASTER_PORT": "29500"}
    assert parse_packcast("env", env) == (2, 4, "trainer-0:29501")  # torchrun's own store is on 29500
    assert parse_packcast("1/8", env) == (1, 8, "trainer-0:29501")
    assert parse_packcast("@h:7", env) == (2, 4, "h:7")
    for bad, why in [("4/4@h:1", "not in 0..3"), ("x", "RANK/WORLD@HOST:PORT"), ("1/4@h", "port"),
                     ("1/4@", "missing"), ("0/0@h:1", "not in")]:
        with pytest.raises(UsageError, match=why):
            parse_packcast(bad, env)
    with pytest.raises(UsageError, match="RANK is not set"):
        parse_packcast("env", {})


@pytest.mark.parametrize("args, why", [
    (["--packcast", "0/2@127.0.0.1:1"], "--state DIR and --engine torch"),
    (["--state", "S", "--engine", "torch:m:f", "--packcast", "2/2@127.0.0.1:1"], "not in 0..1"),
    (["--state", "S", "--engine", "torch:m:f", "--shard", "2/2"], "--shard must be I/N"),
    (["--out", "D", "--engine", "http:generic@http://127.0.0.1:1", "--shard", "0/2"], "--shard applies to torch"),
])
def test_subscribe_refuses_bad_packcast_and_shard_options(tmp_path: Path, args: list[str], why: str) -> None:
    done = subprocess.run([sys.executable, "-m", "deltasync", "subscribe", "--repo", str(tmp_path / "repo"), *args],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0 and why in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

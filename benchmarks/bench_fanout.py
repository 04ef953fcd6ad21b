"""Inside a cluster: commit -> every engine serving, for N nodes, today's paths next to packcast.

    python -m benchmarks.bench_fanout [--nodes 4,8,16,32] [--model-mib 8] [--link-mbps 0.1] [--reps 2]

One publisher commits RL-like versions (``--fraction`` of the bf16 elements move by one ulp
at random positions) of a small model to a local repository. One relay (``deltasync serve``'s
RelayServer) serves it behind a modelled WAN link (``--wan-mbps``). N
agent processes (forked once; at most ``max(--nodes)``) each keep a torch engine of the whole
model in memory and bring it to every version, along the paths asked for (``--paths``; by
default copy and packcast), measured in the same run:

* ``copy``: today's path: each agent pulls the version into a directory copy from the relay,
  then its engine stages from the copy (``deltasync subscribe --out DIR --engine torch``);
* ``engine``: each agent's engine pulls from the relay, no copy (an engine-first agent, item 1);
* ``tree`` (not by default): the same from relays in front of the relay (ceil(sqrt(N)) of them,
  each with its own egress link): where no process group spans the nodes;
* ``packcast``: what ``deltasync subscribe --packcast`` runs: a ``PackcastAgent`` per node
  (agents/packcast.py), each an engine-first agent with its own state directory; node
  0 follows the relay (polling its refs every 20 ms), fetches each version's stored bytes
  once and broadcasts them over a gloo group; every node decodes and applies them
  (engines/packcast.py) and records its engine's version in its state.

Links are modelled, as the machine has none, every one of them (``Links``: token buckets in
shared memory, ``--link-mbps`` each): the relay's egress (shared by every agent reading it),
and each node's own link, egress and ingress apart. A read from the relay holds the relay's
egress and the reader's ingress; a piece node a sends node b holds a's egress and b's
ingress. So the chain (``packcast``: node 0 -> 1 -> ... -> N-1, every link carrying the
stream once) and the old path (``packcast-tree``: the binomial tree gloo's broadcast runs,
node 0 sending the stream ceil(log2 N) times) are each charged what they really send. Every
node counts the bytes it sent and received on the group's links; node 0's are cross-checked
with the kernel's per-socket counters (``ss -ti`` bytes_acked of node 0's sockets).
The copy, engine and tree agents learn of a version from the benchmark at once (no watch
interval); packcast's node 0 finds it by polling, as an agent does.

Printed per N and path: commit -> every engine serving (median over ``--reps`` versions),
its ratio to N = 4, per agent and version the bytes received, bytes written to local disk
(``/proc/self/io`` write_bytes) and peak RSS, and the group links' bytes per rank. The
projection to 1 TB is ``benchmarks/bench_projection.py``.

The agents share this machine's cores: every node decodes every version, so the CPU work
of a round grows with N here while on a cluster each node has its own cores. The
``cpu/node`` column says how much of a round that is; keep the model small (``--model-mib``)
so that the links, not the 2 cores, are the bound.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import re
import resource
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

# Imported before the agents fork, so that each starts with them loaded (and no threads).
import torch

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig
from deltasync.agents import AgentConfig, PackcastAgent, PackcastOptions, Update
from deltasync.engines import TorchEngine
from deltasync.engines.packcast import PackCache, PackcastNode
from deltasync.storage import LocalStore, Store, WrappingStore

PATHS = ("copy", "engine", "tree", "packcast", "packcast-tree")
MAX_SUBRELAYS = 6  # tree: ceil(sqrt(N)) relays behind the relay, for N up to 36
TENSOR_ELEMS = 256 * 1024  # 512 KiB of bf16 per tensor


class Links:
    """Every modelled link, as token buckets in shared memory: the time each link is next free.

    Bucket ``RELAY + g``: the egress of relay ``g`` (0: the relay, then the tree's sub-relays);
    ``WAN``: the relay's upstream link; ``egress(r)`` / ``ingress(r)``: node ``r``'s own link,
    each direction on its own (full duplex). A transfer holds every bucket it crosses (a send
    from node a to node b: a's egress and b's ingress) for ``nbytes / rate`` from the moment all
    of them are free, then is let go: a tree, a ring or a chain is charged what it really sends.
    """

    WAN, RELAY = 0, 1

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.free = mp.Array("d", 2 + MAX_SUBRELAYS + 2 * nodes, lock=False)
        self.lock = mp.Lock()
        self.enabled = mp.Value("b", 1, lock=False)

    def egress(self, rank: int) -> int:
        return self.RELAY + MAX_SUBRELAYS + 1 + rank

    def ingress(self, rank: int) -> int:
        return self.RELAY + MAX_SUBRELAYS + 1 + self.nodes + rank

    def reset(self) -> None:
        with self.lock:
            now = time.time()
            for i in range(len(self.free)):
                self.free[i] = now

    def pay(self, buckets: tuple[int, ...], nbytes: int, rate: float) -> None:
        if not self.enabled.value or not nbytes:
            return
        with self.lock:
            start = max(time.time(), *(self.free[b] for b in buckets))
            done = start + nbytes / rate
            for b in buckets:
                self.free[b] = done
        delay = done - time.time()
        if delay > 0:
            time.sleep(delay)


class SharedLink(WrappingStore):
    """Reads pay the links they cross (``buckets`` of ``links``: a relay's egress, the reader's ingress)."""

    def __init__(self, inner: Store, links: Links, buckets: tuple[int, ...], rate: float) -> None:
        super().__init__(inner)
        self.links, self.buckets, self.rate = links, buckets, rate
        self.bytes_read = 0

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        data = self.inner.get(key, byte_range)
        self.bytes_read += len(data)
        self.links.pay(self.buckets, len(data), self.rate)
        return data


class PacedNode(PackcastNode):
    """A packcast node whose every send pays its own egress and the receiver's ingress."""

    rate = 0.0
    model: Links | None = None
    shape = "chain"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("spread", self.shape)
        super().__init__(*args, **kwargs)

    def _pace(self, peer: int, nbytes: int) -> None:
        assert self.model is not None
        self.model.pay((self.model.egress(self.rank), self.model.ingress(peer)), nbytes, self.rate)


class PacedAgent(PackcastAgent):
    node_class = PacedNode


def socket_bytes(pid: int) -> dict[tuple[str, str], int] | None:
    """The kernel's count of bytes each TCP socket of process ``pid`` sent and had acknowledged
    (``ss -tinp``: bytes_acked), by (local, peer) address; None where ``ss`` cannot say."""
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found: dict[tuple[str, str], int] = {}
    current: tuple[str, str] | None = None
    for line in out.splitlines():
        if "users:(" in line:
            fields = line.split()
            current = (fields[3], fields[4]) if f"pid={pid}," in line else None
        elif current is not None and (m := re.search(r"bytes_acked:(\d+)", line)):
            found[current] = int(m.group(1))
    return found or None


def io_written() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Setup:
    path: str
    rank: int
    nodes: int
    relay: str
    port: int
    work: str
    names: list[str]
    rate: float
    piece: int
    bucket: int = 0  # which modelled link the reads pay: 0 the relay's egress, g the g-th sub-relay's


def agent(conn: Connection, links: Links) -> None:
    """One node: builds the path it is told to, then updates its engine on each command."""
    from deltasync.storage import GrpcStore

    torch.set_num_threads(1)
    state: dict[str, Any] = {}
    while True:
        cmd, arg = conn.recv()
        if cmd == "exit":
            return
        try:
            if cmd == "setup":
                s: Setup = arg
                state.clear()
                relay = SharedLink(GrpcStore(s.relay), links, (Links.RELAY + s.bucket, links.ingress(s.rank)), s.rate)
                held = {n: torch.zeros(TENSOR_ELEMS, dtype=torch.bfloat16) for n in s.names}
                state.update(setup=s, relay=relay, held=held)
                if s.path == "copy":
                    out = Path(s.work) / f"copy-{s.rank}"
                    shutil.rmtree(out, ignore_errors=True)
                    state["out"] = out
                    state["engine"] = TorchEngine(held, relay, workers=1, copy=out)
                elif s.path in ("engine", "tree"):
                    state["engine"] = TorchEngine(held, relay, workers=1)
                else:  # the agent `subscribe --packcast` runs, following the relay in a thread
                    cache = PackCache(relay)
                    engine = TorchEngine(held, cache, workers=1)
                    PacedNode.rate, PacedNode.model = s.rate, links
                    PacedNode.shape = "tree" if s.path == "packcast-tree" else "chain"
                    served: dict[int, tuple[float, Update]] = {}
                    cond = threading.Condition()

                    def on_update(u: Update, served: dict[int, tuple[float, Update]] = served,
                                  cond: threading.Condition = cond) -> None:
                        with cond:
                            served[u.version] = time.time(), u
                            cond.notify_all()

                    state_dir = Path(s.work) / f"state-{s.nodes}-{s.rank}"
                    shutil.rmtree(state_dir, ignore_errors=True)
                    node = PackcastOptions(rank=s.rank, world=s.nodes, master=f"127.0.0.1:{s.port}", timeout=60.0,
                                           piece_bytes=s.piece)
                    pa = PacedAgent(engine, state_dir, AgentConfig(poll_interval=0.02, workers=1), packcast=node,
                                    on_update=on_update)
                    thread = threading.Thread(target=pa.run, kwargs={"follow": True}, daemon=True)
                    thread.start()
                    state.update(cache=cache, engine=engine, agent=pa, thread=thread, served=served, cond=cond,
                                 state_dir=state_dir, counters=(relay.bytes_read, cache.received_bytes, io_written(),
                                                                time.process_time()))
                conn.send(("ok", None))
            elif cmd == "update":
                conn.send(("ok", update(state, int(arg))))
            elif cmd == "close":
                running = state.get("agent")
                if running is not None:
                    running.stop()
                    state["thread"].join(60)
                    shutil.rmtree(state["state_dir"], ignore_errors=True)
                state.clear()
                conn.send(("ok", None))
        except BaseException as e:  # report, and stay available for the next command
            import traceback

            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def update(state: dict[str, Any], version: int) -> dict[str, float]:
    s: Setup = state["setup"]
    if s.path.startswith("packcast"):
        return agent_served(state, version)
    engine: TorchEngine = state["engine"]
    relay: SharedLink = state["relay"]
    cache: PackCache | None = state.get("cache")
    received0 = relay.bytes_read + (cache.received_bytes if cache is not None and s.rank else 0)
    written0, cpu0 = io_written(), time.process_time()
    record = None
    if s.path == "copy":
        from deltasync.pull.subscriber import Subscriber

        sub = state.setdefault("sub", Subscriber(relay, workers=1))
        sub.update_dir(state["out"], version)
        record = engine.update(version)
    else:
        record = engine.update(version)
    served = time.time()
    assert engine.version == version
    received = relay.bytes_read + (cache.received_bytes if cache is not None and s.rank else 0) - received0
    return {
        "served_at": served, "received": received, "written": io_written() - written0,
        "cpu": time.process_time() - cpu0, "rss": peak_rss_mib(),
        "stage_s": record.stage_s if record else 0.0, "pause_s": record.pause_s if record else 0.0,
        "bytes_written": record.bytes_written if record else 0,
    }


def agent_served(state: dict[str, Any], version: int) -> dict[str, float]:
    """Packcast: wait until this node's agent reports ``version`` served; what it cost since the
    last version (the agent runs on its own: it found the version, node 0 by polling the relay)."""
    s: Setup = state["setup"]
    cond: threading.Condition = state["cond"]
    with cond:
        if not cond.wait_for(lambda: version in state["served"], timeout=600):
            raise TimeoutError(f"node {s.rank}: version {version} not served within 600 s")
        at, u = state["served"][version]
    engine: TorchEngine = state["engine"]
    assert engine.version == version
    relay: SharedLink = state["relay"]
    cache: PackCache = state["cache"]
    read0, received0, written0, cpu0 = state["counters"]
    now = relay.bytes_read, cache.received_bytes, io_written(), time.process_time()
    state["counters"] = now
    record = u.swap
    report = state["agent"].last_round
    if report is None or report.version != version:
        raise RuntimeError(f"node {s.rank}: no packcast round report for version {version}")
    return {
        "served_at": at, "received": now[0] - read0 + (now[1] - received0 if s.rank else 0), "written": now[2] - written0,
        "cpu": now[3] - cpu0, "rss": peak_rss_mib(),
        "stage_s": record.stage_s if record else 0.0, "pause_s": record.pause_s if record else 0.0,
        "bytes_written": record.bytes_written if record else 0,
        "link_sent": report.link_sent, "link_received": report.link_received, "rank": s.rank,
    }


class Fleet:
    def __init__(self, n: int, links: Links) -> None:
        ctx = mp.get_context("fork")
        self.conns: list[Connection] = []
        self.procs = []
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=agent, args=(theirs, links), daemon=True)
            p.start()
            self.conns.append(mine)
            self.procs.append(p)

    def call(self, ranks: range, cmd: str, arg: Any) -> list[Any]:
        for r in ranks:
            self.conns[r].send((cmd, arg(r) if callable(arg) else arg))
        out = []
        for r in ranks:
            status, value = self.conns[r].recv()
            if status != "ok":
                raise RuntimeError(f"agent {r}: {value}")
            out.append(value)
        return out

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.send(("exit", None))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def step(state: dict[str, torch.Tensor], fraction: float, rng: np.random.Generator) -> None:
    for t in state.values():
        bits = t.view(torch.int16).numpy()
        pos = np.unique(rng.integers(0, bits.size, max(1, int(bits.size * fraction))))
        bits[pos] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="4,8,16,32", help="N values, comma-separated")
    ap.add_argument("--paths", default="packcast,packcast-tree",
                    help=f"of {','.join(PATHS)} (packcast-tree: the old path, node 0's stream down a binomial tree "
                         "as gloo's broadcast sends it; copy: about 2 min more, engine: about 3 min more)")
    ap.add_argument("--model-mib", type=float, default=8.0, help="bf16 model size (512 KiB tensors)")
    ap.add_argument("--fraction", type=float, default=0.01, help="elements changed per version")
    ap.add_argument("--reps", type=int, default=2, help="timed versions per N and path")
    ap.add_argument("--link-mbps", type=float, default=0.1, help="modelled node link and relay egress, MB/s")
    ap.add_argument("--wan-mbps", type=float, default=0.2, help="modelled WAN link of the relay, MB/s")
    ap.add_argument("--piece-kib", type=float, default=16.0, help="packcast: bytes per broadcast piece, KiB")
    ap.add_argument("--dir", default=None, help="where to work (default: a temporary directory, removed after)")
    args = ap.parse_args()
    nodes = [int(n) for n in args.nodes.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    rate = args.link_mbps * 1e6

    links = Links(max(nodes))
    fleet = Fleet(max(nodes), links)  # forked before any thread of this process exists
    from deltasync.relay import build_server
    from deltasync.storage import GrpcStore
    from deltasync.testing import free_port

    with tempfile.TemporaryDirectory(prefix="bench-fanout-", dir=args.dir) as d:
        work = Path(d)
        repo = str(work / "repo")
        rng = np.random.default_rng(7)
        tensors = max(1, int(args.model_mib * 2))
        model = {f"layers.{i}.weight": torch.from_numpy(
            (rng.normal(0, 0.02, TENSOR_ELEMS).astype(np.float32).view(np.uint32) >> 16).astype(np.int16)
        ).view(torch.bfloat16) for i in range(tensors)}
        names = list(model)
        raw = sum(t.numel() * 2 for t in model.values())
        config = PublisherConfig(codec=PlanesZstdCodec(), snapshot_every=100000, pack_bytes=64 << 10, workers=1,
                                 progress=False)
        pub = Publisher(repo, config)
        version = int(pub.publish(model))
        wan = SharedLink(LocalStore(repo), links, (Links.WAN,), args.wan_mbps * 1e6)
        relay = build_server(wan, "127.0.0.1:0", cache_dir=work / "relay").start()
        print(f"model {raw / 2**20:.1f} MiB bf16 ({tensors} tensors), {args.fraction:.2%} of elements changed per version; "
              f"links modelled: relay egress and node links {args.link_mbps:g} MB/s, WAN {args.wan_mbps:g} MB/s; "
              f"{os.cpu_count()} cores shared by every agent")
        rows: list[dict[str, Any]] = []
        stored: list[float] = []
        publish_s: list[float] = []
        try:
            for n in nodes:
                ranks = range(n)
                for path in paths:
                    # A fresh publisher starts with a snapshot: each setup below loads it, not a growing chain.
                    pub = Publisher(repo, config)
                    version = int(pub.publish(model))
                    port = free_port()
                    subs = []
                    if path == "tree":  # relays in front of the relay, each serving ceil(N / k) agents
                        k = min(MAX_SUBRELAYS, int(np.ceil(np.sqrt(n))))
                        subs = [build_server(SharedLink(GrpcStore(relay.url), links, (Links.RELAY,), rate), "127.0.0.1:0",
                                             cache_dir=work / f"sub-{n}-{g}").start() for g in range(k)]
                    fleet.call(ranks, "setup", lambda r, n=n, path=path, port=port, subs=subs: Setup(
                        path, r, n, subs[r % len(subs)].url if subs else relay.url, port, str(work), names, rate,
                        int(args.piece_kib * 1024), 1 + r % len(subs) if subs else 0))
                    # Untimed: bring every engine (and copy) to the latest version, links off.
                    links.enabled.value = 0
                    fleet.call(ranks, "update", version)
                    links.enabled.value = 1
                    times, per_agent, kernel = [], [], []
                    for _ in range(args.reps):
                        step(model, args.fraction, rng)
                        node0 = fleet.procs[0].pid or 0
                        sockets0 = socket_bytes(node0)  # before the commit: ss takes a moment
                        t0 = time.perf_counter()
                        res = pub.publish(model)
                        publish_s.append(time.perf_counter() - t0)
                        stored.append(res.stored_bytes / raw)
                        version = int(res)
                        committed = time.time()
                        links.reset()
                        out = fleet.call(ranks, "update", version)
                        sockets1 = socket_bytes(node0)
                        if sockets0 is not None and sockets1 is not None:  # node 0's sockets: what the kernel sent
                            kernel.append(sum(v - sockets0.get(k, 0) for k, v in sockets1.items()))
                        times.append(max(o["served_at"] for o in out) - committed)
                        per_agent.extend(out)
                    fleet.call(ranks, "close", None)
                    for sub in subs:
                        sub.stop()
                    if path == "copy":
                        for r in ranks:
                            shutil.rmtree(work / f"copy-{r}", ignore_errors=True)
                    rows.append({
                        "n": n, "path": path, "s": statistics.median(times),
                        "received": statistics.mean(a["received"] for a in per_agent),
                        "written": statistics.mean(a["written"] for a in per_agent),
                        "rss": max(a["rss"] for a in per_agent),
                        "cpu": statistics.mean(a["cpu"] for a in per_agent),
                        "stage": statistics.median(a["stage_s"] for a in per_agent),
                        "pause": statistics.median(a["pause_s"] for a in per_agent),
                        "pause_bytes": statistics.median(a["bytes_written"] for a in per_agent),
                        "stored": res.stored_bytes,
                        "root_sent": statistics.median(a.get("link_sent", 0) for a in per_agent if a.get("rank") == 0)
                        if path.startswith("packcast") else 0,
                        "stream": statistics.median(a["link_received"] for a in per_agent if a.get("rank") == 1)
                        if path.startswith("packcast") and n > 1 else 0,
                        "sent_max": max((a.get("link_sent", 0) for a in per_agent if a.get("rank")), default=0),
                        "received_max": max((a.get("link_received", 0) for a in per_agent), default=0),
                        "kernel": statistics.median(kernel) if kernel else None,
                    })
                    row = rows[-1]
                    print(f"  N={n:>2} {path:<8} commit->all serving {row['s']:7.3f} s   per agent: received "
                          f"{row['received'] / 1e3:8.1f} kB, written {row['written'] / 1e3:8.1f} kB, cpu {row['cpu']:.3f} s, "
                          f"peak RSS {row['rss']:.0f} MiB", flush=True)
        finally:
            fleet.close()
            relay.stop()
    report(rows, nodes, paths, raw, statistics.median(stored), args)


def report(rows: list[dict[str, Any]], nodes: list[int], paths: list[str], raw: int, stored: float,
           args: argparse.Namespace) -> None:
    by = {(r["n"], r["path"]): r for r in rows}
    print(f"\ncommit -> every engine serving (median of {args.reps} versions; stored delta {stored * raw / 1e3:.0f} kB "
          f"= {stored:.4f} x raw)")
    print(f"| {'N':>3} | " + " | ".join(f"{p:>16}" for p in paths) + " |")
    print(f"|{'-' * 5}|" + "|".join("-" * 18 for _ in paths) + "|")
    for n in nodes:
        print(f"| {n:>3} | " + " | ".join(f"{by[(n, p)]['s']:>7.3f} s ({by[(n, p)]['s'] / by[(nodes[0], p)]['s']:>4.2f}x)"
                                           for p in paths) + " |")
    print("per agent and version (mean): bytes received / written to local disk / cpu; peak RSS (max)")
    for p in paths:
        for n in nodes:
            r = by[(n, p)]
            print(f"  {p:<8} N={n:>2}: {r['received'] / 1e3:8.1f} kB received ({r['received'] / r['stored']:.2f}x the "
                  f"stored delta), {r['written'] / 1e3:8.1f} kB written ({r['written'] / r['stored']:.2f}x), cpu "
                  f"{r['cpu'] * 1e3:6.1f} ms, peak RSS {r['rss']:.0f} MiB")
    last = nodes[-1]
    casts = [p for p in paths if p.startswith("packcast")]
    if casts:
        print("group links per version (counted by the broadcast code; median): node 0 sent (x the stream a node "
              "receives), the most any other node sent / received; node 0's sockets by the kernel (ss bytes_acked: "
              "its group sends plus its store and relay requests)")
        for p in casts:
            for n in nodes:
                r = by[(n, p)]
                times = r["root_sent"] / r["stream"] if r["stream"] else float("nan")
                kern = "n/a (ss gave nothing)" if r["kernel"] is None else f"{r['kernel'] / 1e3:8.1f} kB"
                print(f"  {p:<13} N={n:>2}: node 0 sent {r['root_sent'] / 1e3:8.1f} kB = {times:4.2f}x the stream "
                      f"({r['stream'] / 1e3:.1f} kB); others sent <= {r['sent_max'] / 1e3:8.1f} kB, received <= "
                      f"{r['received_max'] / 1e3:8.1f} kB; kernel, node 0: {kern}")
        if "packcast" in paths:
            r = by[(last, "packcast")]
            times = r["root_sent"] / r["stream"] if r["stream"] else float("nan")
            ratio = r["s"] / by[(nodes[0], "packcast")]["s"]
            print(f"target: node 0's link <= 2.1x the stream at N={last}: {times:.2f}x "
                  f"({'holds' if times <= 2.1 else 'does not hold'})")
            print(f"target: packcast at N={last} <= 1.3x N={nodes[0]}, links modelled at {args.link_mbps:g} MB/s per node "
                  f"and direction: {ratio:.2f}x ({'holds' if ratio <= 1.3 else 'does not hold'}; cpu/node "
                  f"{r['cpu']:.3f} s of {r['s']:.3f} s: with {os.cpu_count()} cores for {last} agents, CPU "
                  f"{'may be' if r['cpu'] * last / (os.cpu_count() or 1) > 0.5 * r['s'] else 'is not'} the bound)")
    if "packcast" in paths:
        first = by[(nodes[0], "packcast")]
        d = stored * raw
        stages = {"WAN": d / (args.wan_mbps * 1e6), "relay -> node 0": d / (args.link_mbps * 1e6),
                  "broadcast": d / (args.link_mbps * 1e6), "decode + apply": first["cpu"]}
        print(f"overlap (item 4), packcast at N={nodes[0]}: measured {first['s']:.3f} s; its stages in sequence "
              f"{sum(stages.values()):.3f} s (" + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()) +
              f"); the slowest alone {max(stages.values()):.3f} s")
    print("the projection to 1 TB: python -m benchmarks.bench_projection")


if __name__ == "__main__":
    main()

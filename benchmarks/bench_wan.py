"""Publishing and relay trees across a modelled long-haul link, at several round trips, in one run.

    python -m benchmarks.bench_wan [--mib 256] [--fraction 0.2] [--mbps 800] [--rtts 2,50,200]
        [--reps 3] [--rows publish,tree,publish2,tree2,uploaders64] [--shard-mbps 200]
        [--uploaders 64] [--upload-mib 16] [--upload-objects 1] [--baseline | --per-object]

The link is :mod:`benchmarks.wan_link`: a userspace TCP proxy between loopback ports, in a
process of its own, that paces each direction at ``--mbps`` and delays every byte by half the
round trip; loopback TCP acknowledges at once, so only the application's flow-control windows
and serial round trips limit a transfer through it (what is under test). The model: synthetic
bf16 of ``--mib`` MiB (64 MiB tensors), ``--fraction`` of its elements moved by one ulp per
version, so a version is a snapshot (v1) then a delta (v2). Rows:

* ``publish``: ``deltasync.Publisher`` (this process) -> link -> a relay serving
  ``--accept-writes`` in front of a local repository (its own process). Elapsed: the
  ``publish()`` call.
* ``tree``: publish through the root relay (``--accept-writes`` over a local repository, on
  loopback: not timed) -> root relay -> link -> cluster relay -> an engine-first agent
  (``EngineAgent`` + ``TorchEngine``, following the cluster relay). Elapsed: from the commit
  to the engine holding the version (every chunk verified). (Before 2026-12-02 the publisher
  wrote the repository directly and the root relay polled it every 0.5 s: 0-0.5 s more.)
* ``publish2``/``tree2``: the same with two relays, each behind its own link of
  ``--shard-mbps`` (``publish2``: two writable relays over one repository, the publisher
  naming both; ``tree2``: two cluster relays, each over its own link to the root, one cluster
  of relays (``cluster_relays``: each fetches its share of every object over its own link and
  the rest from the other), the agent naming both), next to ``publish1``/``tree1``: one relay
  over one such link. Printed: the throughput of two over one, and the bytes each link
  carried (``links a + b``).
* ``uploaders64``: ``--uploaders`` grpc:// stores (each its own connection), each putting
  ``--upload-objects`` objects (one after another) of ``--upload-mib`` MiB at once, through
  one link at the largest round trip into a
  relay serving ``--accept-writes`` at its defaults (``--upload-buffer`` 256M). Printed: the
  relay process's resident memory (VmRSS, RssAnon: sampled from /proc every 5 ms) before and
  at its peak, the growth against the target (budget + 64 MiB), and the link's throughput.

``--baseline`` runs the paths before issue 30's second turn, to compare in the same run on the
same machine: publishers upload with the old Put to relays serving ``upload_window`` 16 MiB,
and relays keep a fixed 4 ranged reads in flight (``fetch_pieces_in_flight`` 4); in the tree
rows, agents read a pack whole where they need most of it (not by its chunks' ranges), and
the two relays of ``tree2`` (and ``tree1``) are ``--no-warm`` relays on their own, not one
cluster, reading their upstream with grpc's growing window (the same code otherwise).
``--per-object``: publishers upload with one credited Upload call per object (the first turn
of issue 30's credit), not on upload sessions (standing credit carried from one object to the
next).

Per row and round trip: elapsed (every repetition and the median), the bytes that crossed
the link (both ways), link time (the larger direction's bytes over the rate, plus 4 round
trips) and elapsed / max(the same row at the smallest round trip, link time): the issue's
target is <= 1.3 at 50 and 200 ms. Every engine is checked bit-exact against the published
state. Everything shares this machine's cores (2 here, with other work): compare within a
run, never across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.bench_engine_agent import first_state, layout
from benchmarks.wan_link import LinkProcess

WRITE_TOKEN = "bench-wan-write-token"
MIB = 1 << 20


# -- the model -----------------------------------------------------------------------------------


def step(state: dict[str, torch.Tensor], seed: int, fraction: float) -> None:
    """One ulp at about ``fraction`` of the elements of every tensor, in place."""
    rng = np.random.default_rng(seed)
    for t in state.values():
        ints = t.view(torch.int16).reshape(-1).numpy()
        ints[rng.random(ints.size, dtype=np.float32) < fraction] += 1


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in state.items()}


# -- processes -----------------------------------------------------------------------------------


BASELINE = False  # --baseline: the old upload and fetch paths (module docstring)
PER_OBJECT = False  # --per-object: one Upload call per object, no upload session (module docstring)


def _relay(upstream: str, cache: str, writable: bool, warm: bool, baseline: bool, conn: Connection,
           listen: str = "127.0.0.1:0", cluster_relays: list[str] | None = None) -> None:
    os.environ["DELTASYNC_RELAY_WRITE_TOKEN"] = WRITE_TOKEN
    from deltasync.relay import build_server

    options: dict[str, Any] = {"accept_writes": True, "write_token": WRITE_TOKEN} if writable else {}
    options["warm"] = warm
    if cluster_relays is not None:
        options["cluster_relays"] = cluster_relays
    source: Any = upstream
    if baseline:
        options.update(fetch_pieces_in_flight=4, **({"upload_window": 16 << 20} if writable else {}))
        if upstream.startswith("grpc://"):
            from deltasync.storage import GrpcStore

            source = GrpcStore(upstream)  # grpc's growing window, not the relay's fixed one
    server = build_server(source, listen, cache, **options).start()  # the defaults fill a long link
    conn.send(server.address)
    conn.recv()
    counts = server.metrics()
    if counts.get("uploads_refused") or counts.get("manifest_pending_waits"):
        # manifests that came ahead of a pack: waited for it, or refused (logged at info)
        print(f"  relay {server.address}: {counts['uploads_refused']} uploads refused, "
              f"{counts['manifest_pending_waits']} manifests waited for packs on their way, "
              f"{counts['manifest_rechecks']} checked again", flush=True)
    server.stop(grace=0)


class Proc:
    """A relay in a process of its own."""

    def __init__(self, upstream: str, cache: Path, writable: bool = False, warm: bool = True,
                 listen: str = "127.0.0.1:0", cluster_relays: list[str] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_relay, args=(upstream, str(cache), writable, warm, BASELINE, child, listen,
                                                     cluster_relays), daemon=True)
        self.proc.start()
        self.address: str = self.conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        self.proc.join(timeout=20)
        if self.proc.is_alive():
            self.proc.kill()


def _agent(url: str, state_dir: str, shapes: list[tuple[str, tuple[int, int]]], conn: Connection,
           baseline: bool = False) -> None:
    from deltasync.agents import AgentConfig, EngineAgent
    from deltasync.engines import TorchEngine
    from deltasync.storage._grpc import GrpcStore

    if baseline:
        GrpcStore.ranged_packs = False  # the old read: a pack read whole, decoded once all of it arrived

    model = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes}
    lock = threading.Lock()

    class Timed(TorchEngine):
        def swap(self, staged: Any) -> Any:
            record = super().swap(staged)
            with lock:
                conn.send(("held", None, time.time()))
            return record

        def load(self, version: int | None = None) -> Any:
            record = super().load(version)
            with lock:
                conn.send(("held", version, time.time()))
            return record

    def ready(_: Any) -> None:
        with lock:
            conn.send(("ready", None, time.time()))

    agent = EngineAgent(Timed(model, url, workers=1), Path(state_dir), AgentConfig(workers=1, progress=False),
                        on_ready=ready)
    runner = threading.Thread(target=agent.run, kwargs={"follow": True}, daemon=True)
    runner.start()
    conn.recv()
    agent.stop()
    runner.join(timeout=30)
    with lock:
        conn.send(("digests", digests(model), 0.0))


class Agent:
    def __init__(self, url: str, state_dir: Path, shapes: list[tuple[str, tuple[int, int]]]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_agent, args=(url, str(state_dir), shapes, child, BASELINE), daemon=True)
        self.proc.start()
        if not self.conn.poll(300) or self.conn.recv()[0] != "ready":
            raise RuntimeError("the agent did not start")

    def wait(self, timeout: float = 600) -> float:
        """Unix time the engine next held a version."""
        if not self.conn.poll(timeout):
            raise TimeoutError("the agent held no new version")
        kind, _, at = self.conn.recv()
        assert kind == "held", kind
        return float(at)

    def finish(self) -> dict[str, str]:
        self.conn.send("stop")
        while True:
            kind, payload, _ = self.conn.recv()
            if kind == "digests":
                self.proc.join(timeout=30)
                return payload  # type: ignore[no-any-return]


# -- rows ----------------------------------------------------------------------------------------


def _publisher(url: str) -> Any:
    import deltasync

    pub = deltasync.Publisher(url, deltasync.PublisherConfig(progress=False, snapshot_every=1000))
    for relay in getattr(pub.repo.store, "_relays", []):
        if BASELINE:
            relay.legacy_put = True  # the old Put, uncredited
        elif PER_OBJECT:
            relay.legacy_upload = True  # one credited Upload call per object (no session)
    return pub


def row_publish(root: Path, states: list[dict[str, torch.Tensor]], rtt: float, mbps: float,
                relays: int) -> list[tuple[float, int]]:
    """(elapsed, bytes crossed) per version, published through ``relays`` writable relays each behind a link."""
    repo = root / "repo"
    repo.mkdir()
    servers = [Proc(str(repo), root / f"cache-{i}", writable=True) for i in range(relays)]
    links = [LinkProcess(s.address, rtt=rtt, mbps=mbps) for s in servers]
    os.environ["DELTASYNC_RELAY_WRITE_TOKEN"] = WRITE_TOKEN
    out: list[tuple[float, int]] = []
    try:
        pub = _publisher("grpc://" + ",".join(link.address for link in links))
        for state in states:
            before = [link.counts() for link in links]
            start = time.perf_counter()
            pub.publish(state)
            elapsed = time.perf_counter() - start
            after = [link.counts() for link in links]
            crossed = max(sum(a[0] - b[0] for a, b in zip(after, before, strict=True)),
                          sum(a[1] - b[1] for a, b in zip(after, before, strict=True)))
            out.append((elapsed, crossed // relays))  # per link: each carries its share
        got = _read_back(str(repo))
        assert got == digests(states[-1]), "publish: the repository differs from the published state"
    finally:
        for link in links:
            link.stop()
        for s in servers:
            s.stop()
    return out


def _read_back(repo: str) -> dict[str, str]:
    import deltasync

    sub = deltasync.Subscriber(repo, progress=False)
    return digests(dict(sub.pull()))


def free_address() -> str:
    """``127.0.0.1:PORT`` with a port free now (for relays that must know each other's address before they start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


LINK_BYTES: list[list[int]] = []  # row_tree: the bytes each link carried down, per version


def row_tree(root: Path, states: list[dict[str, torch.Tensor]], shapes: list[tuple[str, tuple[int, int]]],
             rtt: float, mbps: float, relays: int, shared: bool = False) -> list[tuple[float, int]]:
    """(commit -> engine holds it, bytes crossed) per version: root relay -> link(s) -> cluster relay(s) -> agent."""
    from deltasync.repo.repository import Repository

    repo = root / "origin"
    Repository(str(repo)).create()  # the agent then waits on a repository (not backing off from a missing one)
    # The trainer publishes through its root relay (over loopback: docs/cli.md's worked
    # example), which so hears of each version from its own write of the ref, not a poll later.
    top = Proc(str(repo), root / "cache-root", writable=True)
    os.environ["DELTASYNC_RELAY_WRITE_TOKEN"] = WRITE_TOKEN
    pub = _publisher(f"grpc://{top.address}")
    links = [LinkProcess(top.address, rtt=rtt, mbps=mbps) for _ in range(relays)]
    # Relays sharing a cluster's ingress are one cluster (--cluster-relays): each fetches its
    # share of every object over its own link and the rest from the others (docs/cli.md,
    # Across clusters). --baseline: as before, each on its own, not warming.
    members = [free_address() for _ in links] if relays > 1 and not BASELINE else None
    cluster = [Proc(f"grpc://{link.address}", root / f"cache-cluster-{i}", warm=not (BASELINE and shared),
                    listen=members[i] if members else "127.0.0.1:0", cluster_relays=members)
               for i, link in enumerate(links)]
    agent = Agent("grpc://" + ",".join(c.address for c in cluster), root / "agent", shapes)
    LINK_BYTES.clear()
    out: list[tuple[float, int]] = []
    try:
        time.sleep(1.0)  # the agent's watch is open
        for state in states:
            before = [link.counts() for link in links]
            pub.publish(state)
            committed = time.time()
            held = agent.wait()
            after = [link.counts() for link in links]
            crossed = max(sum(a[0] - b[0] for a, b in zip(after, before, strict=True)),
                          sum(a[1] - b[1] for a, b in zip(after, before, strict=True)))
            LINK_BYTES.append([a[1] - b[1] for a, b in zip(after, before, strict=True)])
            out.append((held - committed, crossed // relays))
        got = agent.finish()
        assert got == digests(states[-1]), "tree: the engine differs from the published state"
    finally:
        if agent.proc.is_alive():
            agent.proc.kill()
        pub.repo.store.close()
        for c in cluster:
            c.stop()
        for link in links:
            link.stop()
        top.stop()
    return out


def _memory(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon"):
            fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["RssAnon"]


def row_uploaders(root: Path, uploaders: int, mib: int, rtt: float, mbps: float, each: int = 1) -> None:
    """``uploaders`` stores putting ``each`` objects each (one after another: the second and later
    on standing credit where the relay grants it) at once through one link into one relay: its memory."""
    from deltasync.format.digest import digest
    from deltasync.relay.config import RelayConfig
    from deltasync.storage import _grpc
    from deltasync.storage._grpc import GrpcStore

    budget = RelayConfig(listen="127.0.0.1:0").upload_buffer
    repo = root / "repo"
    repo.mkdir()
    relay = Proc(str(repo), root / "cache", writable=True)
    link = LinkProcess(relay.address, rtt=rtt, mbps=mbps)
    # One connection per store, as separate publishers have (grpc shares one between channels otherwise).
    _grpc.CHANNEL_OPTIONS.append(("grpc.use_local_subchannel_pool", 1))
    base = np.random.default_rng(7).bytes(mib * MIB)
    objects = [[base[:-8] + (i * each + j).to_bytes(8, "little") for j in range(each)] for i in range(uploaders)]
    stores = [GrpcStore(f"grpc://{link.address}?timeout=600", write_token=WRITE_TOKEN) for _ in objects]
    for store in stores if PER_OBJECT else []:
        store._relays[0].legacy_upload = True  # one Upload call per object, no session
    errors: list[str] = []
    done = threading.Event()
    pid = relay.proc.pid
    assert pid is not None
    start_rss, start_anon = _memory(pid)
    peak = [start_rss, start_anon]

    def sample() -> None:
        while not done.is_set():
            rss, anon = _memory(pid)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], anon)
            time.sleep(0.005)

    def put(store: GrpcStore, datas: list[bytes]) -> None:
        try:
            for data in datas:
                store.put(f"packs/{digest(data).hex()}.pack", data)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    before = link.counts()
    began = time.perf_counter()
    threads = [threading.Thread(target=put, args=(s, o)) for s, o in zip(stores, objects, strict=True)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - began
        up = link.counts()[0] - before[0]
    finally:
        done.set()
        sampler.join()
        for store in stores:
            store.close()
        _grpc.CHANNEL_OPTIONS.pop()
        link.stop()
        relay.stop()
    if errors:
        raise SystemExit(f"uploaders: {len(errors)} uploads failed: {errors[0]}")
    landed = len(list((repo / "packs").iterdir()))
    assert landed == uploaders * each, f"{landed} of {uploaders * each} objects landed"
    growth = peak[0] - start_rss
    print(f"  {uploaders} uploaders x {each} x {mib} MiB at rtt {rtt * 1000:.0f} ms, {mbps:g} Mbit/s: {elapsed:.2f}s, "
          f"{up / elapsed * 8 / 1e6:.0f} Mbit/s up ({up / 1e6:.0f} MB crossed); relay VmRSS {start_rss / MIB:.0f} -> "
          f"peak {peak[0] / MIB:.0f} MiB (+{growth / MIB:.0f}), RssAnon {start_anon / MIB:.0f} -> "
          f"{peak[1] / MIB:.0f} MiB (+{(peak[1] - start_anon) / MIB:.0f}); target: growth <= budget "
          f"{budget / MIB:.0f} + 64 = {(budget / MIB) + 64:.0f} MiB: {'met' if growth <= budget + 64 * MIB else 'MISSED'}",
          flush=True)


# -- main ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="model size in MiB of bf16")
    ap.add_argument("--fraction", type=float, default=0.2, help="fraction of elements moved per version")
    ap.add_argument("--mbps", type=float, default=800, help="link rate, megabits per second each way")
    ap.add_argument("--rtts", default="2,50,200", help="round trips in milliseconds, the first is the baseline")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per row and round trip (median printed)")
    ap.add_argument("--rows", default="publish,tree", help="publish, tree, publish2, tree2")
    ap.add_argument("--shard-mbps", type=float, default=200, help="link rate of each link in the two-relay rows")
    ap.add_argument("--uploaders", type=int, default=64, help="stores uploading at once in the uploaders64 row")
    ap.add_argument("--upload-mib", type=int, default=16, help="MiB each uploader puts in the uploaders64 row")
    ap.add_argument("--upload-objects", type=int, default=1, help="objects each uploader puts, one after another")
    ap.add_argument("--baseline", action="store_true", help="the old upload (Put, 16M window) and fetch (4 in flight) paths")
    ap.add_argument("--per-object", action="store_true", help="publishers upload with one Upload call per object")
    args = ap.parse_args()
    global BASELINE, PER_OBJECT
    BASELINE, PER_OBJECT = args.baseline, args.per_object

    shapes = layout(args.mib)
    states = [first_state(shapes)]
    second = {n: t.clone() for n, t in states[0].items()}
    step(second, 1, args.fraction)
    states.append(second)
    rtts = [float(r) / 1000 for r in args.rtts.split(",")]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    print(f"model {args.mib} MiB bf16 ({len(shapes)} tensors), {args.fraction:.0%} of elements moved per version; "
          f"link {args.mbps:g} Mbit/s each way ({args.shard_mbps:g} per link in the two-relay rows); "
          f"round trips {args.rtts} ms; {args.reps} repetitions{'; BASELINE (old paths)' if args.baseline else ''}"
          f"{'; PER-OBJECT (Upload, no session)' if args.per_object else ''}")
    results: dict[tuple[str, str, float], list[tuple[float, int]]] = {}
    plans: list[tuple[str, str, float, int]] = []
    for row in rows:
        if row == "uploaders64":
            with tempfile.TemporaryDirectory(prefix="bench-wan-") as tmp:
                row_uploaders(Path(tmp), args.uploaders, args.upload_mib, rtts[-1], args.mbps, args.upload_objects)
        elif row in ("publish", "tree"):
            plans.append((row, row, args.mbps, 1))
        elif row in ("publish2", "tree2"):
            plans += [(row[:-1] + "1", row[:-1], args.shard_mbps, 1), (row, row[:-1], args.shard_mbps, 2)]
        else:
            raise SystemExit(f"unknown row {row!r}")
    for label, kind, mbps, relays in plans:
        for rtt in rtts:
            for rep in range(args.reps):
                with tempfile.TemporaryDirectory(prefix="bench-wan-") as tmp:
                    if kind == "publish":
                        figures = row_publish(Path(tmp), states, rtt, mbps, relays)
                    else:
                        figures = row_tree(Path(tmp), states, shapes, rtt, mbps, relays, shared=label != kind)
                for version, fig in zip(("snapshot", "delta"), figures, strict=True):
                    results.setdefault((label, version, rtt), []).append(fig)
                per_link = ["" if relays < 2 or kind != "tree" else
                            " (links " + " + ".join(f"{b / 1e6:.1f}" for b in link) + ")" for link in LINK_BYTES]
                print(f"  {label:9} rtt {rtt * 1000:5.0f} ms rep {rep}: "
                      + ", ".join(f"{v} {e:6.2f}s {b / 1e6:7.1f} MB{per_link[i] if i < len(per_link) else ''}"
                                  for i, (v, (e, b)) in enumerate(zip(("snapshot", "delta"), figures, strict=True))),
                      flush=True)
    if not plans:
        return
    print()
    print(f"{'row':9} {'version':8} {'rtt':>6} {'elapsed (each)':>24} {'median':>7} {'crossed':>9} {'link time':>9} "
          f"{'ratio':>6}")
    mbps_of = {label: mbps for label, _, mbps, _ in plans}
    for label, _, _, _ in plans:
        for version in ("snapshot", "delta"):
            base = statistics.median(e for e, _ in results[(label, version, rtts[0])])
            for rtt in rtts:
                figs = results[(label, version, rtt)]
                med = statistics.median(e for e, _ in figs)
                crossed = statistics.median(b for _, b in figs)
                link_time = crossed / (mbps_of[label] * 1e6 / 8) + 4 * rtt
                ratio = med / max(base, link_time)
                each = " ".join(f"{e:.2f}" for e, _ in figs)
                print(f"{label:9} {version:8} {rtt * 1000:5.0f}ms {each:>24} {med:6.2f}s {crossed / 1e6:7.1f}MB "
                      f"{link_time:8.2f}s {ratio:6.2f}")
    for kind in ("publish", "tree"):
        if f"{kind}2" in rows:
            for version in ("snapshot", "delta"):
                for rtt in rtts:
                    one = statistics.median(e for e, _ in results[(f"{kind}1", version, rtt)])
                    two = statistics.median(e for e, _ in results[(f"{kind}2", version, rtt)])
                    print(f"two relays over one, {kind} {version} at {rtt * 1000:.0f} ms: throughput x{one / two:.2f}")


if __name__ == "__main__":
    main()

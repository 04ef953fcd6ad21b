"""One publisher, relays behind a WAN link, N subscriber agents: the relay's overlapped stages
(streaming while fetching, warming new versions) against the whole-object path, in one run.

    python -m benchmarks.bench_relay [--size-gib 1.0] [--agents 8] [--versions 3] [--mbps 1000]
        [--depth 1] [--lr 1e-6] [--pack-mib 64] [--object-mib 64] [--kinds delta,full] [--quick]

The top relay reads its upstream repository through :class:`deltasync.storage.ThrottledStore`
(``--mbps`` megabits per second, all reads together); with ``--depth 2`` a second relay reads
the first (a cluster behind a relay behind a relay, on loopback). Each relay runs in one of two
modes, measured in the same run:

- ``overlap`` (the default relay): an object is served while it is still being fetched, and
  each new version is fetched into the cache as soon as the relay hears of it;
- ``whole`` (``stream=False, warm=False``): an object is served only once it is whole in the
  cache, and fetched only when an agent first asks for it (the path before issue 21, item 4).

First, time to first byte: one ``--object-mib`` object (a full pack) behind the link, read by
a client through a fresh chain of relays (depth 1 and 2): time to its first byte and to its
last. Then versions: each agent is a process that watches the bottom relay (server-pushed
version events) and brings its own directory to every new version with
``Subscriber.update_dir`` (every chunk verified). Per version it prints the time from commit
to all agents holding verified bits and the bytes the relay read upstream, for the RL-like
stream as deltas (``--lr``), and with ``--kinds delta,full`` as full checkpoints (every
version a snapshot) over the same link.

All agents share this machine's cores (2 here): past the link, the times are bound by the
agents rebuilding and verifying their copies, not by the network.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_s3 import state_of
from benchmarks.rl_stream import TinyConfig, measure_change_stats, rl_stream, shape_for_size, synthetic_stream, transformer_layout

MODES: dict[str, dict[str, bool]] = {"overlap": {"stream": True, "warm": True}, "whole": {"stream": False, "warm": False}}


def _agent(index: int, url: str, out: str, last: int, queue: Any) -> None:
    import deltasync
    from deltasync.storage._grpc import GrpcStore

    store = GrpcStore(url)
    sub = deltasync.Subscriber(store, workers=1, progress=False)
    watch = store.watch(0)
    try:
        for v in watch:
            sub.update_dir(out, v)
            queue.put((index, v, time.time()))
            if v >= last:
                break
    finally:
        watch.close()


def start_chain(upstream: Any, root: Path, depth: int, mode: str) -> list[Any]:
    """``depth`` relays, the first reading ``upstream``, each next one reading the one above."""
    from deltasync.relay.server import build_server

    relays: list[Any] = []
    for level in range(depth):
        source = upstream if not relays else relays[-1].url
        relays.append(build_server(source, "127.0.0.1:0", root / f"cache-{mode}-{level}", poll_interval=0.1,
                                   **MODES[mode]).start())
    return relays


def first_byte(root: Path, rate: float, object_mib: float, depth: int, mode: str) -> tuple[float, float]:
    """Seconds to the first and to the last byte of one fresh object read through ``depth``
    relays in ``mode``, the top one behind the link."""
    import grpc

    from deltasync.format.digest import digest
    from deltasync.storage import LocalStore, ThrottledStore
    from deltasync.storage.wire import method_path
    from deltasync.v1 import relay_pb2 as rpb

    data = np.random.default_rng(depth).bytes(int(object_mib * 2**20))
    key = f"packs/{digest(data).hex()}.pack"
    origin = LocalStore(root / f"origin-{mode}-{depth}")
    origin.put(key, data)
    relays = start_chain(ThrottledStore(origin, rate), root / f"ttfb-{depth}", depth, mode)
    try:
        with grpc.insecure_channel(relays[-1].address) as channel:
            call = channel.unary_stream(method_path("Get"), request_serializer=rpb.GetRequest.SerializeToString,
                                        response_deserializer=rpb.GetChunk.FromString)
            start = time.perf_counter()
            first = last = 0.0
            received = 0
            for chunk in call(rpb.GetRequest(key=key), timeout=600):
                if not received:
                    first = time.perf_counter() - start
                received += len(chunk.data)
            last = time.perf_counter() - start
        assert received == len(data), (received, len(data))
    finally:
        for relay in reversed(relays):
            relay.stop(grace=0)
    return first, last


def run_versions(label: str, mode: str, models: list[Any], root: Path, agents: int, rate: float, depth: int,
                 snapshot_every: int, pack_bytes: int) -> tuple[list[str], list[float]]:
    import deltasync
    from deltasync.storage import LocalStore, ThrottledStore

    root.mkdir(parents=True, exist_ok=True)
    repo_dir = root / f"repo-{label}-{mode}"
    pub = deltasync.Publisher(str(repo_dir), deltasync.PublisherConfig(snapshot_every=snapshot_every, progress=False,
                                                                       pack_bytes=pack_bytes))
    pub.publish(state_of(models[0]))  # the starting point every agent gets first (not timed)
    link = ThrottledStore(LocalStore(repo_dir), rate)
    relays = start_chain(link, root / f"chain-{label}", depth, mode)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    last = len(models)
    procs = [
        ctx.Process(target=_agent, args=(i, relays[-1].url, str(root / f"agent-{label}-{mode}-{i}"), last, queue))
        for i in range(agents)
    ]
    rows: list[str] = []
    times: list[float] = []
    try:
        for p in procs:
            p.start()
        _wait_all(queue, agents, 1)
        for v, model in enumerate(models[1:], start=2):
            before = link.bytes_read
            r = pub.publish(state_of(model))
            committed = time.time()
            done = _wait_all(queue, agents, v)
            times.append(max(done) - committed)
            rows.append(
                f"{label:5} {mode:7} v{v} {r.kind:8} stored {r.stored_bytes / 2**20:8.1f} MiB  upstream read "
                f"{(link.bytes_read - before) / 2**20:8.1f} MiB  commit -> {agents} agents verified "
                f"{times[-1]:7.2f}s (first {min(done) - committed:6.2f}s)"
            )
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        for relay in reversed(relays):
            relay.stop(grace=0)
    return rows, times


def _wait_all(queue: Any, agents: int, version: int) -> list[float]:
    times: dict[int, float] = {}
    while len(times) < agents:
        index, v, t = queue.get(timeout=900)
        if v == version:
            times[index] = t
    return list(times.values())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--versions", type=int, default=3, help="timed versions after the first")
    ap.add_argument("--mbps", type=float, default=1000.0, help="upstream link, megabits per second")
    ap.add_argument("--depth", type=int, default=1, choices=(1, 2), help="relays in a chain above the agents")
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate of the RL-like stream (1e-5: ~7%% changed)")
    ap.add_argument("--pack-mib", type=float, default=64.0, help="the publisher's pack size")
    ap.add_argument("--object-mib", type=float, default=64.0, help="object read for time to first byte (0: skip)")
    ap.add_argument("--kinds", default="delta", help="delta and/or full (full checkpoints), comma-separated")
    ap.add_argument("--modes", default="overlap,whole", help="relay modes to run, comma-separated")
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 agents, 1 version (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_gib, args.agents, args.versions, args.object_mib = 1 / 16, 2, 1, 16.0
    modes = [m for m in args.modes.split(",") if m]
    kinds = [k for k in args.kinds.split(",") if k]
    if not set(modes) <= set(MODES) or not set(kinds) <= {"delta", "full"}:
        ap.error(f"--modes takes {', '.join(MODES)}; --kinds takes delta, full")
    rate = args.mbps * 1e6 / 8
    print(f"# python -m benchmarks.bench_relay --size-gib {args.size_gib:g} --agents {args.agents} "
          f"--versions {args.versions} --mbps {args.mbps:g} --depth {args.depth} --lr {args.lr:g} "
          f"--pack-mib {args.pack_mib:g} --object-mib {args.object_mib:g} --kinds {','.join(kinds)} "
          f"--modes {','.join(modes)}")
    root = Path(tempfile.mkdtemp(prefix="deltasync-bench-relay-"))
    try:
        if args.object_mib > 0:
            print(f"# time to first byte: one {args.object_mib:g} MiB pack behind the {args.mbps:g} Mbit/s link "
                  f"({args.object_mib * 2**20 / rate:.2f}s on the link alone), relay fetch pieces of 8 MiB")
            for depth in (1, 2):
                got = {mode: first_byte(root, rate, args.object_mib, depth, mode) for mode in modes}
                for mode, (first, last) in got.items():
                    print(f"ttfb  {mode:7} {depth} relay{'s' if depth > 1 else ' '}  first byte {first:6.3f}s  "
                          f"last byte {last:6.3f}s")
                if set(got) == set(MODES):
                    print(f"ttfb  ratio   {depth} relay{'s' if depth > 1 else ' '}  first byte "
                          f"{got['overlap'][0] / got['whole'][0]:6.3f}x  last byte {got['overlap'][1] / got['whole'][1]:6.3f}x "
                          "(overlap / whole)")
        if not args.versions:
            return 0
        stats = measure_change_stats(list(rl_stream(args.lr, 4, warmup=10, cfg=TinyConfig(), seed=0)))
        layout = transformer_layout(shape_for_size(int(args.size_gib * 2**30)))
        models = list(synthetic_stream(layout, stats, args.versions, seed=1))
        print(f"# model {models[0].nbytes / 2**30:.2f} GiB bf16 (lr {args.lr:g} RL-like stream); link {args.mbps:g} "
              f"Mbit/s = {rate / 2**20:.0f} MiB/s; full checkpoint over the link alone: {models[0].nbytes / rate:.1f}s")
        rows: list[str] = []
        medians: dict[tuple[str, str], float] = {}
        for kind in kinds:
            for mode in modes:
                got_rows, times = run_versions(kind, mode, models, root / f"{kind}-{mode}", args.agents, rate,
                                               args.depth, 20 if kind == "delta" else 1, int(args.pack_mib * 2**20))
                rows += got_rows
                medians[kind, mode] = statistics.median(times)
                shutil.rmtree(root / f"{kind}-{mode}", ignore_errors=True)
        for row in rows:
            print(row)
        for kind in kinds:
            if (kind, "overlap") in medians and (kind, "whole") in medians:
                o, w = medians[kind, "overlap"], medians[kind, "whole"]
                print(f"{kind:5} median commit -> {args.agents} agents: overlap {o:.2f}s, whole {w:.2f}s, ratio {o / w:.3f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

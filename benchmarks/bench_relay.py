"""One publisher, one relay, N subscriber agents, the relay's upstream limited to a WAN link.

    python -m benchmarks.bench_relay [--size-gib 1.0] [--agents 8] [--versions 3] [--mbps 1000] [--quick]

The relay reads its upstream repository through :class:`deltasync.storage.ThrottledStore`
(``--mbps`` megabits per second, all reads together). Each agent is a process that watches
the relay (server-pushed version events) and brings its own directory to every new version
with ``Subscriber.pull_to_dir`` (every chunk verified). Per version it prints the time from
commit to all agents holding verified bits and the bytes the relay read upstream, for the
RL-like stream as deltas, next to the same versions shipped as full checkpoints (every
version a snapshot) over the same link.

All agents share this machine's cores (2 here): past the link, the times are bound by the
agents rebuilding and verifying their copies, not by the network.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench_s3 import state_of
from benchmarks.rl_stream import TinyConfig, measure_change_stats, rl_stream, shape_for_size, synthetic_stream, transformer_layout


def _agent(index: int, url: str, out: str, last: int, queue: Any) -> None:
    import deltasync
    from deltasync.storage._grpc import GrpcStore

    store = GrpcStore(url)
    sub = deltasync.Subscriber(store, workers=1, progress=False)
    watch = store.watch(0)
    try:
        for v in watch:
            sub.pull_to_dir(out, v)
            queue.put((index, v, time.time()))
            if v >= last:
                break
    finally:
        watch.close()


def run_mode(label: str, models: list[Any], root: Path, agents: int, rate: float, snapshot_every: int) -> list[str]:
    import deltasync
    from deltasync.relay.server import build_server
    from deltasync.storage import LocalStore, ThrottledStore

    repo_dir = root / f"repo-{label}"
    pub = deltasync.Publisher(str(repo_dir), deltasync.PublisherConfig(snapshot_every=snapshot_every, progress=False))
    pub.publish(state_of(models[0]))  # the starting point every agent gets first (not timed)
    link = ThrottledStore(LocalStore(repo_dir), rate)
    relay = build_server(link, "127.0.0.1:0", root / f"cache-{label}", poll_interval=0.1).start()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    last = len(models)
    procs = [
        ctx.Process(target=_agent, args=(i, relay.url, str(root / f"agent-{label}-{i}"), last, queue))
        for i in range(agents)
    ]
    rows: list[str] = []
    try:
        for p in procs:
            p.start()
        _wait_all(queue, agents, 1)
        for v, model in enumerate(models[1:], start=2):
            before = link.bytes_read
            r = pub.publish(state_of(model))
            committed = time.time()
            done = _wait_all(queue, agents, v)
            rows.append(
                f"{label:6} v{v} {r.kind:8} stored {r.stored_bytes / 2**20:8.1f} MiB  upstream read "
                f"{(link.bytes_read - before) / 2**20:8.1f} MiB  commit -> {agents} agents verified "
                f"{max(done) - committed:7.2f}s (first {min(done) - committed:6.2f}s)"
            )
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        relay.stop()
    return rows


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
    ap.add_argument("--quick", action="store_true", help="64 MiB, 2 agents, 1 version (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_gib, args.agents, args.versions = 1 / 16, 2, 1
    rate = args.mbps * 1e6 / 8
    print(f"# python -m benchmarks.bench_relay --size-gib {args.size_gib:g} --agents {args.agents} "
          f"--versions {args.versions} --mbps {args.mbps:g}")
    stats = measure_change_stats(list(rl_stream(1e-6, 4, warmup=10, cfg=TinyConfig(), seed=0)))
    layout = transformer_layout(shape_for_size(int(args.size_gib * 2**30)))
    models = list(synthetic_stream(layout, stats, args.versions, seed=1))
    print(f"# model {models[0].nbytes / 2**30:.2f} GiB bf16 (lr 1e-6 RL-like stream); link {args.mbps:g} Mbit/s "
          f"= {rate / 2**20:.0f} MiB/s; full checkpoint over the link alone: {models[0].nbytes / rate:.1f}s")
    root = Path(tempfile.mkdtemp(prefix="deltasync-bench-relay-"))
    try:
        rows = run_mode("delta", models, root, args.agents, rate, snapshot_every=20)
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir()
        rows += run_mode("full", models, root, args.agents, rate, snapshot_every=1)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

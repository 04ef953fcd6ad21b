"""Issue 30 item 2: the upstream requests a cluster relay makes for one new version, in order.

    python -m benchmarks.trace_tree [--mib 16] [--rtt 200]

The ``tree`` row of bench_wan in one process, small: a local repository -> root relay ->
modelled link (``--rtt``) -> cluster relay -> an engine-first agent following it. The
cluster relay's upstream (its GrpcStore across the link) is wrapped to log every request
(start and end relative to the commit of the delta, what it asked for); printed once the
engine holds the delta, with the serial round trips counted (requests that started after
the previous ones ended, roughly one round trip each).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_engine_agent import first_state, layout
from benchmarks.bench_wan import step
from benchmarks.wan_link import Link


class Log:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[tuple[float, float, str, str]] = []
        self.origin = time.monotonic()

    def wrap(self, store: Any) -> None:
        for name in ("_get", "_size", "_list"):
            inner = getattr(store, name)

            def logged(*args: Any, _inner: Any = inner, _name: str = name, **kw: Any) -> Any:
                began = time.monotonic()
                try:
                    return _inner(*args, **kw)
                finally:
                    what = args[0] + (f" {args[1][0]}+{args[1][1]}" if len(args) > 1 and args[1] else "")
                    with self.lock:
                        self.rows.append((began, time.monotonic(), _name[1:], what))

            setattr(store, name, logged)
        opened = store.watch
        log = self

        class Watched:
            def __init__(self, after: int) -> None:
                self.inner = opened(after)

            def __iter__(self) -> Any:
                return self

            def __next__(self) -> int:
                version: int = next(self.inner)
                now = time.monotonic()
                with log.lock:
                    log.rows.append((now, now, "event", f"Watch announces v{version}"))
                return version

            def close(self) -> None:
                self.inner.close()

            @property
            def copies(self) -> Any:
                return getattr(self.inner, "copies", [])

        store.watch = Watched

    def since(self, t0: float) -> list[tuple[float, float, str, str]]:
        with self.lock:
            return sorted(r for r in self.rows if r[1] >= t0)


def serial_steps(rows: list[tuple[float, float, str, str]], t0: float, rtt: float) -> int:
    """Round trips spent waiting: each maximal run of requests overlapping in time counts
    its length in round trips (at least one)."""
    steps = 0
    end = t0
    group_start = None
    for began, ended, _, _ in rows:
        if group_start is None or began > end:
            if group_start is not None:
                steps += max(1, round((end - group_start) / rtt))
            group_start = began
            end = ended
        else:
            end = max(end, ended)
    if group_start is not None:
        steps += max(1, round((end - group_start) / rtt))
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--rtt", type=float, default=200, help="ms")
    ap.add_argument("--mbps", type=float, default=800)
    args = ap.parse_args()
    rtt = args.rtt / 1000

    import deltasync
    from deltasync.agents import AgentConfig, EngineAgent
    from deltasync.engines import TorchEngine
    from deltasync.relay import RelayConfig, build_server
    from deltasync.relay.server import open_upstream
    from deltasync.repo.repository import Repository
    from deltasync.storage._grpc import GrpcStore

    shapes = layout(args.mib)
    states = [first_state(shapes)]
    second = {n: t.clone() for n, t in states[0].items()}
    step(second, 1, 0.2)
    states.append(second)
    log = Log()
    with tempfile.TemporaryDirectory(prefix="trace-tree-") as tmp:
        root = Path(tmp)
        repo = root / "origin"
        pub = deltasync.Publisher(str(repo), deltasync.PublisherConfig(progress=False, snapshot_every=1000))
        Repository(str(repo)).create()
        top = build_server(str(repo), "127.0.0.1:0", root / "cache-root").start()
        link = Link(top.address, rtt=rtt, mbps=args.mbps).start()
        upstream = open_upstream(f"grpc://{link.address}", RelayConfig(listen="127.0.0.1:0"))  # as a relay opens it
        assert isinstance(upstream, GrpcStore)
        log.wrap(upstream)
        cluster = build_server(upstream, "127.0.0.1:0", root / "cache-cluster").start()
        held = threading.Event()

        class Timed(TorchEngine):
            def swap(self, staged: Any) -> Any:
                record = super().swap(staged)
                held.set()
                return record

            def load(self, version: int | None = None) -> Any:
                record = super().load(version)
                held.set()
                return record

        model = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes}
        agent = EngineAgent(Timed(model, f"grpc://{cluster.address}", workers=1), root / "agent",
                            AgentConfig(workers=1, progress=False))
        runner = threading.Thread(target=agent.run, kwargs={"follow": True}, daemon=True)
        runner.start()
        time.sleep(1.0)
        try:
            for i, state in enumerate(states):
                held.clear()
                before = link.counts()
                pub.publish(state)
                t0 = time.monotonic()
                assert held.wait(300), "the agent held no new version"
                done = time.monotonic()
                after = link.counts()
                rows = log.since(t0)
                crossed = max(after[0] - before[0], after[1] - before[1])
                link_time = crossed / (args.mbps * 1e6 / 8)
                print(f"v{i + 1} ({'snapshot' if i == 0 else 'delta'}): held {done - t0:.2f}s after the commit, "
                      f"{len(rows)} upstream requests, {crossed / 1e6:.1f} MB crossed (transfer {link_time:.2f}s), "
                      f"about {serial_steps(rows, t0, rtt)} serial round trips")
                for began, ended, op, what in rows:
                    print(f"    {began - t0:7.3f} -> {ended - t0:7.3f}  {op:5} {what}")
                time.sleep(0.5)
        finally:
            agent.stop()
            runner.join(30)
            cluster.stop(grace=0)
            link.stop()
            top.stop(grace=0)


if __name__ == "__main__":
    main()

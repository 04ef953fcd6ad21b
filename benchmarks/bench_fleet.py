"""Fleet reports: relay memory for a large fleet, and how soon the root's view shows a new version.

    python -m benchmarks.bench_fleet [--nodes 10000] [--clusters 4] [--per-cluster 32] [--agents 1]

1. **Memory.** ``--nodes`` reports (each as agents send them: node and cluster names, a
   version digest, a repository identity, a target, an error on every tenth) are sent to a
   real relay over gRPC in batches, as relays below forward them; the relay's fleet table is
   then measured with tracemalloc (the Python heap it holds; the table keeps each report
   serialized) next to the same table empty, and the figure is printed against the 16 MiB
   target as a ratio.
2. **Freshness.** A root relay and ``--clusters`` cluster relays below it (forwarding every
   0.5 s); ``--per-cluster`` nodes per cluster report to their cluster's relay through the
   reporters' own client code (:class:`deltasync.agents.report.Reporter` over an agent state
   directory for ``--agents`` real `deltasync subscribe` processes per cluster; in-process
   :class:`~deltasync.storage.fleet.FleetClient` reporters for the rest). A new version
   is published; every node takes it (the real agents by pulling it, the others at a random
   moment within 0.5 s, reporting at once as the reporter does on a change), and the time from
   the last node taking it to the root's view showing every node at it is printed, against
   the 2 s target as a ratio.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

from deltasync.v1 import fleet_pb2 as fpb

TOKEN = "bench-report-token"


def _report(node: str, cluster: str, version: int, error: bool = False) -> fpb.NodeReport:
    return fpb.NodeReport(
        node=node, cluster=cluster, engine="torch", version=version, version_digest=os.urandom(16),
        repository_id=os.urandom(16), check="ok", check_unix=time.time(), lag_seconds=0.0,
        last_error="update failed: relay unreachable (unavailable: connection refused)" if error else "",
        bytes_fetched=123456789, sent_unix=time.time(), interval=2.0, target_version=version, agent_state="idle",
    )


def memory(nodes: int, repo: str) -> None:
    from deltasync.relay import build_server
    from deltasync.relay.fleet import FleetTable
    from deltasync.storage.fleet import FleetClient

    reports = [_report(f"host-{i:05d}.cluster-{i % 4}.example.com:agent", f"cluster-{i % 4}", 7, i % 10 == 0)
               for i in range(nodes)]
    with build_server(repo, "127.0.0.1:0", report_tokens=[(TOKEN, None)]) as relay:
        tracemalloc.start()
        empty = FleetTable()
        base = tracemalloc.get_traced_memory()[0]
        del empty
        with FleetClient(relay.url, report_token=TOKEN) as client:
            t0 = time.perf_counter()
            client.report(reports)
            sent = time.perf_counter() - t0
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert len(relay.fleet.table) == nodes
        t0 = time.perf_counter()
        with FleetClient(relay.url) as client:
            view = client.view()
        viewed = time.perf_counter() - t0
    size = sum(len(r.SerializeToString()) for r in reports) / nodes
    mib = (held - base) / 2**20
    print(f"memory: {nodes} nodes ({size:.0f} B per serialized report): relay heap for the table "
          f"{mib:.2f} MiB = {mib / 16:.3f}x the 16 MiB target ({(held - base) / nodes:.0f} B per node); "
          f"sent in {sent:.2f}s, a view of all {len(view.nodes)} in {viewed:.2f}s")


def freshness(clusters: int, per_cluster: int, agents: int, workdir: Path) -> None:
    import torch

    from deltasync import PlanesZstdCodec, Publisher, PublisherConfig
    from deltasync.relay import build_server
    from deltasync.storage.fleet import FleetClient

    repo = workdir / "repo"
    pub = Publisher(str(repo), PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=1 << 16), workers=1, progress=False))
    pub.publish({"w": torch.zeros(1 << 16, dtype=torch.float32)})
    tokens = [(TOKEN, None)]
    env = {**os.environ, "DELTASYNC_REPORT_TOKEN": TOKEN}
    with build_server(str(repo), "127.0.0.1:0", report_tokens=tokens, cluster="root", poll_interval=0.1) as root:
        relays = [build_server(root.url, "127.0.0.1:0", report_tokens=tokens, cluster=f"c{c}", report_interval=0.5,
                               poll_interval=0.1).start() for c in range(clusters)]
        procs: list[subprocess.Popen[bytes]] = []
        clients = [FleetClient(r.url, report_token=TOKEN) for r in relays]
        try:
            for c, relay in enumerate(relays):
                for a in range(agents):
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "deltasync", "subscribe", "--repo", relay.url, "--out",
                         str(workdir / f"c{c}-agent{a}"), "--follow", "--poll-interval", "0.1", "--node",
                         f"c{c}-agent{a}", "--report-interval", "0.5", "--quiet"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
            light = [(c, f"c{c}-n{i}") for c in range(clusters) for i in range(agents, per_cluster)]
            for c, node in light:
                clients[c].report([_report(node, "", 1)])
            total = clusters * per_cluster
            with FleetClient(root.url) as viewer:
                _wait_all(viewer, total, 1, timeout=120)
                pub.publish({"w": torch.ones(1 << 16, dtype=torch.float32)})
                published = time.monotonic()
                took: list[float] = []

                def take(c: int, node: str) -> None:
                    time.sleep(random.uniform(0, 0.5))
                    clients[c].report([_report(node, "", 2)])
                    took.append(time.monotonic())

                threads = [threading.Thread(target=take, args=cn) for cn in light]
                for t in threads:
                    t.start()
                shown = _wait_all(viewer, total, 2, timeout=120)
                for t in threads:
                    t.join()
                last_light = max(took)
                agent_times = _agent_times(workdir, clusters, agents)
                last = max([last_light, *agent_times])
            print(f"freshness: {clusters} clusters x {per_cluster} nodes ({agents} real agent processes per "
                  f"cluster): the root's view showed version 2 on all {total} nodes {shown - last:.2f}s after "
                  f"the last node took it ({(shown - last) / 2.0:.2f}x the 2 s target; {shown - published:.2f}s "
                  "after the publish)")
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(30)
            for client in clients:
                client.close()
            for relay in relays:
                relay.stop()


def _agent_times(workdir: Path, clusters: int, agents: int) -> list[float]:
    """When each real agent's copy took version 2, on this clock (its state's install time)."""
    from deltasync.agents import read_status

    out = []
    for c in range(clusters):
        for a in range(agents):
            s = read_status(workdir / f"c{c}-agent{a}")
            installed = s.get("installed_unix") or time.time()
            out.append(time.monotonic() - (time.time() - float(installed)))
    return out


def _wait_all(viewer: object, total: int, version: int, *, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = viewer.view()  # type: ignore[attr-defined]
        if len(view.nodes) == total and all(r.version == version for r in view.nodes):
            return time.monotonic()
        time.sleep(0.02)
    raise SystemExit(f"the root's view did not show version {version} on all {total} nodes in {timeout}s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--clusters", type=int, default=4)
    p.add_argument("--per-cluster", type=int, default=32)
    p.add_argument("--agents", type=int, default=1, help="real agent processes per cluster")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        work = Path(tmp)
        import torch

        from deltasync import Publisher

        Publisher(str(work / "mem-repo")).publish({"w": torch.zeros(16)})
        memory(args.nodes, str(work / "mem-repo"))
        freshness(args.clusters, args.per_cluster, args.agents, work)


if __name__ == "__main__":
    main()

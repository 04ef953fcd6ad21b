"""The last mile: a version pulled into a held directory copy, next to a plain copy of the checkpoint.

    python -m benchmarks.bench_lastmile [--sizes 1,2,4,8] [--fraction 0.01] [--versions 3] [--same-bytes]

For each size: a transformer-shaped bf16 checkpoint (one safetensors file of 64 MiB
tensors, plus a config) and ``--versions`` RL-like steps, each changing ``--fraction`` of
the elements at random positions by one ulp (the bulk of a real step, see rl_stream.py),
are published to a local repository. A subscriber process pulls versions 1 and 2 (filling
both slots), then every later version into the held copy; each of those pulls is timed
next to ``cp -r`` of the checkpoint directory taken in the same run (page cache warm for
both; neither flushes to disk). Printed per size: the median pull time, the copy time,
their ratio, bytes the pull wrote whole, chunks updated in place, and the subscriber
process's peak RSS.

``--same-bytes`` keeps the changed *bytes* equal across sizes (the fraction scaled by
1 GiB / size): the target "per-version time at 8 GiB within 1.5x of 1 GiB at the same
changed bytes".

Last, a projection for a 1 TB model from the rates measured at the largest size (publish
and pull seconds per GiB per core, stored bytes per raw byte of a delta) and the stated
deployment (``--ranks`` trainer ranks publishing their shares in parallel, ``--clusters``
relays each behind a WAN link of ``--wan-gbps``, ``--agents`` agents per cluster served by
their relay at ``--lan-gbps``, ``--node-cores`` cores per agent). Stages are added in
sequence, with no overlap: an upper bound on commit-to-every-agent time; a second total lets
the relay's two links overlap, as a relay streaming what it is still fetching does. Per-core rates
are assumed to scale with cores (the work is per chunk, in parallel; memory bandwidth is
the first limit this ignores).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Repository, Subscriber
from deltasync.format.checkpoint import build_header

TENSOR_BYTES = 64 << 20
ROWS, COLS = TENSOR_BYTES // 2 // 4096, 4096


def write_first(path: Path, tensors: int, rng: np.random.Generator) -> None:
    shape: tuple[int, ...] = (ROWS, COLS)
    header, _ = build_header([(f"layers.{i}.weight", "BF16", shape, TENSOR_BYTES) for i in range(tensors)])
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "model.safetensors", "wb") as f:
        f.write(header)
        for _ in range(tensors):  # one tensor at a time: memory stays at one tensor
            bits = (rng.normal(0, 0.02, ROWS * COLS).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            f.write(bits.tobytes())
    (path / "config.json").write_text('{"step": 1}')


def step(path: Path, version: int, fraction: float, rng: np.random.Generator) -> None:
    """Move ``fraction`` of the elements by one ulp, in place, one tensor at a time."""
    target = path / "model.safetensors"
    with open(target, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    data = np.memmap(target, dtype=np.uint16, mode="r+", offset=8 + header)
    per = ROWS * COLS
    for start in range(0, data.size, per):
        pos = np.unique(rng.integers(0, per, int(per * fraction))) + start
        data[pos] += np.uint16(1)
    data.flush()
    del data
    (path / "config.json").write_text(f'{{"step": {version}}}')


def cp_seconds(src: Path, dest: Path) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dest)], check=True)
    elapsed = time.perf_counter() - start
    shutil.rmtree(dest, ignore_errors=True)
    return elapsed


def peak_rss() -> int:
    """This process's peak resident set in bytes (VmHWM: unlike ru_maxrss, it does not carry
    over the parent's peak through fork and exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def subscriber(conn: Connection, repo: str, out: str, workers: int) -> None:
    """A subscriber in its own process (its peak RSS is its own): pulls the versions it is sent."""
    sub = Subscriber(repo, workers=workers, progress=False)
    while True:
        version = conn.recv()
        if version is None:
            return
        start = time.perf_counter()
        result = sub.update_dir(out, version)
        elapsed = time.perf_counter() - start
        rss = peak_rss()
        conn.send((elapsed, result.bytes_written, result.walked, result.rebuilt, rss, str(result)))


def run_size(tmp: Path, gib: float, fraction: float, versions: int, workers: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    tensors = max(1, int(gib * (1 << 30)) // TENSOR_BYTES)
    repo, out, cache, ckpt = tmp / "repo", tmp / "out", tmp / "cache", tmp / "ckpt"
    pub = Publisher(str(repo), PublisherConfig(codec=PlanesZstdCodec(), workers=workers, progress=False,
                                               snapshot_every=1000))
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=subscriber, args=(there, str(repo), str(out), workers))
    proc.start()
    pulls: list[float] = []
    publishes: list[float] = []
    stored: list[int] = []
    copies: list[float] = []
    written: list[int] = []
    walked: list[int] = []
    rss = 0
    try:
        for v in range(1, versions + 3):
            if v == 1:
                write_first(ckpt, tensors, rng)
            else:
                step(ckpt, v, fraction, rng)
            start = time.perf_counter()
            pub.publish_dir(ckpt, cache_dir=cache)
            published = time.perf_counter() - start
            here.send(v)
            elapsed, nbytes, nwalked, _rebuilt, rss, how = here.recv()
            if v > 2:  # both slots in use: the steady state
                pulls.append(elapsed)
                publishes.append(published)
                stored.append(Repository(str(repo)).manifest(v).pb.stored_bytes)
                written.append(nbytes)
                walked.append(nwalked)
                copies.append(cp_seconds(ckpt, tmp / "copy"))
                print(f"    v{v}: pull {elapsed:.3f}s ({how})", flush=True)
        here.send(None)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    pull, copy = statistics.median(pulls), statistics.median(copies)
    return {
        "gib": tensors * TENSOR_BYTES / (1 << 30), "fraction": fraction, "pull_s": pull, "copy_s": copy,
        "ratio": pull / copy, "written": statistics.median(written), "walked": statistics.median(walked),
        "rss_mib": rss / (1 << 20), "publish_s": statistics.median(publishes),
        "stored_ratio": statistics.median(stored) / (tensors * TENSOR_BYTES),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,4,8", help="GiB, comma-separated")
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--versions", type=int, default=3, help="timed versions per size (after the two that fill the slots)")
    ap.add_argument("--workers", type=int, default=0, help="default: one per core")
    ap.add_argument("--same-bytes", action="store_true", help="scale the fraction so every size changes what 1 GiB does")
    ap.add_argument("--dir", default=None, help="where to work (default: a temporary directory under .)")
    ap.add_argument("--ranks", type=int, default=64, help="projection: trainer ranks publishing shares")
    ap.add_argument("--upload-gbps", type=float, default=10.0, help="projection: upload bandwidth per rank")
    ap.add_argument("--clusters", type=int, default=4, help="projection: clusters, one relay each")
    ap.add_argument("--wan-gbps", type=float, default=10.0, help="projection: each relay's upstream link")
    ap.add_argument("--agents", type=int, default=32, help="projection: agents per cluster")
    ap.add_argument("--lan-gbps", type=float, default=25.0, help="projection: each relay's link to its agents")
    ap.add_argument("--node-cores", type=int, default=32, help="projection: cores per trainer rank and per agent")
    args = ap.parse_args()
    rows = []
    for gib in (float(s) for s in args.sizes.split(",")):
        fraction = args.fraction / gib if args.same_bytes else args.fraction
        with tempfile.TemporaryDirectory(prefix="bench-lastmile-", dir=args.dir or ".") as d:
            rows.append(run_size(Path(d), gib, fraction, args.versions, args.workers))
    print(f"{'size':>6} {'changed':>8} {'pull/version':>13} {'cp -r':>8} {'ratio':>6} {'written whole':>14} "
          f"{'in place':>9} {'peak RSS':>9}")
    for r in rows:
        print(f"{r['gib']:>5.3g}G {r['fraction']:>8.4%} {r['pull_s']:>12.3f}s {r['copy_s']:>7.3f}s {r['ratio']:>6.3f} "
              f"{r['written'] / 2**20:>10.1f} MiB {r['walked']:>9.0f} {r['rss_mib']:>5.0f} MiB")
    first = rows[0]
    print(f"target: pull <= 0.1x cp -r at {first['gib']:.3g} GiB: {first['ratio']:.3f}x "
          f"({'PASS' if first['ratio'] <= 0.1 else 'MISS'})")
    if len(rows) > 1:
        growth = rows[-1]["pull_s"] / first["pull_s"]
        what = "same changed bytes; target <= 1.5x" if args.same_bytes else "same changed fraction"
        print(f"pull time at {rows[-1]['gib']:.3g} GiB / at {first['gib']:.3g} GiB: {growth:.2f}x ({what})")
    print(f"peak RSS of the subscriber: {max(r['rss_mib'] for r in rows):.0f} MiB (target < 2048 MiB)")
    project(rows[-1], args)


def project(r: dict[str, float], args: argparse.Namespace) -> None:
    """Commit-to-every-agent time for a 1 TB model, from the rates measured in ``r``."""
    cores = os.cpu_count() or 1
    model = 1e12
    gib = r["gib"] * (1 << 30)
    publish_core_s = r["publish_s"] * cores / gib  # seconds per byte on one core
    pull_core_s = r["pull_s"] * cores / gib
    delta = model * r["stored_ratio"]
    stages = [
        ("encode: each rank diffs its share", model / args.ranks * publish_core_s / args.node_cores,
         f"{r['publish_s']:.2f} s per {r['gib']:.3g} GiB on {cores} cores, measured"),
        ("upload: each rank its share of the delta", delta / args.ranks * 8 / (args.upload_gbps * 1e9),
         f"delta = {r['stored_ratio']:.4f} x raw, measured; {args.upload_gbps:g} Gbit/s per rank"),
        ("WAN: each relay reads the delta once", delta * 8 / (args.wan_gbps * 1e9),
         f"{args.clusters} relays in parallel, {args.wan_gbps:g} Gbit/s each"),
        ("LAN: a relay serves its agents", delta * args.agents * 8 / (args.lan_gbps * 1e9),
         f"{args.agents} agents, {args.lan_gbps:g} Gbit/s relay egress"),
        ("apply: each agent updates its 1 TB copy", model * pull_core_s / args.node_cores,
         f"{r['pull_s']:.2f} s per {r['gib']:.3g} GiB on {cores} cores, measured; {args.node_cores} cores"),
    ]
    print(f"\nprojection: 1 TB model, {r['fraction']:.2%} of elements changed, {args.ranks} ranks, "
          f"{args.clusters} clusters x {args.agents} agents ({args.clusters * args.agents} copies)")
    print(f"| {'stage':<42} | {'seconds':>8} | basis")
    print(f"|{'-' * 44}|{'-' * 10}|------")
    for name, seconds, basis in stages:
        print(f"| {name:<42} | {seconds:>8.1f} | {basis}")
    total = sum(seconds for _, seconds, _ in stages)
    full = model * 8 / (args.wan_gbps * 1e9) + model * args.agents * 8 / (args.lan_gbps * 1e9)
    print(f"| {'commit -> every agent verified (sum)':<42} | {total:>8.1f} | stages in sequence: an upper bound")
    # The relay serves each piece of a pack as it lands and warms a version when it hears of
    # it (relay/fetch.py; bench_relay measures it): its two links overlap, one piece apart.
    wan, lan = stages[2][1], stages[3][1]
    piece = 8 << 20
    relay = max(wan, lan) + piece * 8 / (args.wan_gbps * 1e9)
    print(f"| {'... with the relay streaming (WAN || LAN)':<42} | {total - wan - lan + relay:>8.1f} | "
          f"WAN + LAN {wan + lan:.1f} s -> {relay:.1f} s: the slower link plus one 8 MiB piece on the WAN")
    print(f"| {'full checkpoints, links alone':<42} | {full:>8.1f} | 1 TB over the WAN, then to {args.agents} agents")


if __name__ == "__main__":
    main()

"""The last mile: a version pulled into a held directory copy, next to a plain copy of the checkpoint.

    python -m benchmarks.bench_lastmile [--sizes 1,2,4,8] [--fraction 0.01] [--versions 3]

For each size: a transformer-shaped bf16 checkpoint (one safetensors file) and ``--versions``
RL-like steps, each changing ``--fraction`` of the elements at random positions by ±1 ulp
(the bulk of a real step, see rl_stream.py), are published to a local repository. A
subscriber pulls version 1 and 2 (filling both slots), then every later version into the
held copy; each of those pulls is timed next to ``cp -r`` of the checkpoint directory taken
in the same run (page cache warm for both; neither flushes to disk). Printed per size: the
median pull time, the copy time, their ratio, the bytes the pull wrote whole, the chunks
updated in place, and this process's peak RSS so far.

A second table, ``--same-bytes``, keeps the changed *bytes* equal across sizes (the
fraction scaled by 1 GiB / size), the target's "per-version time at 8 GiB within 1.5x of
1 GiB at the same changed bytes".
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Subscriber
from deltasync.checkpoint import build_header

TENSOR_BYTES = 64 << 20


def write_version(path: Path, bits: np.ndarray, step: int) -> None:
    n = bits.nbytes // TENSOR_BYTES
    shape: tuple[int, ...] = (TENSOR_BYTES // 2 // 4096, 4096)
    tensors = [(f"layers.{i}.weight", "BF16", shape, TENSOR_BYTES) for i in range(n)]
    header, _ = build_header(tensors)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "model.safetensors", "wb") as f:
        f.write(header)
        f.write(bits.view(np.uint8).data)
    (path / "config.json").write_text(f'{{"step": {step}}}')


def step(bits: np.ndarray, fraction: float, rng: np.random.Generator) -> None:
    count = int(bits.size * fraction)
    pos = rng.choice(bits.size, size=count, replace=False)
    bits[pos] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), size=count)  # ±1 ulp (bit pattern)


def cp_seconds(src: Path, dest: Path) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dest)], check=True)
    return time.perf_counter() - start


def run_size(tmp: Path, gib: float, fraction: float, versions: int, workers: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    n = int(gib * (1 << 30)) // TENSOR_BYTES * TENSOR_BYTES // 2
    bits = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    repo, out, cache = tmp / "repo", tmp / "out", tmp / "cache"
    pub = Publisher(str(repo), PublisherConfig(codec=PlanesZstdCodec(), workers=workers, progress=False, snapshot_every=1000))
    ckpt = tmp / "ckpt"
    sub = Subscriber(str(repo), workers=workers, progress=False)
    pulls: list[float] = []
    copies: list[float] = []
    written: list[int] = []
    walked: list[int] = []
    for v in range(1, versions + 3):
        if v > 1:
            step(bits, fraction, rng)
        shutil.rmtree(ckpt, ignore_errors=True)
        write_version(ckpt, bits, v)
        pub.publish_dir(ckpt, cache_dir=cache)
        start = time.perf_counter()
        result = sub.update_dir(out, v)
        elapsed = time.perf_counter() - start
        if v > 2:  # both slots in use: the steady state
            pulls.append(elapsed)
            written.append(result.bytes_written)
            walked.append(result.walked)
            copies.append(cp_seconds(ckpt, tmp / "copy"))
    shutil.rmtree(tmp / "copy", ignore_errors=True)
    pull, copy = statistics.median(pulls), statistics.median(copies)
    return {
        "gib": gib, "fraction": fraction, "pull_s": pull, "copy_s": copy, "ratio": pull / copy,
        "written": statistics.median(written), "walked": statistics.median(walked),
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,4,8", help="GiB, comma-separated")
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--versions", type=int, default=3, help="timed versions per size (after the two that fill the slots)")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--same-bytes", action="store_true", help="scale the fraction so every size changes the bytes 1 GiB does")
    args = ap.parse_args()
    print(f"{'size':>6} {'changed':>8} {'pull/version':>13} {'cp -r':>8} {'ratio':>6} {'written whole':>14} "
          f"{'in place':>9} {'peak RSS':>9}")
    rows = []
    for gib in (float(s) for s in args.sizes.split(",")):
        fraction = args.fraction / gib if args.same_bytes else args.fraction
        with tempfile.TemporaryDirectory(prefix="bench-lastmile-", dir=".") as d:
            r = run_size(Path(d), gib, fraction, args.versions, args.workers)
        rows.append(r)
        print(f"{gib:>5.0f}G {fraction:>8.4%} {r['pull_s']:>12.3f}s {r['copy_s']:>7.3f}s {r['ratio']:>6.3f} "
              f"{r['written'] / 2**20:>11.1f} MiB {r['walked']:>9.0f} {r['rss_mib']:>6.0f} MiB", flush=True)
    first = rows[0]
    print(f"target: pull <= 0.1x cp -r at {first['gib']:.0f} GiB: {first['ratio']:.3f}x "
          f"({'PASS' if first['ratio'] <= 0.1 else 'MISS'})")
    if len(rows) > 1:
        growth = rows[-1]["pull_s"] / first["pull_s"]
        print(f"pull time at {rows[-1]['gib']:.0f} GiB / at {first['gib']:.0f} GiB: {growth:.2f}x"
              + (" (same changed bytes; target <= 1.5x)" if args.same_bytes else " (same changed fraction)"))


if __name__ == "__main__":
    main()

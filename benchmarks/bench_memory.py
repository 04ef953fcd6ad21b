"""Peak memory while publishing and pulling a checkpoint far larger than the memory used.

    python -m benchmarks.bench_memory [--size-gib 8] [--dir DIR] [--quick]

Writes a sharded bf16 safetensors checkpoint of ``--size-gib`` (512 MiB shards, written a
block at a time), and a second one with about 1% of elements moved by one ulp. Each phase
runs in a child process of its own, and the child's peak RSS comes from the kernel
(``os.wait4`` rusage): publish the first version (a snapshot), publish the second against the
first directory (a delta), pull the second into an empty directory (snapshot + chain,
every chunk and file digest verified), and check the pulled files against the source.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SHARD_BYTES = 512 << 20
BLOCK = 64 << 20


def _header(name: str, nbytes: int) -> bytes:
    import json

    body = json.dumps({name: {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [0, nbytes]}}).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def write_checkpoints(root: Path, size: int, seed: int = 0) -> tuple[Path, Path]:
    """Two checkpoints of ``size`` bytes: random bf16 weights, then ~1% of them one ulp off."""
    a, b = root / "step-1", root / "step-2"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    shards = max(1, size // SHARD_BYTES)
    for s in range(shards):
        name = f"layers.{s}.weight"
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        with open(a / fname, "wb") as fa, open(b / fname, "wb") as fb:
            header = _header(name, SHARD_BYTES)
            fa.write(header)
            fb.write(header)
            for _ in range(SHARD_BYTES // BLOCK):
                # bf16 of N(0, 0.02)-like magnitudes: sign, exponent 0x3c±, random mantissa
                x = rng.integers(0, 1 << 16, BLOCK // 2, dtype=np.uint16)
                x = ((x & 0x807F) | 0x3C00 | (((x >> 7) & 0x3) << 7)).astype(np.uint16)  # exponents 2^-7 .. 2^-4
                fa.write(x.tobytes())
                moved = rng.random(x.size) < 0.01
                x[moved] += np.where(rng.random(int(moved.sum())) < 0.5, 1, 0xFFFF).astype(np.uint16)
                fb.write(x.tobytes())
    return a, b


def run_phase(code: str) -> tuple[float, float]:
    """Run ``code`` in a fresh Python; return (peak RSS in MiB, seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code])
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"phase failed ({proc.returncode}): {code}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=8.0)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (needs ~4x the size free)")
    ap.add_argument("--quick", action="store_true", help="1 GiB")
    args = ap.parse_args(argv)
    size = int((1.0 if args.quick else args.size_gib) * 2**30) // SHARD_BYTES * SHARD_BYTES
    root = Path(tempfile.mkdtemp(prefix="deltasync-bench-mem-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        a, b = write_checkpoints(root, size)
        print(f"# python -m benchmarks.bench_memory --size-gib {size / 2**30:g}")
        print(f"# checkpoints: 2 x {size / 2**30:.1f} GiB bf16 in {size // SHARD_BYTES} shards, "
              f"written in {time.perf_counter() - t0:.0f}s; workers = {os.cpu_count()}")
        repo, out = root / "repo", root / "out"
        imports = "import deltasync, deltasync.publish.publisher, deltasync.pull.subscriber, torch"
        phases = [
            ("python with deltasync and torch imported", f"{imports}"),
            ("publish version 1 (snapshot)",
             f"{imports}; deltasync.Publisher({str(repo)!r}).publish_dir({str(a)!r})"),
            ("publish version 2 (delta, base = step-1)",
             f"{imports}; deltasync.Publisher({str(repo)!r}).publish_dir({str(b)!r}, base_dir={str(a)!r})"),
            ("pull version 2 into an empty directory",
             f"{imports}; deltasync.Subscriber({str(repo)!r}).update_dir({str(out)!r}, 2)"),
        ]
        for label, code in phases:
            rss, secs = run_phase(code)
            print(f"{label:45} peak RSS {rss:7.0f} MiB  {secs:6.1f}s  ({size / secs / 1e9:.2f} GB/s of checkpoint)")
        same = all(_sha(f) == _sha(out / f.name) for f in sorted(b.iterdir()))
        print(f"pulled files sha256-identical to step-2: {same}")
        if not same:
            return 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

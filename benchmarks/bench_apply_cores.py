"""The whole engine path (fetch + decode + verify + pause) with 1 worker next to 2, bit-exact.

    python -m benchmarks.bench_apply_cores [--model-mib 64] [--fractions 0.01,0.07] [--reps 3]

A bf16 model of ``--model-mib`` (tensors of 4 MiB) is published at two versions: the second
moves ``--fraction`` of the elements by one ulp at random positions (the RL streams: lr 1e-6
changes about 1%, lr 1e-5 about 7%). A :class:`TorchEngine` holding version 1 in host memory
is brought to version 2 (``engine.update``: staging on the ``workers`` pool, then the pause,
written on the same pool), with ``workers=1`` and ``workers=2`` alternately, ``--reps`` times
each; every result is checked bit for bit against version 2. Printed: the median stage and
pause seconds per worker count, the model decoded per second, and the ratio 1 worker ÷ 2
(the target: >= 1.7 for the whole path). The cores are shared with whatever else runs: the
ratio is only as good as the machine is idle (``os.getloadavg`` is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from deltasync import Publisher, PublisherConfig
from deltasync.engines import TorchEngine

TENSOR_MIB = 4
CPU: dict[int, list[float]] = {1: [], 2: []}  # cores' worth of CPU the process got per run (CPU s / wall s)


def model(mib: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    n = TENSOR_MIB << 19  # bf16 elements of a tensor
    return {f"layer{i}.weight": torch.from_numpy(rng.standard_normal(n, dtype=np.float32)).bfloat16()
            for i in range(max(1, mib // TENSOR_MIB))}


def moved(state: dict[str, torch.Tensor], fraction: float, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        words = t.view(torch.int16).clone()
        pos = torch.from_numpy(rng.choice(words.numel(), int(words.numel() * fraction), replace=False))
        words[pos] += 1  # one ulp
        out[name] = words.view(torch.bfloat16)
    return out


def run_once(repo: str, base: dict[str, torch.Tensor], want: dict[str, torch.Tensor], workers: int) -> tuple[float, float, float]:
    held = {n: t.clone() for n, t in base.items()}
    engine = TorchEngine(held, repo, version=1, workers=workers)
    t0, c0 = time.perf_counter(), time.process_time()
    record = engine.update(2)
    total = time.perf_counter() - t0
    CPU[workers].append((time.process_time() - c0) / total)
    engine.close()
    assert record is not None
    for n, t in want.items():
        if not torch.equal(held[n].view(torch.int16), t.view(torch.int16)):
            raise AssertionError(f"{n} differs from version 2 with {workers} workers")
    return record.stage_s, record.pause_s, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-mib", type=int, default=64)
    ap.add_argument("--fractions", default="0.01,0.07")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    base = model(args.model_mib, rng)
    mib = sum(t.numel() * 2 for t in base.values()) / 2**20
    print(f"model {mib:.0f} MiB bf16, cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f} at start")
    print(f"{'changed':>8} {'workers':>7} {'stage s':>8} {'pause s':>8} {'total s':>8} {'GB/s model':>10} {'1w / 2w':>8}")
    for fraction in (float(f) for f in args.fractions.split(",")):
        want = moved(base, fraction, rng)
        with tempfile.TemporaryDirectory(prefix="bench-apply-") as tmp:
            repo = str(Path(tmp) / "repo")
            pub = Publisher(repo, PublisherConfig())
            pub.publish(base)
            pub.publish(want)
            runs: dict[int, list[tuple[float, float, float]]] = {1: [], 2: []}
            for _ in range(args.reps):
                for w in (1, 2):
                    runs[w].append(run_once(repo, base, want, w))
            med = {w: tuple(statistics.median(r[i] for r in runs[w]) for i in range(3)) for w in runs}
            for w in (1, 2):
                stage, pause, total = med[w]
                ratio = f"{med[1][2] / total:8.2f}" if w == 2 else ""
                print(f"{fraction:8.0%} {w:7d} {stage:8.3f} {pause:8.4f} {total:8.3f} {mib * 2**20 / total / 1e9:10.2f} {ratio}")
            print(f"{'':8} pause 1w / 2w: {med[1][1] / med[2][1]:.2f}; spread of totals "
                  f"1w {min(r[2] for r in runs[1]):.3f}-{max(r[2] for r in runs[1]):.3f} s, "
                  f"2w {min(r[2] for r in runs[2]):.3f}-{max(r[2] for r in runs[2]):.3f} s")
    print(f"cores the process got while running (CPU s / wall s, median): 1 worker "
          f"{statistics.median(CPU[1]):.2f}, 2 workers {statistics.median(CPU[2]):.2f} (2 workers can only beat 1 "
          f"by what the machine lends: a ratio near 1 with about 1 core got measures the others, not the pool)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()

"""The whole engine path (fetch + decode + verify + pause) with 1 worker next to 2, bit-exact.

    python -m benchmarks.bench_apply_cores [--model-mib 128] [--fractions 0.01,0.07] [--reps 3]

A bf16 model of ``--model-mib`` (tensors of 4 MiB) is published at two versions: the second
moves ``--fraction`` of the elements by one ulp at random positions (the RL streams: lr 1e-6
changes about 1%, lr 1e-5 about 7%). A :class:`TorchEngine` holding version 1 in host memory
is brought to version 2 (``engine.update``: staging on the ``workers`` CPU slots, then the
pause, written on the same number of threads), with ``workers=1`` and ``workers=2``
alternately, ``--reps`` times each; every result is checked bit for bit against version 2.

Printed, medians per worker count: stage and pause seconds (wall), the whole update's wall,
and its CPU seconds split by thread: the calling thread's (``time.thread_time``) and the
workers' (each thread's ``time.thread_time`` when it exits, summed: pull, write threads).
Ratios 1 worker / 2 workers, same run, same model:

* ``wall``: what the machine gave. Only as good as the cores are free: the number of cores'
  worth of CPU the process got (CPU s / wall s) and the load average are printed beside it.
* ``cpu-bound``: ``main + workers / W`` CPU seconds, the wall on W free cores if the workers'
  CPU spreads evenly and the calling thread's never overlaps it (it partly does: an upper
  bound on the serial part). This is credible only because the mechanism really runs the
  workers' steps at once: every CPU step of a chunk holds one of W slots and every kernel it
  calls lets go of the GIL (the codec's C kernels, zstd, xxhash, numpy's compares, takes and
  fancy assignment, torch's copies); a GIL-held step would show as a wall ratio below this
  on free cores, never in CPU seconds. The target (>= 1.7) is for the wall on free cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltasync import Publisher, PublisherConfig
from deltasync.engines import TorchEngine

TENSOR_MIB = 4

#: CPU seconds of every thread that ended (name, seconds), read by the thread itself on its way out.
ENDED: list[tuple[str, float]] = []
_ENDED_LOCK = threading.Lock()


def count_thread_cpu() -> None:
    """Make every thread record its CPU time when it ends (the pools' threads end when the
    pull, or the engine, closes them): exact per-thread CPU, no sampling."""
    run: Callable[[threading.Thread], None] = threading.Thread.run

    def counted(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            with _ENDED_LOCK:
                ENDED.append((self.name, time.thread_time()))

    threading.Thread.run = counted  # type: ignore[method-assign]


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


def run_once(repo: str, base: dict[str, torch.Tensor], want: dict[str, torch.Tensor], workers: int) -> dict[str, float]:
    """One update of a fresh engine; its wall, stage, pause and CPU seconds (calling thread, workers, process)."""
    held = {n: t.clone() for n, t in base.items()}
    engine = TorchEngine(held, repo, version=1, workers=workers)
    with _ENDED_LOCK:
        ENDED.clear()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0, m0 = time.perf_counter(), time.thread_time()
    record = engine.update(2)
    total = time.perf_counter() - t0
    main = time.thread_time() - m0
    engine.close()  # its write threads end: their CPU is counted
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    with _ENDED_LOCK:
        others = sum(cpu for name, cpu in ENDED if name.startswith("deltasync-"))
    assert record is not None
    for n, t in want.items():
        if not torch.equal(held[n].view(torch.int16), t.view(torch.int16)):
            raise AssertionError(f"{n} differs from version 2 with {workers} workers")
    process = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return {"stage": record.stage_s, "pause": record.pause_s, "wall": total, "main": main, "workers": others,
            "process": process, "bound": main + others / workers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-mib", type=int, default=128)
    ap.add_argument("--fractions", default="0.01,0.07")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    count_thread_cpu()
    rng = np.random.default_rng(0)
    base = model(args.model_mib, rng)
    mib = sum(t.numel() * 2 for t in base.values()) / 2**20
    cores = len(os.sched_getaffinity(0))
    print(f"model {mib:.0f} MiB bf16, cores usable {cores} (of {os.cpu_count()}), "
          f"load average {os.getloadavg()[0]:.1f} at start")
    print(f"{'changed':>7} {'W':>2} {'stage s':>8} {'pause s':>8} {'wall s':>7} {'cpu main':>8} {'cpu wrk':>8} "
          f"{'cores got':>9} {'bound s':>8} {'wall 1/2':>8} {'bound 1/2':>9}")
    for fraction in (float(f) for f in args.fractions.split(",")):
        want = moved(base, fraction, rng)
        with tempfile.TemporaryDirectory(prefix="bench-apply-") as tmp:
            repo = str(Path(tmp) / "repo")
            pub = Publisher(repo, PublisherConfig())
            pub.publish(base)
            pub.publish(want)
            run_once(repo, base, want, 1)  # warm-up: page cache, first-call costs
            runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
            for _ in range(args.reps):
                for w in (1, 2):
                    runs[w].append(run_once(repo, base, want, w))
            med: dict[int, dict[str, Any]] = {
                w: {k: statistics.median(r[k] for r in runs[w]) for k in runs[w][0]} for w in runs}
            for w in (1, 2):
                m = med[w]
                ratios = (f"{med[1]['wall'] / m['wall']:8.2f} {med[1]['bound'] / m['bound']:9.2f}" if w == 2 else "")
                print(f"{fraction:7.0%} {w:2d} {m['stage']:8.3f} {m['pause']:8.4f} {m['wall']:7.3f} {m['main']:8.3f} "
                      f"{m['workers']:8.3f} {m['process'] / m['wall']:9.2f} {m['bound']:8.3f} {ratios}")
            print(f"{'':7} pause wall 1/2 {med[1]['pause'] / med[2]['pause']:.2f}; spread of walls "
                  f"1w {min(r['wall'] for r in runs[1]):.3f}-{max(r['wall'] for r in runs[1]):.3f} s, "
                  f"2w {min(r['wall'] for r in runs[2]):.3f}-{max(r['wall'] for r in runs[2]):.3f} s; "
                  f"load {os.getloadavg()[0]:.1f}")
    print("wall 1/2 counts only on free cores (cores got near W); bound 1/2 is the scaling the CPU seconds allow")


if __name__ == "__main__":
    main()

"""GPU staging in O(changed): bytes sent host->device per version and the pause, with the host
mirror and without, next to one full host->device copy of the model, in the same run.

    python -m benchmarks.bench_gpu_mirror [--gib 1,4,8] [--fraction 0.01] [--device cuda]

A bf16 model of each size (256 MiB tensors) is published at two versions (``--fraction`` of
the elements moved by one ulp at random) to a local repository. A :class:`TorchEngine`
holding version 1 on ``--device`` is brought to version 2, with ``host_mirror`` on (staging
reads the base from a pinned host copy and sends only values and compacted positions) and
off (today's path: each touched chunk read back from the device, int64 positions sent). Every
result is checked bit for bit. Printed per size: host->device bytes per version (counted by
the engine with the mirror; without it, the int64 positions and values it uploads, plus the
chunks it reads back device->host), ÷ the changed elements' bytes; stage and pause seconds;
and one full ``copy_`` of the model host->device (pinned) for scale. ``--device cpu`` runs the
same code on the CPU (a check of the script, not a GPU figure).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from deltasync import Publisher, PublisherConfig
from deltasync.engines import TorchEngine

TENSOR = 128 << 20  # bf16 elements per tensor: 256 MiB


def run(gib: float, fraction: float, device: str, tmp: str) -> None:
    rng = np.random.default_rng(1)
    count = max(1, int(gib * (1 << 30) / (TENSOR * 2)))
    size = min(TENSOR, int(gib * (1 << 30) / 2))
    v1 = {f"w{i}": torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, size, dtype=np.int16)).view(torch.bfloat16)
          for i in range(count)}
    v2 = {}
    changed = 0
    for name, t in v1.items():
        words = t.view(torch.int16).clone()
        pos = torch.from_numpy(rng.choice(words.numel(), int(words.numel() * fraction), replace=False))
        words[pos] += 1
        changed += pos.numel()
        v2[name] = words.view(torch.bfloat16)
    repo = f"{tmp}/repo-{gib:g}"
    pub = Publisher(repo, PublisherConfig(progress=False))
    pub.publish(v1)
    pub.publish(v2)
    raw = sum(t.numel() * 2 for t in v1.values())
    host = torch.cat([t.view(-1) for t in v1.values()]).pin_memory() if device == "cuda" else None
    dev = torch.empty(raw // 2, dtype=torch.bfloat16, device=device)
    t0 = time.perf_counter()
    dev.copy_(host if host is not None else dev)
    if device == "cuda":
        torch.cuda.synchronize()
    full = time.perf_counter() - t0
    del dev, host
    print(f"{gib:g} GiB bf16, {changed:,} elements changed ({changed * 2 / 1e6:.1f} MB); one full copy to the "
          f"device: {full * 1e3:.1f} ms")
    for mirror in (True, False):
        held = {n: t.to(device, copy=True) for n, t in v1.items()}
        engine = TorchEngine(held, repo, version=1, host_mirror=mirror, workers=0)
        record = engine.update(2)
        assert record is not None
        for n, t in v2.items():
            if not torch.equal(held[n].cpu().view(torch.int16), t.view(torch.int16)):
                raise AssertionError(f"{n} differs with host_mirror={mirror}")
        if mirror:
            h2d, d2h = engine.h2d_bytes, 0
        else:  # what today's path moves: int64 positions and values up, every touched chunk down
            h2d, d2h = changed * (8 + 2), record.chunks_changed * (raw // max(1, record.chunks_total))
            print(f"  (chunks changed {record.chunks_changed} of {record.chunks_total})")
        print(f"  host_mirror={mirror!s:<5}: host->device {h2d / 1e6:9.1f} MB = {h2d / (changed * 2):4.2f}x the changed "
              f"bytes{'' if mirror else ' (computed)'}; device->host {d2h / 1e6:9.1f} MB; stage {record.stage_s:7.3f} s, "
              f"pause {record.pause_s * 1e3:8.2f} ms")
        engine.close()
        del held, engine
        if device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", default="1,4,8")
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    import tempfile

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu to check the script")
    with tempfile.TemporaryDirectory(prefix="bench-gpu-mirror-") as tmp:
        for gib in (float(g) for g in args.gib.split(",")):
            run(gib, args.fraction, args.device, tmp)


if __name__ == "__main__":
    main()

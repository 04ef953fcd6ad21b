"""Engine swaps: the pause per swap next to a full ``copy_``, and fan-out bytes next to full weights.

    python -m benchmarks.bench_engine [--size-gib 1.0] [--changed 0.01] [--versions 3]
                                      [--ranks 4] [--fanout-gib 0.25] [--device cpu] [--fanout-device cpu] [--quick]

In-process engine: the model is the RL-like synthetic stream of ``rl_stream.py`` (a
transformer-shaped bf16 model of ``--size-gib``; per-kind change fractions and the
distribution of bit-pattern differences measured on a real AdamW run, rescaled so that
``--changed`` of all elements change per version). Every version is published to a local
repository; a :class:`TorchEngine` serving the previous version stages and swaps it in.
Per swap: pause (the exclusive write window), staging time, elements written; next to one
full ``copy_`` of all parameters measured in the same run, on the same tensors. Every swap
is checked bit for bit. A sweep over change fractions shows the pause following the changed
bytes, and "lines touched" (the share of 64-byte cache lines holding a change) is what a
CPU scatter really has to move.

Fan-out: ``--ranks`` processes in a gloo group; each holds tensor-parallel slices of every
matrix (column- or row-parallel) and whole norms; rank 0 also stages. Per version: bytes
broadcast and the pause (every rank's), next to one broadcast of the full weights in the
same group. The first swap of a fresh group has nothing to diff against and sends
everything; it is shown, not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.rl_stream import (
    ChangeStats,
    FlatModel,
    KindStats,
    Layout,
    TinyConfig,
    layout_numel,
    measure_change_stats,
    rl_stream,
    shape_for_size,
    synthetic_stream,
    transformer_layout,
)
from deltasync.testing import spawn_ranks

GIB = 2**30


def scaled_stats(stats: ChangeStats, changed: float) -> ChangeStats:
    """``stats`` with every kind's change fraction scaled so that ``changed`` of all elements change."""
    if changed <= 0:
        return stats
    factor = changed / max(stats.overall.fraction, 1e-12)

    def scale(k: KindStats) -> KindStats:
        return dataclasses.replace(k, changed=round(min(1.0, k.fraction * factor) * k.elements * k.deltas))

    return ChangeStats({n: scale(k) for n, k in stats.kinds.items()}, scale(stats.overall), stats.per_delta_fraction)


def as_state(model: FlatModel) -> dict[str, torch.Tensor]:
    """bf16 tensors that are views of the flat buffer (no copy)."""
    return {
        s.name: torch.from_numpy(model.tensor(s).view(np.int16)).view(torch.bfloat16).reshape(s.shape) for s in model.layout
    }


def lines_touched(old: FlatModel, new: FlatModel) -> float:
    changed = np.flatnonzero(old.bits != new.bits)
    lines = np.unique(changed // 32)  # 32 bf16 per 64-byte line
    return len(lines) / max(1, -(-old.bits.size // 32))


def best_of(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- in-process engine ------------------------------------------------------------------------------


def bench_torch(layout: Layout, stats: ChangeStats, fractions: Sequence[float], versions: int, args: argparse.Namespace,
                workdir: Path) -> dict[str, Any]:
    import deltasync
    from deltasync.engines import TorchEngine
    from deltasync.engines.torch_engine import TorchStaged, apply_writes

    device = torch.device(args.device)
    out: dict[str, Any] = {}
    copy_s: list[float] = []
    h2d_s: list[float] = []
    for fi, frac in enumerate(fractions):
        repo = workdir / f"repo-{fi}"
        pub = deltasync.Publisher(str(repo), deltasync.PublisherConfig(workers=args.workers))
        stream = synthetic_stream(layout, scaled_stats(stats, frac), versions, seed=args.seed + fi)
        first = next(stream)
        pub.publish(as_state(first))
        served = {n: t.clone().to(device) for n, t in as_state(first).items()}
        engine = TorchEngine(served, str(repo), version=1, workers=args.workers)
        prev = first
        rows = []
        copies: list[float] = []
        for cur in stream:
            t0 = time.perf_counter()
            v = pub.publish(as_state(cur))
            t_pub = time.perf_counter() - t0
            staged = engine.stage(v)
            assert isinstance(staged, TorchStaged)
            rec = engine.swap(staged)
            # The write window again, best of the swap and the repeats (like the copy_ baseline):
            # old values back (outside the timing), then the same writes the swap made.
            write_s = rec.pause_s
            for _ in range(args.repeats):
                staged.plan.undo()
                t0 = time.perf_counter()
                apply_writes(staged.plan)
                write_s = min(write_s, time.perf_counter() - t0)
            del staged
            want = as_state(cur)
            for name, t in served.items():  # bit for bit
                if not torch.equal(t.view(torch.int16).cpu(), want[name].view(torch.int16)):
                    raise SystemExit(f"engine holds wrong bits for {name} at version {v}")
            # One full copy_ of all parameters, into the served tensors, from the version they hold.
            src = {n: t.to(device) for n, t in want.items()}

            def full_copy(src: dict[str, torch.Tensor] = src, served: dict[str, torch.Tensor] = served) -> None:
                for name, t in served.items():
                    t.copy_(src[name])
                _sync(device)

            copies.append(best_of(full_copy, args.repeats))
            del src
            rows.append({"version": v, "publish_s": t_pub, "stage_s": rec.stage_s, "pause_s": rec.pause_s,
                         "write_s": write_s,
                         "elements": rec.elements_changed, "bytes_written": rec.bytes_written,
                         "changed": rec.elements_changed / layout_numel(layout), "lines": lines_touched(prev, cur),
                         "copy_s": copies[-1]})
            prev = cur
        copy_s.append(min(copies))  # the fastest of the run: the conservative baseline on a busy machine
        if device.type == "cuda":  # the usual reload: full weights from (pinned) host memory
            host = {n: t.pin_memory() for n, t in as_state(prev).items()}

            def h2d(host: dict[str, torch.Tensor] = host, served: dict[str, torch.Tensor] = served) -> None:
                for name, t in served.items():
                    t.copy_(host[name], non_blocking=True)
                _sync(device)

            h2d_s.append(best_of(h2d, args.repeats))
        out[f"{frac:g}"] = rows
        engine.close()
        del served, engine, pub, prev, stream, first
        shutil.rmtree(repo, ignore_errors=True)
    return {"rows": out, "copy_s": copy_s, "h2d_s": h2d_s}


# -- fan-out ---------------------------------------------------------------------------------------


def tp_slice(name: str, shape: tuple[int, ...], rank: int, world: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, shape) of rank's tensor-parallel slice; None: replicated whole."""
    if len(shape) != 2:
        return None
    dim = 1 if ("o_proj" in name or "down_proj" in name) else 0  # row-parallel: input dim; else output/vocab dim
    size = shape[dim] // world
    lo = rank * size
    n = shape[dim] - lo if rank == world - 1 else size
    offsets = (lo, 0) if dim == 0 else (0, lo)
    part = (n, shape[1]) if dim == 0 else (shape[0], n)
    return offsets, part


def _fanout_worker(rank: int, world: int, port: int, repo: str, layout: Layout, versions: list[int], repeats: int,
                   device: str, queue: Any) -> None:
    try:
        import torch.distributed as dist

        import deltasync
        from deltasync.engines import FanoutEngine

        torch.set_num_threads(1)
        backend = "gloo"
        if device == "cuda":  # nccl needs a GPU per rank; ranks sharing one GPU use gloo
            torch.cuda.set_device(rank % torch.cuda.device_count())
            backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        held: dict[str, Any] = {}
        regions: dict[str, deltasync.Region] = {}
        for s in layout:
            sl = tp_slice(s.name, s.shape, rank, world)
            if sl is None:
                held[s.name] = torch.zeros(s.shape, dtype=torch.bfloat16, device=device)
            else:
                held[s.name] = deltasync.Slice(torch.zeros(sl[1], dtype=torch.bfloat16, device=device), sl[0], s.shape)
                regions[s.name] = deltasync.Region(sl[0], sl[1])
        engine = FanoutEngine(held, repo if rank == 0 else None, timeout=300, backend=backend)
        if rank == 0:
            for v in versions:
                engine.update(v)
            engine.close()
        else:
            engine.follow()
        records = [dataclasses.asdict(r) for r in engine.swaps]
        # bit for bit: each rank against its own region of the last version, read back from the repository
        want = deltasync.Subscriber(repo).pull(versions[-1], tensors=[s.name for s in layout if s.name not in regions],
                                                regions=regions)
        for name, value in held.items():
            t = value.tensor if isinstance(value, deltasync.Slice) else value
            if not torch.equal(t.cpu().view(torch.int16), want[name].view(torch.int16)):
                raise RuntimeError(f"rank {rank}: wrong bits in {name}")
        # one broadcast of the full weights, in the same kind of group, for comparison
        full = torch.empty(layout_numel(layout) * 2, dtype=torch.uint8, device=device if backend == "nccl" else "cpu")
        group = dist.new_group(backend=backend)
        dist.barrier(group)
        def full_broadcast() -> None:
            dist.broadcast(full, src=0, group=group)
            _sync(full.device)
            dist.barrier(group)

        best = best_of(full_broadcast, repeats)
        queue.put((rank, {"swaps": records, "full_broadcast_s": best, "backend": engine.backend}, None))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def bench_fanout(layout: Layout, stats: ChangeStats, versions: int, args: argparse.Namespace, workdir: Path) -> dict[int, Any]:
    import deltasync

    repo = workdir / "repo-fanout"
    pub = deltasync.Publisher(str(repo), deltasync.PublisherConfig(workers=args.workers))
    ids = [pub.publish(as_state(m)) for m in synthetic_stream(layout, stats, versions, seed=args.seed + 99)]
    del pub
    def args_of(rank: int, port: int, queue: Any) -> tuple[Any, ...]:
        return (rank, args.ranks, port, str(repo), layout, ids, args.repeats, args.fanout_device, queue)

    try:
        return spawn_ranks(_fanout_worker, args.ranks, args_of, timeout=1800, join_timeout=60)
    except AssertionError as e:
        raise SystemExit(f"fan-out {e}") from None


# -- report ------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--size-gib", type=float, default=None, help="in-process model size (default 1.0; quick 1/16)")
    p.add_argument("--changed", type=float, default=0.01, help="fraction of elements changed per version (default 0.01)")
    p.add_argument("--sweep", type=float, nargs="*", default=None,
                   help="more change fractions for the in-process engine (default 0.0001 0.001 0.1; quick none)")
    p.add_argument("--versions", type=int, default=None, help="delta versions per fraction (default 3; quick 2)")
    p.add_argument("--ranks", type=int, default=4, help="fan-out ranks (default 4)")
    p.add_argument("--fanout-gib", type=float, default=None, help="fan-out model size (default 0.25; quick 1/64)")
    p.add_argument("--device", default="cpu", help="device of the in-process model (cpu or cuda)")
    p.add_argument("--fanout-device", default="cpu", help="device of the fan-out ranks' tensors (cpu or cuda)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--repeats", type=int, default=3, help="baselines: best of this many (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = p.parse_args(argv)
    size = args.size_gib if args.size_gib is not None else (1 / 16 if args.quick else 1.0)
    fan_size = args.fanout_gib if args.fanout_gib is not None else (1 / 64 if args.quick else 0.25)
    versions = args.versions if args.versions is not None else (2 if args.quick else 3)
    sweep = args.sweep if args.sweep is not None else ([] if args.quick else [0.0001, 0.001, 0.1])
    torch.set_num_threads(args.workers)

    print(f"command: python -m benchmarks.bench_engine {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"host: {platform.platform()}, {os.cpu_count()} cpus, python {platform.python_version()}, torch {torch.__version__}, "
          f"device {args.device}, torch threads {torch.get_num_threads()}")
    real = list(rl_stream(1e-6, 4, warmup=10, cfg=TinyConfig(), seed=args.seed))
    stats = measure_change_stats(real)
    del real
    print(f"stream: RL-like synthetic (AdamW lr 1e-6 statistics: {100 * stats.overall.fraction:.2f}% changed per step, "
          f"rescaled to --changed); timings best of {args.repeats}")
    work = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    try:
        layout = transformer_layout(shape_for_size(int(size * GIB)))
        nbytes = layout_numel(layout) * 2
        print(f"\n=== in-process torch engine: {nbytes / GIB:.3f} GiB bf16, {len(layout)} tensors, on {args.device} ===")
        fractions = [args.changed, *sweep]
        res = bench_torch(layout, stats, fractions, versions, args, work)
        print(f"{'changed':>8} {'lines':>7} {'version':>7} {'stage s':>8} {'pause ms':>9} {'best ms':>8} {'written MB':>10} "
              f"{'copy_ ms':>9} {'copy_/best':>10}")
        ratios: dict[str, float] = {}
        for (key, rows), copy in zip(res["rows"].items(), res["copy_s"], strict=True):
            for r in rows:
                print(f"{100 * r['changed']:7.3f}% {100 * r['lines']:6.1f}% {r['version']:>7} {r['stage_s']:8.2f} "
                      f"{1e3 * r['pause_s']:9.2f} {1e3 * r['write_s']:8.2f} {r['bytes_written'] / 1e6:10.2f} "
                      f"{1e3 * r['copy_s']:9.2f} {copy / r['write_s']:9.1f}x")
            ratios[key] = copy / statistics.median(r["write_s"] for r in rows)
        h2d_ratios: dict[str, float] = {}
        for key, copy in zip(res["rows"], res["h2d_s"], strict=False):
            rows = res["rows"][key]
            h2d_ratios[key] = copy / statistics.median(r["write_s"] for r in rows)
            print(f"  {key}: full copy_ from pinned host memory {1e3 * copy:.2f} ms = "
                  f"{h2d_ratios[key]:.1f}x the median best pause")
        print("pause = the swap's exclusive write window (requests wait); best = the fastest of that and the same "
              "writes repeated; copy_ = one full copy_ of every parameter from a same-device copy of the version, best of the "
              "repeats, measured after each swap; ratios: the fastest copy_ of the run over the best pause (other "
              "processes slow single measurements down)")

        fan_layout = transformer_layout(shape_for_size(int(fan_size * GIB)))
        fan_bytes = layout_numel(fan_layout) * 2
        fan = bench_fanout(fan_layout, scaled_stats(stats, args.changed), versions, args, work)
        print(f"\n=== fan-out: {args.ranks} ranks, payload over {fan[0]['backend']}, tensors on {args.fanout_device}, "
              f"{fan_bytes / GIB:.3f} GiB bf16, tensor-parallel slices ===")
        full_bc = max(r["full_broadcast_s"] for r in fan.values())
        print(f"{'version':>7} {'broadcast MB':>12} {'full MB':>8} {'bytes ratio':>11} {'stage s':>8} "
              f"{'pause ms (rank0/max)':>20}")
        fan_ratio = []
        for i, rec in enumerate(fan[0]["swaps"]):
            pauses = [fan[r]["swaps"][i]["pause_s"] for r in fan]
            sent, full = rec["extra"]["bytes_broadcast"], rec["extra"]["full_bytes"]
            note = "  (first sync: nothing to diff against)" if i == 0 else ""
            if i:
                fan_ratio.append(full / sent)
            print(f"{rec['version']:>7} {sent / 1e6:12.2f} {full / 1e6:8.1f} {full / sent:10.1f}x {rec['stage_s']:8.2f} "
                  f"{1e3 * pauses[0]:9.2f} / {1e3 * max(pauses):7.2f}{note}")
        print(f"one broadcast of the full weights in the same group: {1e3 * full_bc:.1f} ms")

        print("\n=== targets ===")
        key = f"{args.changed:g}"
        checks = [
            (f"in-process, {100 * args.changed:g}% changed: full copy_ / pause = {ratios[key]:.1f} >= 20", ratios[key] >= 20),
            (f"fan-out: full weights / bytes broadcast = {min(fan_ratio or [0]):.1f} >= 10", min(fan_ratio or [0]) >= 10),
        ]
        if key in h2d_ratios:  # on a GPU, the copy a full reload makes: from host memory
            checks.insert(1, (f"in-process, {100 * args.changed:g}% changed: full copy_ from pinned host / pause = "
                              f"{h2d_ratios[key]:.1f} >= 20", h2d_ratios[key] >= 20))
        for text, ok in checks:
            print(f"  {'PASS' if ok else 'FAIL'}  {text}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if args.check and not all(ok for _, ok in checks) else 0


if __name__ == "__main__":
    sys.exit(main())

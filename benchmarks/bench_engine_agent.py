"""Engine-first agents next to directory-copy agents: disk written, bytes received, peak RSS, time to swap.

    python -m benchmarks.bench_engine_agent [--mib 256] [--versions 4] [--fraction 0.01] [--workers 1]

A bf16 model of ``--mib`` MiB (64 MiB tensors at most, as in bench_lastmile) is published
to a local repository, then ``--versions`` RL-like steps, each changing ``--fraction`` of
the elements by one ulp. Three agent processes, each keeping a ``TorchEngine`` (a dict of
CPU tensors, starting empty) at every version, run side by side in the same run:

* ``engine-first``  — ``EngineAgent``: no directory copy; state and kept objects only;
* ``copy+engine``   — ``Agent(out, engine=...)``: the engine is swapped from the fetched change,
  then the copy is rewritten (issue 21, item 2);
* ``copy->engine``  — the path before: the copy is rewritten, then the engine stages from it
  (``deltasync subscribe --out DIR --engine ...`` until issue 21).

Per version and agent: bytes the process wrote to disk (``/proc/self/io`` write_bytes, after
an ``os.sync()`` before each version: a page still dirty from an earlier write is not counted again),
bytes received from the repository, the version's stored bytes, seconds from the start of
the update to the engine's swap, and the process's peak RSS during that update (VmHWM,
reset before each) next to the engine's weights (the targets: engine-first written <= 4x
stored, peak RSS <= weights + 512 MiB). The first
version is a full pass for every agent (a snapshot into an empty engine) and is shown apart.
Every agent's engine is checked bit-exact against the published state at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deltasync import Publisher, PublisherConfig, Repository
from deltasync.format.manifest import manifest_key
from deltasync.storage import LocalStore

MODES = ("engine-first", "copy+engine", "copy->engine")
TENSOR_MIB = 64


def layout(mib: int) -> list[tuple[str, tuple[int, int]]]:
    out = []
    left = mib
    i = 0
    while left > 0:
        size = min(TENSOR_MIB, left)
        out.append((f"layers.{i}.weight", (size * 256, 2048)))  # size MiB of bf16: 2048 columns of 2 bytes
        left -= size
        i += 1
    return out


def first_state(shapes: list[tuple[str, tuple[int, int]]], seed: int = 0) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes:
        bits = (rng.normal(0, 0.02, shape[0] * shape[1]).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        out[name] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(shape)
    return out


def step(state: dict[str, torch.Tensor], seed: int, fraction: float) -> None:
    """One ulp at ``fraction`` of the elements of every tensor, in place."""
    rng = np.random.default_rng(seed)
    for t in state.values():
        ints = t.view(torch.int16).reshape(-1).numpy()
        idx = rng.choice(ints.size, size=max(1, int(ints.size * fraction)), replace=False)
        ints[idx] += 1


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in state.items()}


def written() -> int:
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["write_bytes"])


def peak_rss() -> int:
    """This process's peak resident set (VmHWM: unlike ru_maxrss, not inherited from the parent it was forked from)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    """Start VmHWM again from the current resident set (Linux: 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def agent_process(mode: str, repo: str, root: str, shapes: list[tuple[str, tuple[int, int]]], workers: int,
                  conn: Connection) -> None:
    from deltasync.agents import Agent, AgentConfig, BaseAgent, EngineAgent, Update
    from deltasync.engines import TorchEngine

    model = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes}
    weights = sum(t.numel() * t.element_size() for t in model.values())
    swapped: list[float] = []

    class Timed(TorchEngine):
        def swap(self, staged: Any) -> Any:
            record = super().swap(staged)
            swapped.append(time.perf_counter())
            return record

        def load(self, version: int | None = None) -> Any:  # a first pass in place (the engine-first agent's)
            record = super().load(version)
            swapped.append(time.perf_counter())
            return record

    config = AgentConfig(workers=workers, progress=False)
    out = Path(root) / "copy"
    agent: BaseAgent
    if mode == "engine-first":
        agent = EngineAgent(Timed(model, repo, workers=workers), Path(root) / "state", config)
    elif mode == "copy+engine":
        agent = Agent(repo, out, config, engine=Timed(model, repo, workers=workers, copy=out))  # as subscribe --out builds it
    else:
        engine = Timed(model, repo, workers=workers, copy=out)

        def after_copy(u: Update) -> None:
            engine.update(u.version)

        agent = Agent(repo, out, config, on_update=after_copy)
    conn.send({"weights": weights, "rss": peak_rss()})
    while conn.recv() == "go":
        reset_peak_rss()
        w0, start = written(), time.perf_counter()
        fetched0 = agent.store.fetched_bytes
        swapped.clear()
        version = agent.run()
        conn.send({
            "version": version, "written": written() - w0, "received": agent.store.fetched_bytes - fetched0,
            "to_swap": (swapped[-1] - start) if swapped else None, "seconds": time.perf_counter() - start,
            "rss": peak_rss(),
        })
    conn.send(digests(model))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="model size in MiB of bf16")
    ap.add_argument("--versions", type=int, default=4, help="versions after the first")
    ap.add_argument("--fraction", type=float, default=0.01, help="fraction of elements changed per version")
    ap.add_argument("--workers", type=int, default=1, help="decode threads per agent (the same for every agent)")
    args = ap.parse_args()

    shapes = layout(args.mib)
    with tempfile.TemporaryDirectory(prefix="bench-engine-agent-") as tmp:
        repo = str(Path(tmp) / "repo")
        pub = Publisher(repo, PublisherConfig(workers=2, progress=False, snapshot_every=1000))
        state = first_state(shapes)
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for mode in MODES:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=agent_process, args=(mode, repo, str(Path(tmp) / mode), shapes, args.workers, child))
            p.start()
            procs.append(p)
            conns.append(parent)
        starts = [c.recv() for c in conns]
        weights = starts[0]["weights"]
        print(f"model {args.mib} MiB bf16 ({len(shapes)} tensors), {args.fraction:.2%} of elements changed per version, "
              f"{args.workers} decode thread(s) per agent; peak RSS before any update: "
              + ", ".join(f"{m} {s['rss'] / 2**20:.0f} MiB" for m, s in zip(MODES, starts, strict=True)))
        print(f"{'version':>7} {'stored':>10} {'agent':>13} {'written':>10} {'w/stored':>8} {'received':>10} "
              f"{'to swap':>8} {'total':>7} {'peak RSS':>9} {'RSS-weights':>11}")
        totals: dict[str, list[tuple[int, int]]] = {m: [] for m in MODES}
        peaks: dict[str, int] = {}
        first_peaks: dict[str, int] = {}
        for i in range(args.versions + 1):
            if i:
                step(state, i, args.fraction)
            v = int(pub.publish(state))
            info = Repository(repo).manifest(v)
            stored = sum(p.size for p in info.pb.packs) + len(LocalStore(repo).get(manifest_key(v)))
            os.sync()  # pages dirtied earlier and not yet written back would not count again
            for c in conns:
                c.send("go")
            for mode, c in zip(MODES, conns, strict=True):
                r = c.recv()
                assert r["version"] == v, (mode, r)
                if i:
                    peaks[mode] = max(peaks.get(mode, 0), r["rss"])
                else:
                    first_peaks[mode] = r["rss"]
                if i:
                    totals[mode].append((r["written"], stored))
                swap = "-" if r["to_swap"] is None else f"{r['to_swap']:.2f}s"
                label = f"{v}{'' if i else ' (first)'}"
                print(f"{label:>7} {stored / 2**20:9.2f}M {mode:>13} {r['written'] / 2**20:9.2f}M "
                      f"{r['written'] / stored:8.2f} {r['received'] / 2**20:9.2f}M {swap:>8} {r['seconds']:6.2f}s "
                      f"{r['rss'] / 2**20:8.0f}M {(r['rss'] - weights) / 2**20:10.0f}M")
        for c in conns:
            c.send("stop")
        expected = digests(state)
        for mode, c, p in zip(MODES, conns, procs, strict=True):
            assert c.recv() == expected, f"{mode}: engine differs from the published state"
            p.join()
    print(f"engines bit-exact at version {v}. Per version after the first (mean), weights {weights / 2**20:.0f} MiB:")
    for mode in MODES:
        w = sum(x for x, _ in totals[mode]) / max(1, len(totals[mode]))
        s = sum(y for _, y in totals[mode]) / max(1, len(totals[mode]))
        print(f"  {mode:>13}: wrote {w / 2**20:8.2f} MiB = {w / s:6.2f}x stored ({w / (weights):.3f}x the model); "
              f"peak RSS {peaks[mode] / 2**20:.0f} MiB = weights + {(peaks[mode] - weights) / 2**20:.0f} MiB "
              f"(first load: weights + {(first_peaks[mode] - weights) / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()

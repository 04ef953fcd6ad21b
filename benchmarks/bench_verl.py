"""Bytes on the wire per step: deltasync against verl's own ``delta_sharded`` encoding, same stream, one run.

Run from the repository root, in the environment that has verl (``scripts/install_verl.sh``)::

    .venv-verl/bin/python -m benchmarks.bench_verl                 # MiniLM (22.7M params), lr 1e-5, 5 steps
    .venv-verl/bin/python -m benchmarks.bench_verl --quick         # the small random-init transformer, seconds
    .venv-verl/bin/python -m benchmarks.bench_verl --lr 1e-6 --steps 8 --json out.json

The stream: AdamW on fp32 master weights, the bf16 cast of every step is the version (the
pretrained MiniLM of ``minilm_stream.py``; ``--quick``: the random-init transformer of
``rl_stream.py``). Per steady step (every step after the first):

* **verl delta_sharded** — verl's own trainer-side diff (``delta_sync.sparse_gather.
  shard_delta_indices``, the function its backends call per parameter) and its own flush
  assembly (``DeltaShardedCheckpointEngine._assemble_flush``, bucketed by its
  ``_FlushBucket`` / ``_bucket_sliced`` at ``--bucket-mib``), run on CPU. Wire bytes are
  each flush's ``DeltaFlush.wire_bytes`` (the NCCL payload: int32 positions plus raw bf16
  values) plus the pickled metadata its ``_publish_flush`` sends over ZMQ, rebuilt here
  the way that method builds it (the method itself moves the payload to CUDA, so it cannot
  run on a CPU host).
* **deltasync** — :class:`deltasync.Publisher` into a local repository: the version's
  stored bytes (its packs) plus its manifest, which is what a replica fetches.

The ratio deltasync ÷ delta_sharded is printed per step and as the median. The first
version (verl's values-only seed, deltasync's snapshot) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Step:
    step: int
    changed_elements: int
    total_elements: int
    verl_bytes: int
    deltasync_bytes: int

    @property
    def ratio(self) -> float:
        return self.deltasync_bytes / self.verl_bytes if self.verl_bytes else float("nan")


class VerlDeltaWire:
    """verl's delta_sharded sender, from diff to flush, counting what it would broadcast."""

    def __init__(self, bucket_bytes: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # cupy: no NCCL library on a CPU host
            from verl.checkpoint_engine.delta_checkpoint_engine import (
                DeltaShardedCheckpointEngine,
                _bucket_sliced,
                _FlushBucket,
            )
            from verl.checkpoint_engine.delta_sync.sparse_gather import shard_delta_indices
        # is_master=False: no ZMQ server is started; only the encoding methods are used.
        self.engine = DeltaShardedCheckpointEngine(bucket_size=bucket_bytes, is_master=False)
        self.bucket_bytes = bucket_bytes
        self._bucket_sliced = _bucket_sliced
        self._flush_bucket = _FlushBucket
        self._diff = shard_delta_indices
        self.snapshot: dict[str, torch.Tensor] = {}

    def seed(self, state: dict[str, torch.Tensor]) -> int:
        """The values-only first sync: every element once, no positions."""
        self.snapshot = {k: v.detach().reshape(-1).clone() for k, v in state.items()}
        return sum(v.numel() * v.element_size() for v in state.values())

    def step(self, state: dict[str, torch.Tensor]) -> tuple[int, int]:
        """(wire bytes, changed elements) of one steady sync."""
        wire = 0
        changed = 0

        def publish(flush: Any, is_last: bool) -> None:
            nonlocal wire
            meta = {  # as DeltaShardedCheckpointEngine._publish_flush builds it
                "is_full": False, "encoding": self.engine.encoding, "is_last": is_last, "terminal_empty": False,
                "pos_numel": int(flush.positions_cpu.numel()), "val_numel": int(flush.values_gpu.numel()),
                "val_dtype": str(flush.values_gpu.dtype).replace("torch.", ""),
                "spec": {"encoding": self.engine.encoding, "params": [vars(p) for p in flush.params],
                         "checksum": int(flush.checksum)},
            }
            wire += int(flush.wire_bytes) + len(self.engine.topic) + len(pickle.dumps(meta, pickle.DEFAULT_PROTOCOL))

        bucket = self._flush_bucket(self.bucket_bytes, self.engine._assemble_flush, publish)
        for name, tensor in state.items():
            flat = tensor.detach().reshape(-1)
            idx, val = self._diff(flat, self.snapshot[name], 0)
            self.snapshot[name].copy_(flat)
            changed += int(idx.numel())
            if idx.numel():
                dtype = str(val.dtype).replace("torch.", "")
                self._bucket_sliced(bucket, name, dtype, tuple(tensor.shape), idx, val)
        bucket.seal()
        bucket.emit(is_last=True)
        return wire, changed


class DeltasyncWire:
    """A Publisher into a local repository; a version's wire bytes are its packs and manifest."""

    def __init__(self, root: Path) -> None:
        from deltasync import Publisher, PublisherConfig, Repository

        self.publisher = Publisher(str(root), PublisherConfig(progress=False))
        self.repo = Repository(str(root))

    def publish(self, state: dict[str, torch.Tensor]) -> tuple[int, str]:
        result = self.publisher.publish(state)
        manifest = self.repo.manifest(result.version).pb.ByteSize()
        return result.stored_bytes + manifest, result.kind


def stream(quick: bool, lr: float, steps: int) -> Iterator[dict[str, torch.Tensor]]:
    if quick:
        from .rl_stream import rl_state_dicts

        yield from rl_state_dicts(lr, steps)
        return
    from .minilm_stream import minilm_state_dicts

    yield from minilm_state_dicts(lr, steps)


def run(quick: bool, lr: float, steps: int, bucket_mib: int) -> dict[str, Any]:
    verl = VerlDeltaWire(bucket_mib << 20)
    out: list[Step] = []
    seed: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ours = DeltasyncWire(Path(tmp) / "repo")
        for i, state in enumerate(stream(quick, lr, steps)):
            total = sum(t.numel() for t in state.values())
            if i == 0:
                seed = {"verl_bytes": verl.seed(state), "deltasync_bytes": ours.publish(state)[0], "elements": total}
                continue
            verl_bytes, changed = verl.step(state)
            our_bytes, kind = ours.publish(state)
            out.append(Step(i, changed, total, verl_bytes, our_bytes))
            print(f"step {i}: {changed / total:7.3%} changed  verl delta_sharded {verl_bytes:>11,} B  "
                  f"deltasync {our_bytes:>10,} B ({kind})  ratio {out[-1].ratio:.3f}", flush=True)
    ratios = [s.ratio for s in out]
    summary = {
        "stream": "rl_stream tiny transformer" if quick else "MiniLM-L6 (22.7M params)",
        "lr": lr, "steps": [asdict(s) | {"ratio": s.ratio} for s in out], "seed": seed,
        "ratio_median": statistics.median(ratios), "ratio_max": max(ratios),
        "verl_over_deltasync_median": statistics.median(1 / r for r in ratios),
    }
    print(f"deltasync / verl delta_sharded bytes per steady step: median {summary['ratio_median']:.3f}, "
          f"max {summary['ratio_max']:.3f} (verl sends {summary['verl_over_deltasync_median']:.1f}x deltasync's bytes); "
          f"first version: verl seed {seed['verl_bytes']:,} B, deltasync snapshot {seed['deltasync_bytes']:,} B")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_verl", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small random-init transformer instead of MiniLM")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bucket-mib", type=int, default=512, help="verl's update_weights_bucket_megabytes")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    try:
        import verl  # noqa: F401
    except ImportError:
        print("bench_verl needs verl: bash scripts/install_verl.sh, then run it with .venv-verl/bin/python", file=sys.stderr)
        return 2
    summary = run(args.quick, args.lr, args.steps, args.bucket_mib)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

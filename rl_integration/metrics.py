"""Metrics of a run: a JSON-lines file, and the sync figures gathered from worker reports.

Every line is one object with ``event`` and ``t`` (seconds since the run started):

* ``config`` — the run's configuration;
* ``warm_start`` — the warm-start loss and the held-out evaluation of version 1;
* ``step`` — one RL update and the version it published: reward, staleness histogram,
  log-prob gap, importance weights, bytes stored for the version and compression ratio,
  the gate's evaluation and verdict, the rollout batches trained on (worker, version), and
  ``synced``: the ``sync`` figures of the versions every worker started serving meanwhile;
* ``swap`` — one worker swapping one version in: digest of the bits it then served and
  the manifest's digest, pause, staging time, bytes fetched;
* ``sync`` — one version served by every worker: time from publish until each worker
  served it or a newer version (``latency_s``; with the gate on, this includes the
  evaluation), time from the version becoming the one to serve (pinned, or published when
  following the latest) until then (``serve_latency_s``: deltasync's part), the largest
  engine pause;
* ``summary`` — the run in a few figures.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .serving import SwapReport


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsLog:
    """Appends events to a JSON-lines file and keeps them for the summary and the plot."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = time.monotonic()
        self.records: list[dict[str, Any]] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO = open(path, "w")  # noqa: SIM115 - closed by close()

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "t": round(time.monotonic() - self.start, 4), **_clean(fields)}
        self.records.append(record)
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        return record

    def events(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics file."""
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


@dataclass
class SyncTracker:
    """Publish times and worker swaps, turned into one ``sync`` figure per version."""

    workers: int
    published: dict[int, float] = field(default_factory=dict)
    targeted: dict[int, float] = field(default_factory=dict)
    """When each version became the one to serve (its pin, or its publish when following the latest)."""
    swaps: dict[int, list[SwapReport]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    skipped: set[int] = field(default_factory=set)

    def publish(self, version: int, when: float) -> None:
        self.published[version] = when

    def target(self, version: int, when: float) -> None:
        self.targeted[version] = when

    def skip(self, version: int) -> None:
        """A version no worker is meant to serve (rejected by the gate)."""
        self.skipped.add(version)

    def swap(self, worker: int, report: SwapReport) -> None:
        self.swaps.setdefault(worker, []).append(report)

    def complete(self) -> list[dict[str, Any]]:
        """``sync`` figures of versions every worker now serves (or has moved past)."""
        out: list[dict[str, Any]] = []
        if len(self.swaps) < self.workers:
            return out
        for v in sorted(set(self.targeted) - self.done - self.skipped):
            per_worker: dict[int, float] = {}
            target_lag: list[float] = []
            pauses: list[float] = []
            fetched: list[int] = []
            for w, reports in self.swaps.items():
                first = next((r for r in reports if r.version >= v and r.served_unix >= self.published[v]), None)
                if first is None:
                    break
                per_worker[w] = first.served_unix - self.published[v]
                target_lag.append(first.served_unix - self.targeted[v])
                if first.version == v:
                    pauses.append(first.pause_s)
                    fetched.append(first.fetched_bytes)
            else:
                self.done.add(v)
                out.append({
                    "version": v,
                    "latency_s": max(per_worker.values()),
                    "serve_latency_s": max(target_lag),
                    "worker_latency_s": per_worker,
                    "pause_max_s": max(pauses) if pauses else None,
                    "fetched_bytes_max": max(fetched) if fetched else None,
                    "workers_on_version": len(pauses),
                })
        return out


def percentile(values: Iterable[float], q: float) -> float:
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return math.nan
    k = (len(vals) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)

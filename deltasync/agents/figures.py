"""An agent's figures: what it knows (versions, lag, bytes, updates, errors, its engine's
phase), kept in one place for every agent, mirrored into the state's LMDB ``stats`` record
(which ``deltasync status`` reads, :mod:`.status`) and served as Prometheus metrics."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DeltasyncError, RefError, SignatureError
from ..local.cache import CachedStore
from ..local.state import StateDB
from ..metrics import Metric, MetricsServer
from ..repo.repository import MAX_REF_BYTES, ref_hint
from .config import AgentConfig, Update
from .status import read_status

log = logging.getLogger("deltasync.agents")

#: Seconds between writes of the figures when only the byte counters moved (an idle agent's polls).
COUNTERS_FLUSH_S = 30.0
_COUNTERS = frozenset({"bytes_fetched_total", "fetched_by_kind"})


@dataclass
class Figures:
    """What the agent knows; mirrored into the copy's LMDB ``stats`` record."""

    pid: int = 0
    running: bool = False
    follow: bool = False
    repo: str = ""
    started_unix: float = 0.0
    state: str = "starting"
    latest_version: int | None = None
    latest_seen_unix: float | None = None
    pinned_version: int | None = None
    target_version: int | None = None
    stale_since_unix: float | None = None
    highest_version: int = 0
    bytes_fetched_total: int = 0
    fetched_by_kind: dict[str, int] = field(default_factory=dict)
    updates_total: int = 0
    errors_total: int = 0
    last_update: dict[str, Any] | None = None
    last_error: str | None = None
    last_error_unix: float | None = None
    refused_ref: dict[str, Any] | None = None
    """The ref last refused (RefError): its key, the version it names unchecked, when."""
    engine_phase: str | None = None
    """With an engine: ``loading`` until this process has checked what the engine holds (its
    bits against a version's digests), ``restoring`` while it restores from kept objects,
    ``serving`` after. Before ``serving`` the state's version is only what an earlier run
    held: status claims no version for the engine (the factory's bits may be anything)."""



class FigureBook:
    """The figures of the agent whose state is at ``root`` (its StateDB from ``state_db``),
    reading through ``store``. Thread-safe: the watch thread, the run loop and metrics
    scrapes share it."""

    def __init__(self, root: Path, store: CachedStore, state_db: Callable[[], StateDB], *, repo: str) -> None:
        self.root = root
        self.store = store
        self.state_db = state_db
        self.figures = Figures(repo=repo)
        self.lock = threading.Lock()
        self._last_flush = 0.0
        self._flushed: dict[str, Any] | None = None  # the figures as last written
        self._last_write = -float("inf")
        self._fetched_at_start = 0
        self._base_total = 0
        self._base_by_kind: dict[str, int] = {}
        self._fetched_by_kind_at_start: dict[str, int] = {}

    def open(self, *, follow: bool, engine: bool) -> None:
        """Start a run: the totals of earlier runs from the state, this process as the runner."""
        stats = self.state_db().stats()
        with self.lock:
            f = self.figures
            f.bytes_fetched_total = int(stats.get("bytes_fetched_total", 0) or 0)
            by_kind = stats.get("fetched_by_kind")
            self._base_by_kind = {str(k): int(v) for k, v in by_kind.items()} if isinstance(by_kind, dict) else {}
            f.highest_version = int(stats.get("highest_version", 0) or 0)
            f.updates_total = int(stats.get("updates_total", 0) or 0)
            f.errors_total = int(stats.get("errors_total", 0) or 0)
            f.last_update = stats.get("last_update")
            f.last_error, f.last_error_unix = stats.get("last_error"), stats.get("last_error_unix")
            f.pid, f.running, f.follow, f.started_unix, f.state = os.getpid(), True, follow, time.time(), "starting"
            if engine and f.engine_phase is None:
                f.engine_phase = "loading"
        self._fetched_at_start = self.store.fetched_bytes
        self._fetched_by_kind_at_start = self.store.fetched_by_kind()
        self._base_total = self.figures.bytes_fetched_total
        self.flush(force=True)

    def set(self, **fields: Any) -> None:
        with self.lock:
            for k, v in fields.items():
                setattr(self.figures, k, v)
        self.flush(force="state" in fields)

    def engine_phase(self, phase: str) -> None:
        if self.figures.engine_phase != phase:
            self.set(engine_phase=phase)
            self.flush(force=True)

    def saw(self, *, latest: int | None, pinned: int | None, target: int | None, current: int | None,
            stale_since: Callable[[], float]) -> None:
        """What a look at the source of targets found; ``stale_since``: when the holder fell
        behind ``target`` (asked only when it just did)."""
        now = time.time()
        with self.lock:
            f = self.figures
            if latest != f.latest_version:
                f.latest_seen_unix = now
            f.latest_version, f.pinned_version, f.target_version = latest, pinned, target
            if target is None or (current is not None and current == target):
                f.stale_since_unix = None
            elif f.stale_since_unix is None:
                f.stale_since_unix = stale_since()
        self.flush()

    def moved(self, update: Update) -> None:
        """An update done."""
        with self.lock:
            f = self.figures
            f.updates_total += 1
            f.highest_version = max(f.highest_version, update.version)
            f.last_update = {
                "version": update.version, "previous": update.previous, "how": update.how,
                "fetched_bytes": update.fetched_bytes, "seconds": round(update.seconds, 6), "finished_unix": time.time(),
            }
            if f.latest_version is None or update.version >= f.latest_version:
                f.stale_since_unix = None

    def restored(self, version: int, how: str, seconds: float) -> None:
        """The holder brought to ``version`` without the repository (no update counted)."""
        with self.lock:
            self.figures.last_update = {"version": version, "previous": None, "how": how, "fetched_bytes": 0,
                                        "seconds": seconds, "finished_unix": time.time()}
        self.flush(force=True)

    def failed(self, e: BaseException) -> None:
        message = str(e) if isinstance(e, DeltasyncError) else f"{type(e).__name__}: {e}"
        log.warning("update failed: %s", message)
        refused = self._refused(e)
        with self.lock:
            self.figures.errors_total += 1
            self.figures.last_error, self.figures.last_error_unix = message, time.time()
            if refused is not None:
                self.figures.refused_ref = refused
        self.flush(force=True)

    def _refused(self, e: BaseException) -> dict[str, Any] | None:
        """What a refusal (a ref or a manifest that trusted keys do not accept) names, so that
        status shows it beside the older version accepted, not only that version and lag 0."""
        if isinstance(e, SignatureError):
            return {"ref": None, "version": e.version, "unix": time.time()}
        if not isinstance(e, RefError):
            return None
        named: int | None = None
        with contextlib.suppress(DeltasyncError, OSError):
            named = ref_hint(self.store.get(e.key, max_bytes=MAX_REF_BYTES))  # unchecked: shown, never followed
        return {"ref": e.key, "version": named, "unix": time.time()}

    def flush(self, *, force: bool = False) -> None:
        """Write the figures to the state (at most every half second unless ``force``; only
        when they changed)."""
        now = time.monotonic()
        if not force and now - self._last_flush < 0.5:
            return
        self._last_flush = now
        with self.lock:
            f = self.figures
            f.bytes_fetched_total = self._base_total + self.store.fetched_bytes - self._fetched_at_start
            now_by_kind = self.store.fetched_by_kind()
            kinds = set(now_by_kind) | set(self._base_by_kind)
            f.fetched_by_kind = {
                k: self._base_by_kind.get(k, 0) + now_by_kind.get(k, 0) - self._fetched_by_kind_at_start.get(k, 0)
                for k in sorted(kinds)
            }
            record = dict(vars(f))
        if self._flushed is not None:
            # An idle agent writes nothing to its disk: what changes while it polls is the
            # bytes its reads of the refs cost, written at most every COUNTERS_FLUSH_S.
            if record == self._flushed:
                return
            moved = {k for k, v in record.items() if self._flushed.get(k) != v}
            if moved <= _COUNTERS and now - self._last_write < COUNTERS_FLUSH_S:
                return
        with contextlib.suppress(DeltasyncError, OSError):
            self.state_db().update_stats(record)
            self._flushed, self._last_write = record, now

    def metrics(self) -> list[Metric]:
        """The figures as Prometheus metrics (what ``/metrics`` serves)."""
        self.flush()
        status = read_status(self.root)
        g, c = "gauge", "counter"
        last = status.get("last_update") or {}
        get = status.get
        out = [
            Metric("deltasync_up", g, "1 while the agent runs", 1 if status.get("running") else 0),
            Metric("deltasync_current_version", g, "Version the local copy holds", status.get("version")),
            Metric("deltasync_latest_version", g, "Newest committed version seen in the repository", get("latest_version")),
            Metric("deltasync_target_version", g, "Version the agent serves: the pin, else the latest", get("target_version")),
            Metric("deltasync_pinned_version", g, "Version pinned by the publisher (absent: none)", status.get("pinned_version")),
            Metric("deltasync_lag_versions", g, "Versions the copy is behind the latest", status.get("lag_versions")),
            Metric("deltasync_lag_seconds", g, "Seconds since a version newer than the copy was committed (0: current)",
                   status.get("lag_seconds")),
            Metric("deltasync_bytes_fetched_total", c, "Bytes downloaded from the repository", status.get("bytes_fetched_total")),
            Metric("deltasync_updates_total", c, "Versions installed", status.get("updates_total")),
            Metric("deltasync_errors_total", c, "Failed update attempts", status.get("errors_total")),
            Metric("deltasync_apply_seconds", g, "Duration of the last update (fetch, verify, install)", last.get("seconds")),
            Metric("deltasync_last_update_bytes", g, "Bytes downloaded by the last update", last.get("fetched_bytes")),
            Metric("deltasync_last_update_timestamp_seconds", g, "When the last update finished", last.get("finished_unix")),
            Metric("deltasync_last_error_timestamp_seconds", g, "When the last error happened", status.get("last_error_unix")),
        ]
        for kind, n in sorted((status.get("fetched_by_kind") or {}).items()):
            out.append(Metric("deltasync_bytes_fetched_by_kind_total", c, "Bytes downloaded, by kind", n, {"kind": kind}))
        check = status.get("live_check") or {}  # agents/live.py: the engine's live weights against their digests
        out.append(Metric("deltasync_live_check_drifted_chunks", g, "Chunks the last live check found drifted",
                          check.get("drifted_chunks")))
        out.append(Metric("deltasync_live_check_timestamp_seconds", g, "When the last live check ran", check.get("unix")))
        return out


    def serve_metrics(self, config: AgentConfig) -> MetricsServer | None:
        """Serve :meth:`metrics` as ``config`` asks (None: it does not)."""
        if config.metrics_port is None:
            return None
        return MetricsServer(self.metrics, port=config.metrics_port, host=config.metrics_host)


__all__ = ["COUNTERS_FLUSH_S", "FigureBook", "Figures"]

"""Reports up the tree: every agent tells a relay what it serves (``deltasync fleet``).

A :class:`Reporter` runs beside any agent (directory copy, engine-first, packcast node, vLLM):
it reads the agent's figures from its state directory (:func:`~deltasync.agents.status.read_status`,
an LMDB read) four times a second and sends a small report (:class:`NodeReport`) to a relay
when something that matters changed (the version served, its digest, the live check, the
error, the target, the agent's state), and every ``interval`` seconds regardless: a node
whose reports stop is ``silent`` after three intervals.

The version reported is the one the engine holds by its own account (``served``: an
engine-first agent's engine once checked in this run), never the target: a node whose
engine did not take a version is not reported as serving it. The error reported is the
agent's current one (its state ``backoff``, or an engine error newer than its last update),
not any error it ever had.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DeltasyncError, UsageError
from ..storage.fleet import MAX_ERROR_CHARS, FleetClient
from ..v1 import fleet_pb2 as fpb

log = logging.getLogger("deltasync.agents")

#: Fields whose change sends a report at once (the rest ride on the periodic one).
_CHANGES = ("version", "version_digest", "repository_id", "check", "check_unix", "last_error", "target_version",
            "agent_state", "engine")


def default_node(state_dir: str | os.PathLike[str]) -> str:
    """``HOST:DIRNAME``: the host name, and the state directory's name (several agents on one host)."""
    return f"{socket.gethostname()}:{Path(state_dir).resolve().name}"


@dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """Where and how often an agent reports."""

    to: str
    """The relay to report to (``grpc://…``): the one the agent reads from, or ``--report-to``."""
    node: str
    """This node's name, unique in the fleet."""
    cluster: str = ""
    """Its cluster ("": the relay names it)."""
    interval: float = 2.0
    """Seconds between reports when nothing changes (``silent`` after three without one)."""
    token: str | None = None
    """The report token (``--report-token-file``)."""

    def __post_init__(self) -> None:
        if not 0.1 <= self.interval <= 600:
            raise UsageError(f"the report interval must be in 0.1..600 seconds, got {self.interval}")
        if not self.node or len(self.node) > 256 or not self.node.isprintable():
            raise UsageError(f"--node must be a printable name of 1..256 characters, got {self.node!r}")
        if len(self.cluster) > 128 or not self.cluster.isprintable():
            raise UsageError(f"--cluster must be printable, at most 128 characters, got {self.cluster!r}")


def report_of(status: dict[str, Any], config: ReportConfig, served: int | None) -> fpb.NodeReport:
    """The report of an agent's status (``read_status``), ``served`` the version its engine
    (or copy) holds by the agent's own account."""
    get = status.get
    has_engine = bool(get("engine_kind"))
    if has_engine:
        recorded, digest = get("engine_version"), get("engine_version_digest")
    else:
        recorded, digest = get("version"), get("version_digest")
    version = served if served is not None else 0
    # The digest belongs to the version the state recorded: none when the engine holds another.
    digest_hex = digest if (digest and recorded == served) else ""
    error = ""
    error_unix = 0.0
    if get("state") == "backoff" and get("last_error"):
        error, error_unix = str(get("last_error")), float(get("last_error_unix") or 0)
    elif has_engine and get("engine_last_error") and float(get("engine_last_error_unix") or 0) > float(
            get("engine_updated_unix") or 0):
        error, error_unix = str(get("engine_last_error")), float(get("engine_last_error_unix") or 0)
    check = get("live_check") or {}  # a check that could not run says nothing about the bits: not sent
    return fpb.NodeReport(
        node=config.node, cluster=config.cluster, engine=str(get("engine_kind") or "copy"),
        version=int(version), version_digest=bytes.fromhex(digest_hex) if digest_hex else b"",
        repository_id=bytes.fromhex(get("repository_id") or "") if get("repository_id") else b"",
        check=str(check.get("result") or "") if check.get("result") != "error" else "",
        check_unix=float(check.get("unix") or 0), drifted_chunks=int(check.get("drifted_chunks") or 0),
        lag_seconds=float(get("lag_seconds") or 0), last_error=error[:MAX_ERROR_CHARS], last_error_unix=error_unix,
        bytes_fetched=int(get("bytes_fetched_total") or 0), sent_unix=time.time(), interval=config.interval,
        target_version=int(get("target_version") or 0), agent_state=str(get("state") or ""),
    )


def _key(r: fpb.NodeReport) -> tuple[Any, ...]:
    return tuple(getattr(r, f) for f in _CHANGES)


class Reporter:
    """Sends ``state_dir``'s agent's reports to a relay (a thread; see the module doc).

    ``served()`` returns the version the agent's engine (or copy) holds by its own account
    (``Agent.current``), None when it holds none yet."""

    def __init__(self, state_dir: str | os.PathLike[str], config: ReportConfig,
                 served: Callable[[], int | None], *, client: FleetClient | None = None) -> None:
        self.state_dir, self.config, self.served = Path(state_dir), config, served
        self.client = client or FleetClient(config.to, report_token=config.token, timeout=max(5.0, config.interval * 2))
        self.sent = 0
        self.last_error: str | None = None
        self._last: tuple[Any, ...] | None = None
        self._last_sent = -float("inf")
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltasync-report", daemon=True)

    def start(self) -> Reporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Send a last report (the agent's state ``stopped``) and end the thread."""
        self._stop.set()
        self._wake.set()
        self._thread.join(10)
        with contextlib.suppress(DeltasyncError, OSError):
            self.send_once(force=True)
        self.client.close()

    def wake(self) -> None:
        """Look at the state now (an update just finished)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.send_once()
            except (DeltasyncError, OSError) as e:
                if self.last_error is None:  # once per outage, not per try
                    log.warning("fleet report to %s failed: %s", self.config.to, e)
                self.last_error = str(e)
                self._last_sent = time.monotonic()  # retried at the next interval, not four times a second
            self._wake.wait(min(0.25, self.config.interval))
            self._wake.clear()

    def send_once(self, *, force: bool = False) -> bool:
        """Send a report if something changed or the interval passed (always with ``force``)."""
        try:
            from .status import read_status

            status = read_status(self.state_dir)
        except UsageError:  # no state yet
            return False
        report = report_of(status, self.config, self.served())
        key = _key(report)
        now = time.monotonic()
        if not force and key == self._last and now - self._last_sent < self.config.interval:
            return False
        self.client.report([report])
        if self.last_error is not None:
            log.info("fleet reports reach %s again", self.config.to)
        self.last_error = None
        self._last, self._last_sent = key, now
        self.sent += 1
        return True


def served_by(agent: Any) -> Callable[[], int | None]:
    """What an agent's engine (or copy) holds by its own account: an engine-first agent's
    ``current()`` (its engine, once checked in this run), an engine's version beside a copy,
    else the copy's version."""
    from .engine import EngineAgent

    if isinstance(agent, EngineAgent) or agent.engine is None:
        return agent.current  # type: ignore[no-any-return]
    engine = agent.engine
    return lambda: engine.version


__all__ = ["ReportConfig", "Reporter", "default_node", "report_of", "served_by"]

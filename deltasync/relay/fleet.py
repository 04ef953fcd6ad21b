"""The fleet table of a relay: the latest report of every node below it, bounded in memory.

Agents report what they serve (:mod:`deltasync.agents.report`) to the relay they read from;
relays forward their whole table to their upstream relay every ``interval`` (each report
with its ``age`` there), so the root relay knows every node of every cluster. A node is
``silent`` once three of its own report intervals pass without a report, and dropped after
``ttl`` (an hour). Reports are kept serialized (about 150 bytes each, parsed only for a
view or a scrape): 10,000 nodes cost a few MiB (``benchmarks/bench_fleet.py``).

Reports are claims: a node's report token lets it say anything about the nodes of the
clusters the token may report for, so a forged report can make the view lie, but it cannot
change a bit any engine serves (docs/trust.md). Tokens (``--report-token-file``): one per
line, ``TOKEN`` (any cluster: agents and relays below) or ``CLUSTER TOKEN`` (only that
cluster's nodes).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from ..errors import DeltasyncError, ObjectNotFoundError, UsageError
from ..metrics import Metric
from ..storage import GrpcStore, Store
from ..storage.fleet import BATCH, MAX_REPORT_BYTES, REPORT_HEADER, FleetClient, report_path
from ..v1 import fleet_pb2 as fpb

log = logging.getLogger("deltasync.relay")

STATES = ("current", "pinned", "behind", "failing", "drift", "silent")
#: States that fail ``deltasync fleet`` (exit status 1).
BAD_STATES = frozenset({"failing", "drift"})
SILENT_AFTER = 3  # report intervals without a report
DEFAULT_TTL = 3600.0
DEFAULT_MAX_NODES = 100_000
_MIN_INTERVAL, _MAX_INTERVAL = 0.1, 600.0


def classify(r: fpb.NodeReport, *, age: float, latest: int | None, pinned: int | None) -> str:
    """The state of a node from its report, ``age`` seconds old, against the repository's
    latest and pinned versions (None: unknown / none): ``silent`` (no report for three of its
    intervals), ``drift`` (its last live check found bits that are not its version),
    (or its agent said it stopped), ``failing`` (its agent's current error), ``pinned`` / ``current`` (it serves the pin / the
    latest), else ``behind``. A node that serves nothing yet is ``behind``, never current."""
    interval = min(max(r.interval, _MIN_INTERVAL), _MAX_INTERVAL)
    if age > SILENT_AFTER * interval or r.agent_state == "stopped":
        return "silent"
    if r.check == "drift":
        return "drift"
    if r.last_error:
        return "failing"
    if not r.version:
        return "behind"
    if pinned is not None:
        return "pinned" if r.version == pinned else "behind"
    target = latest or r.target_version or None
    return "current" if target is not None and r.version == target else "behind"


def node_row(r: fpb.NodeReport, latest: int | None, pinned: int | None) -> dict[str, Any]:
    """One node of a view as plain values (``fleet --json``, the fleet page), its state computed."""
    return {
        "node": r.node, "cluster": r.cluster, "version": r.version or None,
        "state": classify(r, age=r.age, latest=latest, pinned=pinned), "engine": r.engine,
        "version_digest": r.version_digest.hex() or None, "repository_id": r.repository_id.hex() or None,
        "target_version": r.target_version or None, "lag_seconds": round(r.lag_seconds, 3),
        "age_seconds": round(r.age, 3), "check": r.check or None, "check_unix": r.check_unix or None,
        "drifted_chunks": r.drifted_chunks, "last_error": r.last_error or None, "bytes_fetched": r.bytes_fetched,
        "agent_state": r.agent_state or None, "via": r.via or None,
    }


def parse_report_tokens(text: str, source: str = "report tokens") -> list[tuple[str, str | None]]:
    """``TOKEN`` or ``CLUSTER TOKEN`` per line (``#`` comments) -> [(token, cluster or None)]."""
    out: list[tuple[str, str | None]] = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise UsageError(f"{source} line {n}: expected TOKEN or CLUSTER TOKEN")
        out.append((words[-1], words[0] if len(words) == 2 else None))
    if not out:
        raise UsageError(f"{source} holds no token")
    if len({t for t, _ in out}) != len(out):
        raise UsageError(f"{source}: a token is listed twice")
    return out


def read_report_tokens(path: str | Path) -> list[tuple[str, str | None]]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read report token file {path}: {e.strerror}") from None
    return parse_report_tokens(text, str(path))


@dataclass
class _Entry:
    __slots__ = ("cluster", "data", "heard")
    data: bytes  # the serialized report
    heard: float  # time.monotonic() when this relay (or the one below it) heard it
    cluster: str


class FleetTable:
    """The latest report per node (thread-safe), at most ``max_nodes``, dropped after ``ttl``."""

    def __init__(self, *, ttl: float = DEFAULT_TTL, max_nodes: int = DEFAULT_MAX_NODES) -> None:
        if not ttl > 0 or max_nodes < 1:
            raise UsageError("the fleet table needs a positive ttl and max_nodes")
        self.ttl, self.max_nodes = ttl, max_nodes
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._pruned = time.monotonic()
        self.received = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, report: fpb.NodeReport, *, now: float | None = None) -> bool:
        """Keep ``report`` unless a fresher one of its node is kept (``report.age`` counts back
        from ``now``). False when the table is full of other live nodes."""
        now = time.monotonic() if now is None else now
        heard = now - max(0.0, report.age)
        report.age = 0.0
        data = report.SerializeToString()
        with self._lock:
            self.received += 1
            if now - self._pruned > 10.0:
                self._prune(now)
            old = self._entries.get(report.node)
            if old is not None and old.heard > heard:
                return True  # an older copy of the node's report, forwarded late: the newer stays
            if old is None and len(self._entries) >= self.max_nodes:
                self._prune(now)
                if len(self._entries) >= self.max_nodes:
                    self.refused += 1
                    return False
            self._entries[report.node] = _Entry(data, heard, report.cluster)
        return True

    def _prune(self, now: float) -> None:
        self._pruned = now
        dead = [node for node, e in self._entries.items() if now - e.heard > self.ttl]
        for node in dead:
            del self._entries[node]

    def reports(self, *, now: float | None = None) -> list[fpb.NodeReport]:
        """Every live node's report, ``age`` set to seconds since it was heard, by cluster and node."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._prune(now)
            kept = sorted(self._entries.items(), key=lambda kv: (kv[1].cluster, kv[0]))
        out = []
        for _node, e in kept:
            r = fpb.NodeReport.FromString(e.data)
            r.age = max(0.0, now - e.heard)
            out.append(r)
        return out


def fleet_metrics(reports: Iterable[fpb.NodeReport], latest: int | None, pinned: int | None) -> list[Metric]:
    """``deltasync_fleet_nodes{state}``, per cluster ``deltasync_fleet_cluster_nodes{cluster,state}``
    and the largest lag per cluster ``deltasync_fleet_lag_seconds{cluster}``."""
    by_state = dict.fromkeys(STATES, 0)
    by_cluster: dict[str, dict[str, int]] = {}
    lag: dict[str, float] = {}
    for r in reports:
        state = classify(r, age=r.age, latest=latest, pinned=pinned)
        by_state[state] += 1
        by_cluster.setdefault(r.cluster, dict.fromkeys(STATES, 0))[state] += 1
        lag[r.cluster] = max(lag.get(r.cluster, 0.0), r.lag_seconds)
    g = "gauge"
    out = [Metric("deltasync_fleet_nodes", g, "Reporting nodes by state", n, {"state": s}) for s, n in by_state.items()]
    for cluster, states in sorted(by_cluster.items()):
        out += [Metric("deltasync_fleet_cluster_nodes", g, "Reporting nodes by cluster and state", n,
                       {"cluster": cluster, "state": s}) for s, n in states.items()]
    out += [Metric("deltasync_fleet_lag_seconds", g, "Largest lag of a node of the cluster, in seconds", v,
                   {"cluster": c}) for c, v in sorted(lag.items())]
    out.append(Metric("deltasync_fleet_latest_version", g, "The repository's latest version as the relay sees it",
                      latest))
    return out


class FleetService:
    """The Fleet RPCs of one relay (``Report``, ``View``) over a :class:`FleetTable`.

    ``targets()`` returns the repository's (latest, pinned) versions; it may block (it reads
    the upstream) and runs on the relay's threads, at most once a second."""

    def __init__(
        self,
        *,
        tokens: list[tuple[str, str | None]] | None,
        cluster: str,
        name: str,
        targets: Callable[[], tuple[int | None, int | None]],
        table: FleetTable | None = None,
    ) -> None:
        self.table = table or FleetTable()
        self.cluster, self.name = cluster, name
        self._tokens = [(t.encode(), c) for t, c in tokens or []]
        self._targets = targets
        self._target_cache: tuple[float, tuple[int | None, int | None]] = (-1e9, (None, None))
        self._target_lock = threading.Lock()

    def bind(self, address: str, cluster: str = "") -> None:
        """Name this relay by the address it serves on (and its cluster, unless configured)."""
        self.name = address
        self.cluster = cluster or address

    def handlers(self) -> Any:
        """A generic handler for the relay's gRPC server."""
        return grpc.method_handlers_generic_handler("deltasync.v1.Fleet", {
            "Report": grpc.unary_unary_rpc_method_handler(
                self.report, request_deserializer=fpb.ReportBatch.FromString,
                response_serializer=fpb.ReportAck.SerializeToString),
            "View": grpc.unary_stream_rpc_method_handler(
                self.view, request_deserializer=fpb.ViewRequest.FromString,
                response_serializer=fpb.FleetView.SerializeToString),
        })

    def _scope(self, context: Any) -> tuple[bool, str | None]:
        """(authenticated, the only cluster it may report for, or None: any)."""
        got = b""
        for key, value in context.invocation_metadata() or ():
            if key == REPORT_HEADER:
                got = value.encode() if isinstance(value, str) else bytes(value)
        found: tuple[bool, str | None] = (False, None)
        for token, cluster in self._tokens:  # every one compared: the time says nothing of which
            if hmac.compare_digest(got, token) and not found[0]:
                found = (True, cluster)
        return found

    async def report(self, request: fpb.ReportBatch, context: Any) -> fpb.ReportAck:
        if not self._tokens:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "this relay takes no fleet reports (serve --report-token-file)")
        ok, scope = self._scope(context)
        if not ok:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong report token")
        accepted = 0
        now = time.monotonic()
        for r in request.reports:
            problem = _report_problem(r)
            if problem:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            if not r.cluster:
                r.cluster = self.cluster
            if scope is not None and r.cluster != scope:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"this report token may report for cluster {scope!r} only, not {r.cluster!r}")
            if not r.via:
                r.via = self.name
            if not self.table.put(r, now=now):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"the fleet table is full ({self.table.max_nodes} nodes)")
            accepted += 1
        return fpb.ReportAck(accepted=accepted)

    def targets(self) -> tuple[int | None, int | None]:
        """(latest, pinned), read at most once a second (None: unknown / not pinned)."""
        with self._target_lock:
            at, value = self._target_cache
            if time.monotonic() - at < 1.0:
                return value
            try:
                value = self._targets()
            except (DeltasyncError, OSError) as e:
                log.info("fleet view: the repository's versions are unknown (%s)", e)
            self._target_cache = (time.monotonic(), value)
            return value

    async def view(self, request: fpb.ViewRequest, context: Any) -> AsyncIterator[fpb.FleetView]:
        import asyncio

        latest, pinned = await asyncio.get_running_loop().run_in_executor(None, self.targets)
        reports = self.table.reports()
        now = time.time()
        for start in range(0, max(1, len(reports)), BATCH):
            yield fpb.FleetView(nodes=reports[start : start + BATCH], latest=latest or 0, pinned=pinned or 0,
                                now_unix=now)

    def metrics(self) -> list[Metric]:
        latest, pinned = self.targets()
        out = fleet_metrics(self.table.reports(), latest, pinned)
        out.append(Metric("deltasync_fleet_reports_total", "counter", "Reports received", self.table.received))
        out.append(Metric("deltasync_fleet_reports_refused_total", "counter", "Reports refused (table full)",
                          self.table.refused))
        return out


def _report_problem(r: fpb.NodeReport) -> str | None:
    if not r.node or len(r.node) > 256 or not r.node.isprintable():
        return "a report needs a printable node name of 1..256 characters"
    if len(r.cluster) > 128 or not r.cluster.isprintable():
        return f"node {r.node!r}: the cluster name must be printable, at most 128 characters"
    if r.ByteSize() > MAX_REPORT_BYTES:
        return f"node {r.node!r}: report over {MAX_REPORT_BYTES} bytes"
    return None


class Forwarder:
    """Sends a relay's table to its upstream relay every ``interval`` (a thread), so the root
    relay knows the nodes of every cluster. Failures are logged and retried at the next turn."""

    def __init__(self, table: FleetTable, upstream_url: str, *, report_token: str | None, interval: float = 2.0,
                 token: str | None = None) -> None:
        self.table, self.interval = table, interval
        self.client = FleetClient(upstream_url, report_token=report_token, token=token, timeout=max(5.0, interval * 2))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltasync-fleet-forward", daemon=True)
        self._failing = False
        self.forwarded = 0

    def start(self) -> Forwarder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.send()

    def send(self) -> None:
        reports = self.table.reports()
        if not reports:
            return
        try:
            self.forwarded += self.client.report(reports)
            if self._failing:
                log.info("fleet reports reach %s again", self.client.url)
            self._failing = False
        except DeltasyncError as e:
            if not self._failing:
                log.warning("cannot forward fleet reports to %s: %s", self.client.url, e)
            self._failing = True


#: Kinds of the Fleet calls, for a relay's token check to refuse them in their own shape.
FLEET_METHODS = {"Report": "unary", "View": "server_stream"}


def repository_targets(store: Store) -> Callable[[], tuple[int | None, int | None]]:
    """(latest, pinned) of the repository in ``store``, from its refs as hints (a relay holds no
    keys; agents check what they follow, this only labels the view)."""

    def read() -> tuple[int | None, int | None]:
        from ..repo.repository import LATEST, MAX_REF_BYTES, Repository, ref_hint

        try:
            latest = ref_hint(store.get(LATEST, max_bytes=MAX_REF_BYTES))
        except ObjectNotFoundError:
            latest = None
        return latest, Repository(store).pinned()

    return read


def fleet_service(upstream: Store, config: Any) -> FleetService:
    """The Fleet service of a relay with ``config`` (a ``RelayConfig``)."""
    return FleetService(tokens=config.report_tokens, cluster=config.cluster or config.listen, name=config.listen,
                        targets=repository_targets(upstream))


def start_forwarding(service: FleetService, upstream: Store, config: Any) -> Forwarder | None:
    """Forward the table to the upstream relay, when the upstream is one (else None)."""
    if not isinstance(upstream, GrpcStore):
        return None
    token = config.upstream_report_token
    if token is None:
        token = next((t for t, c in config.report_tokens or [] if c is None), None)
    if token is None:
        return None
    # The upstream's read token is the one this relay reads it with ($DELTASYNC_RELAY_TOKEN(_FILE)).
    return Forwarder(service.table, upstream.url, report_token=token, interval=config.report_interval).start()


__all__ = ["BAD_STATES", "STATES", "FleetService", "FleetTable", "Forwarder", "classify", "fleet_metrics", "node_row",
           "parse_report_tokens", "read_report_tokens", "report_path"]

"""The fleet: ``deltasync fleet`` (every node's version and state), the reporting options of
``subscribe`` and the confirmation of ``pin --wait`` / ``publish --wait``."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import UsageError
from ._common import emit_json, json_option

if TYPE_CHECKING:
    from ..storage.fleet import FleetView


def _client(url: str, timeout: float = 10.0) -> Any:
    from ..storage.fleet import FleetClient

    if not url.lower().startswith(("grpc://", "grpcs://")):
        raise UsageError(f"the fleet view comes from a relay (grpc://HOST:PORT), not {url!r}: "
                         "give the relay agents report to (--fleet grpc://… with a path or s3:// --repo)")
    return FleetClient(url, timeout=timeout)


def view_rows(view: FleetView) -> list[dict[str, Any]]:
    from ..relay.fleet import node_row

    return [node_row(r, view.latest, view.pinned) for r in view.nodes]


def _print_view(view: FleetView, rows: list[dict[str, Any]]) -> None:
    from ..relay.fleet import STATES

    counts = {s: sum(1 for r in rows if r["state"] == s) for s in STATES}
    pin = f", pinned {view.pinned}" if view.pinned else ""
    click.echo(f"latest {view.latest or '-'}{pin}; {len(rows)} nodes: "
               + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    cluster = None
    for row in rows:
        if row["cluster"] != cluster:
            cluster = row["cluster"]
            click.echo(f"cluster {cluster}")
        check = f" check {row['check']}" if row["check"] else ""
        error = f"  error: {row['last_error']}" if row["last_error"] else ""
        click.echo(f"  {row['node']:28} {row['engine']:6} version {row['version'] or '-':>6}  {row['state']:8}"
                   f" lag {row['lag_seconds']:.1f}s  seen {row['age_seconds']:.1f}s ago{check}{error}")


@click.command()
@click.option("--repo", "--fleet", "url", required=True, metavar="grpc://RELAY",
              help="The relay the agents report to (the root of a relay tree sees every cluster).")
@click.option("--watch", is_flag=True, help="Show the view again every --interval seconds until interrupted.")
@click.option("--interval", type=click.FloatRange(0.1, 3600), default=2.0, show_default=True, metavar="SECONDS",
              help="With --watch: seconds between views.")
@json_option
def fleet(url: str, watch: bool, interval: float, as_json: bool) -> None:
    """Every reporting node of every cluster: the version it serves and its state (current, pinned, behind,
    failing, drift, silent). Exit status 1 when any node is failing or drifted (for cron and CI)."""
    from ..relay.fleet import BAD_STATES

    with _client(url) as client:
        while True:
            view = client.view()
            rows = view_rows(view)
            if as_json:
                emit_json({"latest": view.latest, "pinned": view.pinned, "nodes": rows})
            else:
                if watch:
                    click.echo(f"-- {time.strftime('%H:%M:%S')} {url}")
                _print_view(view, rows)
            sys.stdout.flush()
            if not watch:
                break
            time.sleep(interval)
    if any(r["state"] in BAD_STATES for r in rows):
        sys.exit(1)


# -- confirmations -----------------------------------------------------------------------------


@dataclass
class Confirmation:
    version: int
    serving: list[str]
    others: list[tuple[str, str]]  # (node, what it serves or why not)

    @property
    def share(self) -> float:
        total = len(self.serving) + len(self.others)
        return len(self.serving) / total if total else 0.0


def confirm(view: FleetView, version: int, digest: bytes | None) -> Confirmation:
    """Which reporting nodes serve ``version`` (its version digest, when the report carries
    one, must be ``digest``): silent, failing and drifted nodes do not confirm."""
    out = Confirmation(version, [], [])
    from ..relay.fleet import node_row

    for r in view.nodes:
        row = node_row(r, view.latest, view.pinned)
        name = f"{r.cluster}/{r.node}"
        if row["state"] in ("silent", "failing", "drift"):
            out.others.append((name, f"{row['state']}, version {r.version or '-'}"))
        elif r.version != version:
            out.others.append((name, f"serves version {r.version or '-'}"))
        elif digest is not None and r.version_digest != digest:
            out.others.append((name, f"version {version} with another version digest"))
        else:
            out.serving.append(name)
    return out


def wait_for_fleet(
    fleet_url: str, version: Callable[[], int | None], *, digest: Callable[[int], bytes | None], quorum: float,
    timeout: float, what: str,
) -> None:
    """Wait until ``quorum`` of the reporting nodes serve ``version()``; else exit 1 naming the others."""
    deadline = time.monotonic() + timeout
    last: Confirmation | None = None
    with _client(fleet_url, timeout=max(2.0, min(10.0, timeout))) as client:
        while True:
            target = version()
            if target is not None:
                view = client.view()
                last = confirm(view, target, digest(target))
                if (last.serving or last.others) and last.share >= quorum - 1e-9:
                    click.echo(f"{what}: {len(last.serving)}/{len(last.serving) + len(last.others)} reporting "
                               f"engines serve version {target}")
                    return
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
    if last is None:
        click.echo(f"{what}: no target version to wait for within {timeout:g}s", err=True)
    elif not last.serving and not last.others:
        click.echo(f"{what}: no engine reports to {fleet_url} within {timeout:g}s", err=True)
    else:
        total = len(last.serving) + len(last.others)
        click.echo(f"{what}: only {len(last.serving)}/{total} reporting engines serve version {last.version} after "
                   f"{timeout:g}s (quorum {quorum:g}); not serving it:", err=True)
        for name, why in last.others:
            click.echo(f"  {name}: {why}", err=True)
    sys.exit(1)


def wait_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--wait``, ``--quorum``, ``--timeout``, ``--fleet`` (pin, publish)."""
    f = click.option("--fleet", "fleet_url", default=None, metavar="grpc://RELAY",
                     help="With --wait: the relay the agents report to [default: --repo when it is a relay].")(f)
    f = click.option("--timeout", "wait_timeout", type=click.FloatRange(0.1, 86400), default=300.0,
                     show_default=True, metavar="SECONDS", help="With --wait: how long to wait.")(f)
    f = click.option("--quorum", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True,
                     metavar="FRACTION", help="With --wait: the share of reporting engines that must serve it.")(f)
    return click.option("--wait", is_flag=True,
                        help="Wait until the reporting engines serve the version (see `deltasync fleet`); exit "
                             "status 1 naming those that do not, after --timeout.")(f)


def fleet_url_of(repo: str, fleet_url: str | None) -> str:
    if fleet_url is not None:
        return fleet_url
    if repo.lower().startswith(("grpc://", "grpcs://")):
        return repo
    raise UsageError("--wait needs the relay the agents report to: --fleet grpc://HOST:PORT")


def version_digest_of(repo: str) -> Callable[[int], bytes | None]:
    from .. import Repository

    r = Repository(repo)
    return lambda v: bytes(r.manifest(v).pb.version_digest) or None


# -- reporting from an agent -------------------------------------------------------------------


def report_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``subscribe``'s options for fleet reports and live checks."""
    f = click.option("--verify-every", type=click.FloatRange(0.01, 86400), default=None, metavar="SECONDS",
                     help="With --state: check the engine's live weights against the version's chunk digests "
                          "every SECONDS (throttled to a tenth of a core) and rewrite chunks that drifted.")(f)
    f = click.option("--report-interval", type=click.FloatRange(0.1, 600), default=2.0, show_default=True,
                     metavar="SECONDS", help="Seconds between fleet reports when nothing changes.")(f)
    f = click.option("--report-token-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
                     help="The relay's report token [default: $DELTASYNC_REPORT_TOKEN(_FILE)]; without one "
                          "the agent does not report.")(f)
    f = click.option("--report-to", default=None, metavar="grpc://RELAY",
                     help="Send fleet reports to this relay [default: --repo when it is a relay].")(f)
    f = click.option("--cluster", default="", metavar="NAME",
                     help="This node's cluster in fleet reports [default: named by the relay].")(f)
    return click.option("--node", "node_name", default=None, metavar="NAME",
                        help="This node's name in fleet reports [default: HOST:DIRNAME].")(f)


@dataclass
class FleetHooks:
    """What ``subscribe`` runs beside its agent: a reporter, a live checker, its control socket."""

    reporter: Any = None
    checker: Any = None
    control: Any = None

    def wake(self) -> None:
        if self.reporter is not None:
            self.reporter.wake()

    def close(self) -> None:
        if self.control is not None:
            self.control.close()
        for part in (self.checker, self.reporter):
            if part is not None:
                part.stop()


@dataclass(frozen=True, kw_only=True)
class HookOptions:
    """``subscribe``'s fleet options: how the node reports, and how often its engine is checked."""

    node: str | None
    cluster: str
    report_to: str | None
    report_token_file: Path | None
    report_interval: float
    verify_every: float | None


def start_hooks(agent: Any, state_dir: Path, *, repo: str, options: HookOptions) -> FleetHooks:
    """Start the reporter (when there is a relay to report to and a report token) and, for an
    engine-first agent, the live checker and its control socket."""
    o = options
    from ..agents import EngineAgent
    from ..agents.report import ReportConfig, Reporter, default_node, served_by
    from ..storage.fleet import read_report_token

    hooks = FleetHooks()
    try:
        if isinstance(agent, EngineAgent):
            from ..agents.live import ControlServer, LiveChecker

            if o.verify_every is not None and not callable(getattr(agent.engine, "verify", None)):
                raise UsageError(f"--verify-every: the {getattr(agent.engine, 'kind', '')} engine cannot check its live weights "
                                 "(torch and vllm engines can)")
            hooks.checker = LiveChecker(agent, every=o.verify_every).start()
            hooks.control = ControlServer(state_dir, hooks.checker)
        to = o.report_to or (repo if repo.lower().startswith(("grpc://", "grpcs://")) else None)
        token = read_report_token(o.report_token_file)
        if to is not None and token is not None:
            config = ReportConfig(to=to, node=o.node or default_node(state_dir), cluster=o.cluster,
                                  interval=o.report_interval, token=token)
            hooks.reporter = Reporter(state_dir, config, served_by(agent)).start()
        elif o.report_to is not None:
            raise UsageError("--report-to needs a report token (--report-token-file or $DELTASYNC_REPORT_TOKEN_FILE)")
    except BaseException:
        hooks.close()
        raise
    return hooks

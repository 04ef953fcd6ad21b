"""Commands on a local directory copy: pull, status, check, rollback."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ._common import (
    REPO_FORMS,
    RetryLog,
    dir_argument,
    emit_json,
    fsync_option,
    json_fields,
    json_option,
    local_dir,
    mib,
    move_aside_option,
    out_option,
    quiet_option,
    repo_option,
    repo_url,
    show_progress,
    trusted_key_option,
    workers_option,
)

if TYPE_CHECKING:
    from .. import Repository


@click.command()
@dir_argument
@repo_option
@out_option("Directory to bring to the version (or DIR).")
@click.option("--version", "version", type=click.IntRange(min=1), default=None, help="[default: latest]")
@click.option("--snapshot", is_flag=True,
              help="Bring DIR to the newest snapshot at or before the version instead (what a vLLM server for "
                   "`subscribe --state S --engine vllm@URL` starts from): written once per snapshot, nothing "
                   "rewritten while DIR holds it.")
@move_aside_option
@fsync_option
@trusted_key_option
@workers_option
@quiet_option
@json_option
def pull(
    directory: Path | None, repo: str, out: Path | None, version: int | None, snapshot: bool, move_aside: bool,
    fsync: bool, trusted_keys: tuple[Path, ...], workers: int, quiet: bool, as_json: bool,
) -> None:
    """Bring a directory to a version, byte for byte, verifying every chunk written.

    The directory keeps two slots of files in DIR/.deltasync; the one not served is brought
    forward in place (only what changed is written) and one atomic switch serves it. The
    files in DIR are links into the served slot. A directory already at the version is left
    as it is (its files are checked against the stats recorded when they were verified, and
    chunk by chunk when something wrote them since).

    With --snapshot, DIR is brought to the newest snapshot at or before the version: start a
    vLLM server from it (`vllm serve DIR --weight-transfer-config '{"backend":"deltasync"}'`),
    and `deltasync subscribe --state S --engine vllm@URL` brings the server to the version to
    serve through the deltas, with nothing of the model written locally per version. Run it
    again when a newer snapshot is published: DIR switches to it atomically.
    """
    from .. import Repository, Subscriber
    from ..local.cache import CachedStore
    from ..local.state import StateDB

    out = local_dir(directory, out, "pull")

    upstream = Repository(repo, trusted_keys=trusted_keys)
    counting = CachedStore(upstream.store)
    # With trusted keys, the newest signed refs accepted are remembered in the copy: an older one is a replay.
    memory = StateDB.open(out) if trusted_keys and version is None else None
    sub = Subscriber(Repository(counting, trusted_keys=trusted_keys, ref_memory=memory), workers=workers,
                     progress=show_progress(quiet))
    start = time.monotonic()
    of = None
    if snapshot:
        of = sub.repo.resolve(version)
        version = snapshot_of(sub.repo, of)
    result = sub.update_dir(out, version, move_aside=move_aside, fsync=fsync)
    seconds = time.monotonic() - start
    if as_json:
        emit_json({**json_fields(result), "directory": str(out), "how": str(result),
                   **({"snapshot_of": of} if of is not None else {}),
                   "fetched_bytes": counting.fetched_bytes, "seconds": round(seconds, 3)})
        return
    what = f"snapshot version {result.version} (of version {of})" if of is not None else f"version {result.version}"
    click.echo(f"pulled {what} into {out} ({result}, {mib(counting.fetched_bytes)} fetched, {seconds:.2f}s)")


def snapshot_of(repo: Repository, version: int) -> int:
    """The newest snapshot at or before ``version``: the one its manifest names when that is one,
    else the start of its delta chain."""
    nearest = int(repo.manifest(version).pb.snapshot)
    if nearest and repo.manifest(nearest).is_snapshot:
        return nearest
    return repo.chain(version)[0].version


@click.command()
@dir_argument
@out_option("The local copy (or DIR).")
@click.option("--state", "state_dir", type=click.Path(path_type=Path, file_okay=False), default=None, metavar="DIR",
              help="An engine-first agent's state (subscribe --engine SPEC --state DIR): the engine's version.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
def status(directory: Path | None, out: Path | None, state_dir: Path | None, as_json: bool) -> None:
    """Show a local copy's (or an engine's) version, lag, agent, bytes fetched, apply time and last error (safe
    while an agent runs)."""
    from ..agents import read_status
    from ..errors import UsageError

    if state_dir is not None and (directory is not None or out is not None):
        raise UsageError("give a local copy (DIR or --out DIR) or an engine's --state DIR, not both")
    directory = state_dir if state_dir is not None else local_dir(directory, out, "status")

    s = read_status(directory)
    if as_json:
        click.echo(json.dumps(s, sort_keys=True))
        return

    def ago(t: float | None) -> str:
        return "-" if t is None else f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))} ({time.time() - t:.1f}s ago)"

    def opt(v: object) -> str:
        return "-" if v is None else str(v)

    lag = "-" if s["lag_versions"] is None else f"{s['lag_versions']} version(s)"
    if s["lag_seconds"] is not None:
        lag += f", {s['lag_seconds']:.1f}s"
    agent = f"running (pid {s.get('pid')}, {s.get('state')})" if s["running"] else "not running"
    followed = s.get("latest_version") is not None or bool(s.get("updates_total"))
    unknown = ("unknown: no agent has followed this copy (status reads only local state; "
               "`deltasync log --repo` asks the repository)")
    # A running engine-first agent claims no version before it has checked its engine (loading, restoring).
    phase = s.get("engine_phase") if s["running"] and s.get("engine") and s["version"] is None else None
    if phase not in ("loading", "restoring"):
        phase = None
    refused = s.get("refused_ref")
    refused_note = ""
    if isinstance(refused, dict):
        # The version a refused ref names, beside the older one accepted: not "lag 0" alone.
        named = refused.get("version")
        what = f"{refused['ref']} names version" if refused.get("ref") else "version"
        refused_note = f" ({what} {named if named is not None else '?'}: refused, see last error)"
    rows = [
        ("state" if s.get("engine") else "directory", s["directory"]),
        *([("engine", str(s["engine"]))] if s.get("engine") else []),
        ("repository", (s["repo"] or "-") + (f" (identity {s['repository_id']})" if s.get("repository_id") else "")),
        ("version", f"- ({phase}: this run has not yet checked what the engine holds; the last run left version "
                    f"{opt(s.get('recorded_version'))})" if phase
                    else f"{opt(s['version'])}, installed {ago(s['installed_unix'])}"),
        ("latest", f"{opt(s.get('latest_version'))}, first seen {ago(s.get('latest_seen_unix'))}{refused_note}"
                   if followed else unknown),
        ("pinned", opt(s.get("pinned_version")) if followed else "unknown"),
        ("lag", (lag + (" (from the pin)" if s.get("pinned_version") is not None else "")
                 + (" behind what was accepted" if refused_note else "")) if followed else "unknown"),
        ("agent", agent),
        ("fetched", f"{mib(int(s.get('bytes_fetched_total') or 0))} in total, {s.get('updates_total') or 0} update(s)"
                    if followed else "- (pulled, not followed by an agent)"),
    ]
    last = s.get("last_update")
    if last:
        moved = (f"{last['previous']} -> {last['version']}" if last.get("previous") is not None
                 else f"to {last['version']} (none held before)")
        rows.append(("last update", f"{moved}: {last['how']}, "
                                    f"{mib(int(last['fetched_bytes']))} fetched, applied in {last['seconds']:.2f}s"))
    if s.get("engine_kind") is not None:
        if not s.get("engine"):  # a copy with an engine (an engine alone: its version is the version above)
            checking = s["running"] and s.get("engine_phase") in ("loading", "restoring")
            behind = ("" if s.get("engine_current") else f" ({s['engine_phase']}: not yet checked by this run)"
                      if checking else f" (the directory holds {opt(s['version'])})")
            rows.append(("engine", f"{s['engine_kind']} at version {opt(s.get('engine_version'))}{behind}, updated "
                                   f"{ago(s.get('engine_updated_unix'))}"))
        if s.get("engine_last_error"):
            rows.append(("engine error", f"{ago(s.get('engine_last_error_unix'))}: update to version "
                                         f"{opt(s.get('engine_last_error_version'))}: {s['engine_last_error']}"))
    check = s.get("live_check")
    if check:  # check --state / --verify-every (agents/live.py)
        found = f", {check.get('drifted_chunks', 0)} chunk(s) drifted" if check.get("drifted_chunks") else ""
        what = check.get("error") or f"{check.get('chunks_checked', 0)} chunks of version {opt(check.get('version'))}"
        rows.append(("live check", f"{check.get('result')} {ago(check.get('unix'))}: {what}{found}"))
    wip = s.get("wip")
    if wip:
        done = f"{wip['chunks_done']}/{wip['chunks_total']} chunks"
        rows.append(("in progress", f"version {wip['target']} ({wip['phase']}, {done})"))
    if s.get("last_error"):
        rows.append(("last error", f"{ago(s.get('last_error_unix'))}: {s['last_error']}"))
    for name, value in rows:
        click.echo(f"{name:12} {value}")


@click.command()
@dir_argument
@out_option("The local copy (or DIR).")
@click.option("--state", "state_dir", type=click.Path(path_type=Path, file_okay=False), default=None, metavar="DIR",
              help="Check the live weights of the engine of the agent running on this state directory (subscribe "
                   "--state DIR --engine ...) against the version's chunk digests; drifted chunks are rewritten "
                   "unless --no-repair.")
@click.option("--no-repair", is_flag=True, help="With --state: report drift only.")
@click.option("--repair", is_flag=True, help="Fetch only the drifted chunks (from the nearest snapshot) and fix them in place.")
@click.option("--repo", default=None, metavar="URL", callback=repo_url,
              help=f"Repository: {REPO_FORMS} [default: the repository the copy was pulled from].")
@move_aside_option
@trusted_key_option
@workers_option
@json_option
def check(
    directory: Path | None, out: Path | None, repair: bool, repo: str | None, move_aside: bool,
    trusted_keys: tuple[Path, ...], workers: int, as_json: bool, state_dir: Path | None, no_repair: bool,
) -> None:
    """Compare a local copy with the manifest of its version, chunk by chunk, and list files in it that are not the
    version's (exit status 1 on drift or such files without --repair / --move-aside). With --state DIR: the live
    weights of a running engine-first agent's engine (exit status 1 on drift not repaired, or no check)."""
    from ..errors import UsageError
    from ..local.check import check_copy

    if state_dir is not None:
        if directory is not None or out is not None or repo is not None:
            raise UsageError("check --state DIR asks the running agent; give no copy or --repo with it")
        _check_live(state_dir, repair=not no_repair, as_json=as_json)
        return
    directory = local_dir(directory, out, "check")
    report = check_copy(directory, repo=repo, repair=repair, workers=workers, trusted_keys=trusted_keys,
                        move_aside=move_aside and repair)
    if as_json:  # exit status as without --json
        emit_json({**json_fields(report), "drifted": [str(d) for d in report.drifted], "ok": report.ok})
        if not report.ok:
            sys.exit(1)
        return
    if report.other_repository:
        click.echo(f"not that repository's version: {report.other_repository}")
    for d in report.drifted:
        click.echo(f"drifted: {d}")
    for rel in report.foreign:
        click.echo(f"not the version's: {rel} (a loader may read it; check --repair --move-aside moves it aside)")
    if (report.foreign or report.other_repository) and not report.drifted:
        sys.exit(1)
    summary = f"version {report.version}: {report.files} files, {report.chunks} chunks"
    if report.repaired:
        click.echo(f"{summary}: repaired {len(report.drifted)} ({mib(report.fetched_bytes)} fetched)")
    elif report.drifted:
        click.echo(f"{summary}: {len(report.drifted)} drifted (run with --repair to fix)")
        sys.exit(1)
    else:
        click.echo(f"{summary}: ok")


@click.command()
@dir_argument
@out_option("The local copy (or DIR).")
@click.option("--to", "version", type=click.IntRange(min=1), required=True, metavar="N", help="Version to move to.")
@click.option("--repo", default=None, metavar="URL", callback=repo_url,
              help=f"Repository: {REPO_FORMS} [default: the repository the copy was pulled from].")
@trusted_key_option
@workers_option
@quiet_option
@json_option
def rollback(directory: Path | None, out: Path | None, version: int, repo: str | None, trusted_keys: tuple[Path, ...],
             workers: int, quiet: bool, as_json: bool) -> None:
    """Move a local copy to an earlier version N, reversing the deltas in between where it can.

    Nothing is downloaded for deltas whose payloads the copy kept (see subscribe --keep-versions)
    and that reverse: chunks published with --context-classes 0. Chunks coded in magnitude
    classes (the default codec) do not decode backwards and come from the snapshot plus chain.
    """
    from ..agents import AgentConfig, rollback as rollback_copy

    directory = local_dir(directory, out, "rollback")
    with RetryLog(None, False).installed():
        u = rollback_copy(directory, version, repo=repo, config=AgentConfig(workers=workers, progress=show_progress(quiet)),
                          trusted_keys=trusted_keys)
    if as_json:
        emit_json({"directory": str(directory), "version": version, "moved": u is not None,
                    **({} if u is None else {"previous": u.previous, "how": u.how, "fetched_bytes": u.fetched_bytes,
                                             "seconds": round(u.seconds, 3)})})
    elif u is None:
        click.echo(f"{directory} is already at version {version}")
    else:
        was = f"from version {u.previous} " if u.previous is not None else "(it held no version) "
        click.echo(f"moved {directory} {was}to version {u.version} "
                   f"({u.how}, {mib(u.fetched_bytes)} fetched, {u.seconds:.2f}s)")



def _check_live(state_dir: Path, *, repair: bool, as_json: bool) -> None:
    from ..agents.live import ask_check

    result = ask_check(state_dir, repair=repair)
    ok = result.get("result") in ("ok", "repaired")
    if as_json:
        emit_json({**result, "ok": ok})
    else:
        what = f"version {result.get('version', '-')}: {result.get('chunks_checked', 0)} chunks of the live weights"
        outcome = result.get("result")
        if outcome == "ok":
            click.echo(f"{what}: ok")
        elif outcome in ("drift", "repaired"):
            for name in result.get("drifted", []):
                click.echo(f"drifted: {name}")
            if outcome == "repaired":
                click.echo(f"{what}: {result.get('drifted_chunks')} drifted, repaired "
                           f"({result.get('chunks_rewritten', '?')} chunks rewritten)")
            else:
                click.echo(f"{what}: {result.get('drifted_chunks')} drifted" + ("" if repair else " (not repaired)"))
        else:
            click.echo(f"no live check: {result.get('error', 'unknown error')}")
    if not ok:
        sys.exit(1)

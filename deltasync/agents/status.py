"""The status of a copy or an engine-first agent's state, read from any process
(``deltasync status``): its version, work in progress, and what its agent last recorded."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..local.state import STATE_DIR, EngineState, LocalState, StateDB


def read_status(out: str | os.PathLike[str]) -> dict[str, Any]:
    """The figures of the copy at ``out``: its version, work in progress, and what its agent
    last recorded, with the lag computed now. Reads only: safe while an agent runs."""
    root = Path(out)
    db = StateDB.open(root, create=False)
    if db is None:
        raise UsageError(_no_state(root))
    state, wip, stats = db.state(), db.wip(), db.stats()
    now = time.time()
    running = bool(stats.get("running")) and _alive(stats.get("pid"))
    # A running agent that has not yet checked its engine in this process claims nothing for it
    # (after a restart the engine holds what its factory built, not the version recorded).
    unverified = running and stats.get("engine_phase") in ("loading", "restoring")
    engine_first = bool(stats.get("engine"))  # recorded by an engine-first agent (StateDB.record_engine)
    version = state.version if state is not None and not (engine_first and unverified) else None
    latest = stats.get("latest_version")
    # Lag is against what the agent serves: the pin while one is held, else the latest.
    target = stats.get("target_version")
    if target is None:  # no agent's target (a pull moved the copy since): the newest version seen
        target = latest
    lag_versions = abs(target - version) if target is not None and version is not None else None
    stale = stats.get("stale_since_unix")
    if lag_versions == 0:
        lag_seconds: float | None = 0.0
    elif stale is not None:
        lag_seconds = max(0.0, now - float(stale))
    else:
        lag_seconds = None
    out_status: dict[str, Any] = dict(stats)
    out_status.update({
        "directory": str(root.resolve()),
        "repo": (state.repo if state is not None and state.repo else stats.get("repo", "")),
        "version": version,
        "version_digest": state.version_digest if state is not None and version is not None else None,
        "recorded_version": state.version if state is not None else None,
        "repository_id": (state.repository_id or None) if state is not None else None,
        **_engine_status(db.engine(), state, unverified),
        "installed_unix": state.installed_unix if state is not None else None,
        "running": running,
        "lag_versions": lag_versions,
        "lag_seconds": lag_seconds,
        "wip": vars(wip) if wip is not None else None,
    })
    if not running and out_status.get("state") not in (None, "stopped"):
        out_status["state"] = "not running"
    return out_status


def _no_state(root: Path) -> str:
    """Why ``root`` has no state to show, as far as can be told from outside: never pulled or
    subscribed into, or its state deleted (an agent running there then writes only into
    deleted files, and status cannot see it)."""
    deleted = "; if an agent runs there, its state was deleted under it: it records nothing now, restart it"
    if not root.exists():
        return f"{root} does not exist: nothing was pulled or subscribed into it{deleted}"
    if not root.is_dir():
        return f"{root} is a file, not a directory: give the directory that holds the copy or state"
    return (f"{root} holds no deltasync state ({root / STATE_DIR} is missing): nothing was pulled or subscribed "
            f"into it{deleted}")


def _engine_status(engine: EngineState | None, state: LocalState | None, unverified: bool) -> dict[str, Any]:
    """The engine's record as status fields (none without an engine): its version next to the
    copy's (``engine_current``: the same version digest and repository), its last error; no
    version while its running agent has not checked it yet (``unverified``)."""
    if engine is None:
        return {}
    current = (not unverified and state is not None and engine.version == state.version
               and engine.version_digest == state.version_digest and engine.repository_id == state.repository_id)
    return {
        "engine_kind": engine.kind, "engine_version": None if unverified else engine.version,
        "engine_version_digest": (engine.version_digest or None) if not unverified else None,
        "engine_current": current, "engine_updated_unix": engine.updated_unix, "engine_last_error": engine.last_error,
        "engine_last_error_unix": engine.last_error_unix, "engine_last_error_version": engine.last_error_version,
    }


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True



__all__ = ["read_status"]

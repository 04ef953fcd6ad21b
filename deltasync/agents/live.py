"""Live weights verified: an engine agent re-hashes what its engine holds now against the
manifest's chunk digests, and repairs what drifted.

``LiveChecker(agent)`` runs in the agent's process, next to the engine. ``check()`` asks the
engine (``Engine.verify``: a torch engine hashes its tensors) which chunks differ from the
version it claims; on drift the agent's forced restage (the same one every run begins with:
``EngineAgent.restage``) rewrites only the chunks whose digests differ, and a second check
confirms it. Each result is recorded in the state (``stats["live_check"]``: shown by
``deltasync status``, sent up in the fleet report, where ``drift`` fails ``deltasync fleet``).

With ``every`` seconds the checker runs in the background, throttled: each check's hashing
time is followed by at least nine times as long idle, so verification takes at most a tenth
of a core, whatever ``every`` says. ``deltasync check --state DIR`` asks a running agent for
a check through a Unix socket (:class:`ControlServer`) whose path the state directory
records in ``.deltasync/control``: only whoever may read the state directory can ask.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DeltasyncError, UsageError
from ..local.state import STATE_DIR, StateDB

if TYPE_CHECKING:
    from .engine import EngineAgent

log = logging.getLogger("deltasync.agents")

CONTROL_FILE = "control"
THROTTLE = 9.0  # idle time after a check, as a multiple of the check's own time
REPAIR_TIMEOUT = 120.0
_MAX_LISTED = 32  # drifted chunks named in a result (the count is always whole)


class LiveChecker:
    """Checks (and repairs) the live weights of ``agent``'s engine; see the module doc."""

    def __init__(self, agent: EngineAgent, *, every: float | None = None, repair: bool = True) -> None:
        if every is not None and not every > 0:
            raise UsageError(f"--verify-every must be positive, got {every}")
        self.agent, self.every, self.repair = agent, every, repair
        self.last: dict[str, Any] | None = None
        self._lock = threading.Lock()  # one check at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LiveChecker:
        if self.every is not None:
            self._thread = threading.Thread(target=self._run, name="deltasync-live-check", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        assert self.every is not None
        wait = self.every
        while not self._stop.wait(wait):
            start = time.monotonic()
            if self.agent.current() is not None:
                with contextlib.suppress(DeltasyncError, OSError):
                    self.check()
            spent = time.monotonic() - start
            wait = max(self.every - spent, THROTTLE * spent, 0.01)

    def check(self, *, repair: bool | None = None) -> dict[str, Any]:
        """One check of the engine's live weights (and a repair of what drifted, unless
        ``repair`` is False); returns the result recorded in the state."""
        repair = self.repair if repair is None else repair
        with self._lock:
            result = self._check(repair)
        self.last = result
        if result.get("unsupported"):
            return result  # nothing was checked: the state keeps the last real check
        with contextlib.suppress(DeltasyncError, OSError):
            db = StateDB.open(self.agent.root, create=False)
            if db is not None:
                db.update_stats({"live_check": result})
        return result

    def _check(self, repair: bool) -> dict[str, Any]:
        engine = self.agent.engine
        now = time.time()
        verify = getattr(engine, "verify", None)
        if engine is None or not callable(verify):
            kind = engine.kind if engine is not None else "no"
            return {"result": "error", "unix": now, "unsupported": True,
                    "error": f"the {kind} engine cannot check its live weights"}
        version = self.agent.current()
        if version is None:
            return {"result": "error", "unix": now, "error": "the engine holds no version yet"}
        t0 = time.monotonic()
        try:
            # no version named: the engine checks the version it holds under its own mutex (a swap
            # landing between reading the agent's version and the check would show as drift)
            found = verify()
        except (DeltasyncError, OSError) as e:
            return {"result": "error", "unix": now, "version": version, "error": str(e)}
        result: dict[str, Any] = {
            "result": "ok" if found.ok else "drift", "unix": now, "version": found.version,
            "chunks_checked": found.chunks_checked, "drifted_chunks": len(found.drifted),
            "drifted": [f"{name}#{idx}" for name, idx in found.drifted[:_MAX_LISTED]],
            "seconds": round(time.monotonic() - t0, 6),
        }
        if found.ok:
            return result
        log.warning("live check: %d chunk(s) of version %d drifted in the engine (%s)", len(found.drifted),
                    found.version, ", ".join(result["drifted"][:4]))
        if not repair:
            return result
        swap = self._restage(found.version)
        after = verify()  # what the engine holds after the restage (a move that landed meanwhile included)
        result["repaired"] = after.ok
        result["result"] = "repaired" if after.ok else "drift"
        if swap is not None:
            result["chunks_rewritten"] = swap.chunks_changed
            result["repair_fetched_bytes"] = swap.fetched_bytes
        if not after.ok:
            result["drifted_chunks"] = len(after.drifted)
        return result

    def _restage(self, version: int) -> Any:
        """The agent's forced restage, run by its own loop; waits for it (bounded)."""
        agent = self.agent
        before = len(agent.engine.swaps) if agent.engine is not None else 0
        agent.restage()
        deadline = time.monotonic() + REPAIR_TIMEOUT
        while time.monotonic() < deadline and not agent.stopping:
            engine = agent.engine
            if agent.current() is not None and engine is not None and len(engine.swaps) > before:
                return engine.swaps[-1]
            time.sleep(0.02)
        raise DeltasyncError(f"the agent did not restage version {version} within {REPAIR_TIMEOUT:.0f}s")


# -- asking a running agent ------------------------------------------------------------------------


class ControlServer:
    """A Unix socket in a private directory (mode 0700) answering ``{"op": "check"}`` with a
    :class:`LiveChecker` result; its path is written to ``DIR/.deltasync/control``."""

    def __init__(self, state_dir: str | os.PathLike[str], checker: LiveChecker) -> None:
        self.checker = checker
        self._dir = tempfile.mkdtemp(prefix="deltasync-ctl-")
        os.chmod(self._dir, 0o700)
        self.path = os.path.join(self._dir, "s")
        self._pointer = Path(state_dir) / STATE_DIR / CONTROL_FILE
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(8)
        self._sock.settimeout(0.5)
        tmp = self._pointer.with_name(CONTROL_FILE + ".tmp")
        tmp.write_text(json.dumps({"socket": self.path, "pid": os.getpid()}) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, self._pointer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="deltasync-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        with contextlib.suppress(OSError):
            if json.loads(self._pointer.read_text()).get("socket") == self.path:
                self._pointer.unlink()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(REPAIR_TIMEOUT + 30)
            try:
                request = json.loads(_read_line(conn))
                if not isinstance(request, dict) or request.get("op") != "check":
                    answer: dict[str, Any] = {"result": "error", "error": "unknown request"}
                else:
                    answer = self.checker.check(repair=bool(request.get("repair", True)))
            except (ValueError, OSError, DeltasyncError) as e:
                answer = {"result": "error", "error": str(e)}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(answer).encode() + b"\n")


def _read_line(conn: socket.socket, limit: int = 1 << 16) -> str:
    data = b""
    while not data.endswith(b"\n"):
        part = conn.recv(4096)
        if not part:
            break
        data += part
        if len(data) > limit:
            raise ValueError("request too long")
    return data.decode()


def ask_check(state_dir: str | os.PathLike[str], *, repair: bool = True, timeout: float = REPAIR_TIMEOUT + 30) -> dict[str, Any]:
    """Ask the agent running on ``state_dir`` for a live check (``deltasync check --state``)."""
    pointer = Path(state_dir) / STATE_DIR / CONTROL_FILE
    try:
        path = json.loads(pointer.read_text())["socket"]
    except (OSError, ValueError, KeyError):
        raise UsageError(f"no running agent answers for {state_dir} (it checks live weights only while "
                         "`deltasync subscribe --state DIR --engine ...` runs)") from None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
            s.sendall(json.dumps({"op": "check", "repair": repair}).encode() + b"\n")
            answer = json.loads(_read_line(s, 1 << 20))
        except (OSError, ValueError) as e:
            raise UsageError(f"the agent of {state_dir} did not answer ({e}); is it still running?") from None
    if not isinstance(answer, dict):
        raise UsageError(f"the agent of {state_dir} answered nonsense")
    return answer


__all__ = ["ControlServer", "LiveChecker", "ask_check"]

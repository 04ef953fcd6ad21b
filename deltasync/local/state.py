"""The state of a local copy: an LMDB environment inside it, and a lock on it.

``DIR/.deltasync/`` holds::

    state.lmdb/   LMDB environment: every change is one atomic, durable transaction; readers
                  (``deltasync status``) never block the writer (the agent)
    lock          held (flock) by the one process that changes the copy
    slots/0, slots/1
                  the two slots: each holds the files of one version (see slots.py); the
                  version served is in one, the other is brought forward in place
    current       symbolic link to the slot served; every file of the version in DIR is a
                  link through it, so switching it switches the whole version at once
    objects/      manifests, blobs and delta payloads of recent versions (local/cache.py, local/kept.py)
    aside/        files found in DIR that were not the repository's, moved aside on request

Records of the environment (JSON unless noted):

``state``
    the version held (served): id, version digest, files, repository URL, when installed.
``manifest`` (protobuf)
    the manifest of the version held: its file layout and every chunk's target digest, so
    that the copy can be checked offline, and read as a base even after gc deleted its
    version upstream.
``slots``
    which slot is served, the version each slot holds (None while one is being written,
    with the version it held before), the boot it was switched in and whether its bytes
    were flushed to disk (see slots.py: after a power loss, unflushed slots are checked).
``slot_manifest`` (protobuf)
    the manifest of the version in the slot not served (or of the version it held before
    its rewrite began): which chunks need no work when it is brought forward.
``wip``
    a pull in progress: target, phase (``fetch`` or ``install``), progress; in the
    ``install`` phase also the journal (the slot to switch to, links to make, links to
    drop) and the target's manifest under ``wip_manifest``, so that a process killed while
    switching is finished by the next one, never redone.
``stats``
    the agent's figures (see agent.py), read by ``deltasync status`` while the agent runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from ..durable import fsync_dir
from ..errors import (
    CheckpointError,
    CopyInUseError as CopyInUseError,  # defined there; importable here too
    DeltasyncError,
    PullStopped as PullStopped,
)
from ..format.manifest import ManifestInfo, check_relpath, parse_manifest

STATE_DIR = ".deltasync"
STATE_DB = "state.lmdb"
INCOMING = "incoming"
LIBRARY_FILE = "model.safetensors"
_LEGACY_STATE = "state.json"  # deltasync before the LMDB state
_MAP_SIZE = 64 << 20  # initial LMDB map; doubled whenever a write does not fit

T = TypeVar("T")


# -- records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalState:
    """The version a local copy holds."""

    version: int
    version_digest: str
    files: tuple[str, ...]
    repo: str = ""
    """URL of the repository it was pulled from ("" when unknown)."""
    installed_unix: float = 0.0
    repository_id: str = ""
    """Hex identity of that repository, as the version's manifest names it ("" when it names
    none: committed before identities, or recorded by older deltasync). A copy holds version N
    of a repository only when this and the version digest are that repository's."""
    history_digest: str = ""
    """Hex history digest of the version held (repo/history.py; "" when its manifest has none
    or older deltasync recorded it): a newer version must extend it."""

    def holds(self, info: ManifestInfo) -> bool:
        """Whether this is ``info``'s version of ``info``'s repository: the same version digest,
        and no other identity (never the version number alone)."""
        return (self.version == info.version and self.version_digest == info.pb.version_digest.hex()
                and self.repository_id == info.pb.repository_id.hex())


@dataclass(frozen=True)
class EngineState:
    """What an agent's engine holds and how its updates went: one record for both kinds of
    agent (a copy with an engine, agents/directory.py; an engine alone, agents/engine.py),
    read by ``deltasync status`` next to the copy's version."""

    kind: str
    """The engine's kind (``torch``, ``fanout``, ``vllm``, ``http``)."""
    version: int | None = None
    """The version it holds (None: none known yet)."""
    version_digest: str = ""
    repository_id: str = ""
    updated_unix: float | None = None
    """When it last took a version."""
    last_error: str | None = None
    """Why the last update that failed did (kept after later successes: see ``last_error_unix``)."""
    last_error_unix: float | None = None
    last_error_version: int | None = None
    """The version that update was bringing it to."""


@dataclass(frozen=True)
class WorkInProgress:
    """A pull that has started and not yet been recorded as the version held."""

    target: int
    phase: str  # "fetch" | "install"
    started_unix: float
    chunks_done: int = 0
    chunks_total: int = 0
    install: tuple[str, ...] = ()  # install phase: files of the new version (links to make)
    remove: tuple[str, ...] = ()  # install phase: files of the old version to drop
    slot: str = ""  # install phase: the slot switched to ("" in journals of older deltasync)


@dataclass(frozen=True)
class SlotInfo:
    """What one slot holds."""

    version: int | None
    """The version whose verified files it holds; None while it is being rewritten (or empty)."""
    source: int | None = None
    """While being rewritten: the version it held before (chunks not yet rewritten keep its bytes)."""
    files: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """(size, mtime, ctime, inode) of each file when the slot was verified: a file whose
    stat differs has been written since (through a link, say) and is trusted only by digest."""


@dataclass(frozen=True)
class SlotsRecord:
    """The two slots of a copy and which one is served."""

    active: str | None
    slots: dict[str, SlotInfo] = field(default_factory=dict)
    boot_id: str = ""  # the boot in which the served slot was last written
    synced: bool = True  # its bytes were flushed to disk before the switch

    def info(self, name: str) -> SlotInfo:
        return self.slots.get(name, SlotInfo(None))

    def replace(self, **changes: Any) -> SlotsRecord:
        return dataclasses.replace(self, **{"slots": dict(self.slots), **changes})


def output_files(info: ManifestInfo) -> list[str]:
    """Files a version occupies in a directory (a library version: one safetensors file)."""
    return [f.path for f in info.pb.files] if info.pb.files else [LIBRARY_FILE]


# -- the environment ----------------------------------------------------------------------------


class StateDB:
    """The LMDB environment of one local copy. Use :meth:`open`; one per process and path."""

    _open: dict[str, tuple[tuple[int, int], StateDB]] = {}
    _open_lock = threading.Lock()

    def __init__(self, root: Path, env: lmdb.Environment) -> None:
        self.root = root
        self.env = env
        # One transaction at a time in this process: growing the map (set_mapsize) requires
        # that none is open. Transactions are tiny; readers in other processes never wait.
        self._txn_lock = threading.Lock()

    @classmethod
    def open(cls, root: str | os.PathLike[str], *, create: bool = True) -> StateDB | None:
        """The environment of the copy at ``root``; None when it has none and not ``create``.

        LMDB forbids opening one environment twice in a process (closing one handle would
        drop the other's locks), so environments are shared per path, and reopened when the
        directory was replaced underneath (another inode).
        """
        root = Path(root)
        path = state_dir(root) / STATE_DB
        if not create and not (path / "data.mdb").exists():
            return None
        try:
            path.mkdir(parents=True, exist_ok=True)
            key = os.path.realpath(path)
            with cls._open_lock:
                found = cls._open.get(key)
                if found is not None:
                    with contextlib.suppress(OSError):
                        st = os.stat(path / "data.mdb")
                        if (st.st_dev, st.st_ino) == found[0]:
                            return found[1]
                    found[1].env.close()
                    del cls._open[key]
                env = lmdb.open(str(path), map_size=_MAP_SIZE, max_dbs=0, subdir=True)
                st = os.stat(path / "data.mdb")
                db = cls(root, env)
                cls._open[key] = ((st.st_dev, st.st_ino), db)
                return db
        except (OSError, lmdb.Error) as e:
            detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise CheckpointError(str(path), f"cannot open the local state ({detail})") from None

    # -- raw access ----------------------------------------------------------------------------

    def _get(self, key: str) -> bytes | None:
        with self._txn_lock:
            while True:
                try:
                    with self.env.begin() as txn:
                        raw = txn.get(key.encode())
                    return bytes(raw) if raw is not None else None
                except lmdb.MapResizedError:  # another process grew the map: adopt its size
                    self.env.set_mapsize(0)

    def _json(self, key: str) -> dict[str, Any] | None:
        raw = self._get(key)
        if raw is None:
            return None
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in one write transaction, growing the map when it does not fit."""
        with self._txn_lock:
            while True:
                try:
                    with self.env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
                except lmdb.MapResizedError:
                    self.env.set_mapsize(0)

    # -- records -------------------------------------------------------------------------------

    def state(self) -> LocalState | None:
        raw = self._json("state")
        if raw is None:
            return _legacy_state(self.root)
        try:
            return LocalState(
                int(raw["version"]), str(raw["version_digest"]), tuple(str(f) for f in raw["files"]),
                str(raw.get("repo", "")), float(raw.get("installed_unix", 0.0)), str(raw.get("repository_id", "")),
                str(raw.get("history_digest", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def manifest(self) -> ManifestInfo | None:
        """The manifest of the version held, as recorded locally (None if unknown or damaged).

        Not authenticated again: it only says where the held bits are; every bit read is
        checked against the digests of the (authenticated) target before use."""
        return self._manifest("manifest")

    def _manifest(self, key: str) -> ManifestInfo | None:
        raw = self._get(key)
        if raw is None:
            return None
        try:
            return parse_manifest(raw)
        except DeltasyncError:
            return None

    def wip(self) -> WorkInProgress | None:
        raw = self._json("wip")
        if raw is None:
            return None
        try:
            return WorkInProgress(
                int(raw["target"]), str(raw["phase"]), float(raw["started_unix"]),
                int(raw.get("chunks_done", 0)), int(raw.get("chunks_total", 0)),
                tuple(raw.get("install", ())), tuple(raw.get("remove", ())), str(raw.get("slot", "")),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def set_wip(self, wip: WorkInProgress | None, *, manifest: bytes | None = None) -> None:
        def fn(txn: lmdb.Transaction) -> None:
            if wip is None:
                _end_work(txn)
                return
            txn.put(b"wip", json.dumps(asdict(wip)).encode())
            if manifest is not None:
                txn.put(b"wip_manifest", manifest)

        self._write(fn)

    def wip_manifest(self) -> ManifestInfo | None:
        return self._manifest("wip_manifest")

    def record_version(self, info: ManifestInfo, *, repo: str) -> None:
        """Record ``info`` as the version held and end the work in progress: one transaction."""
        from ..format.manifest import serialize

        state = {
            "version": info.version,
            "version_digest": info.pb.version_digest.hex(),
            "files": output_files(info),
            "repo": repo,
            "installed_unix": time.time(),
            "repository_id": info.pb.repository_id.hex(),
            "history_digest": info.pb.history_digest.hex(),
        }
        raw_manifest = serialize(info.pb)

        def fn(txn: lmdb.Transaction) -> None:
            txn.put(b"state", json.dumps(state).encode())
            txn.put(b"manifest", raw_manifest)
            _end_work(txn)

        self._write(fn)
        with contextlib.suppress(OSError):
            (self.root / STATE_DIR / _LEGACY_STATE).unlink()

    def record_engine(self, info: ManifestInfo, *, repo: str, engine: str) -> None:
        """Record ``info`` as the version an engine holds (an engine-first agent, agents/engine.py:
        no files and no copy of the manifest, whose kept objects hold it) and end the work in
        progress: one small transaction per version."""
        state = {
            "version": info.version, "version_digest": info.pb.version_digest.hex(), "files": [], "repo": repo,
            "installed_unix": time.time(), "engine": engine, "repository_id": info.pb.repository_id.hex(),
            "history_digest": info.pb.history_digest.hex(),
        }

        def fn(txn: lmdb.Transaction) -> None:
            txn.put(b"state", json.dumps(state).encode())
            stats = _txn_json(txn, b"stats")
            stats["engine"] = engine  # deltasync status: what this state is of
            txn.put(b"stats", json.dumps(stats).encode())
            _end_work(txn)

        self._write(fn)

    def slots(self) -> SlotsRecord | None:
        """The slots record; None for a copy in the layout of older deltasync (files in DIR)."""
        raw = self._json("slots")
        if raw is None:
            return None
        try:
            slots = {
                str(k): SlotInfo(None if v.get("version") is None else int(v["version"]),
                                 None if v.get("source") is None else int(v["source"]),
                                 {str(f): tuple(int(x) for x in st) for f, st in dict(v.get("files", {})).items()})
                for k, v in dict(raw.get("slots", {})).items()
            }
            active = raw.get("active")
            return SlotsRecord(None if active is None else str(active), slots, str(raw.get("boot_id", "")),
                               bool(raw.get("synced", True)))
        except (AttributeError, TypeError, ValueError):
            return None

    def slot_manifest(self) -> ManifestInfo | None:
        return self._manifest("slot_manifest")

    def set_slots(self, record: SlotsRecord, *, slot_manifest: bytes | None = None, wip: WorkInProgress | None = None) -> None:
        """Write the slots record (and the inactive slot's manifest, and a WIP record) in one transaction."""

        def fn(txn: lmdb.Transaction) -> None:
            txn.put(b"slots", _slots_json(record))
            if slot_manifest is not None:
                txn.put(b"slot_manifest", slot_manifest)
            if wip is not None:
                txn.put(b"wip", json.dumps(asdict(wip)).encode())

        self._write(fn)

    def record_switch(self, info: ManifestInfo, record: SlotsRecord, *, repo: str, slot_manifest: bytes | None) -> None:
        """Record ``info`` as the version held, the slots after a switch, and end the work in
        progress: one transaction."""
        from ..format.manifest import serialize

        state = {
            "version": info.version, "version_digest": info.pb.version_digest.hex(), "files": output_files(info),
            "repo": repo, "installed_unix": time.time(), "repository_id": info.pb.repository_id.hex(),
            "history_digest": info.pb.history_digest.hex(),
        }
        raw_manifest = serialize(info.pb)

        def fn(txn: lmdb.Transaction) -> None:
            txn.put(b"state", json.dumps(state).encode())
            txn.put(b"manifest", raw_manifest)
            txn.put(b"slots", _slots_json(record))
            if slot_manifest is not None:
                txn.put(b"slot_manifest", slot_manifest)
            else:
                txn.delete(b"slot_manifest")
            _end_work(txn)

        self._write(fn)
        with contextlib.suppress(OSError):
            (self.root / STATE_DIR / _LEGACY_STATE).unlink()

    # -- refs: the newest signed refs this copy accepted (repo/repository.py RefMemory) ---------

    def seen_ref(self, name: str) -> tuple[int, int | None] | None:
        """(counter, version) of the newest signed ``refs/<name>`` accepted for this copy:
        a ref older than that is a replay (kept here so it survives restarts)."""
        entry = (self._json("refs") or {}).get(name)
        if not isinstance(entry, list) or len(entry) != 2 or type(entry[0]) is not int:
            return None
        version = entry[1] if type(entry[1]) is int else None
        return entry[0], version

    def saw_ref(self, name: str, counter: int, version: int | None) -> None:
        """Record an accepted signed ref, if newer than the one recorded (one transaction)."""

        def fn(txn: lmdb.Transaction) -> None:
            current = _txn_json(txn, b"refs")
            held = current.get(name)
            if isinstance(held, list) and held and type(held[0]) is int and held[0] >= counter:
                return
            current[name] = [counter, version]
            txn.put(b"refs", json.dumps(current).encode())

        self._write(fn)

    def stats(self) -> dict[str, Any]:
        return self._json("stats") or {}

    def engine(self) -> EngineState | None:
        """The engine's record (None: no engine was ever updated here)."""
        raw = self._json("engine")
        if raw is None:
            return None
        try:
            return EngineState(**{k: raw[k] for k in EngineState.__dataclass_fields__ if k in raw})
        except TypeError:
            return None

    def set_engine(self, record: EngineState) -> None:
        self._write(lambda txn: txn.put(b"engine", json.dumps(asdict(record)).encode()))

    def update_stats(self, fields: dict[str, Any]) -> None:
        """Merge ``fields`` into the stats record."""

        def fn(txn: lmdb.Transaction) -> None:
            current = _txn_json(txn, b"stats")
            current.update(fields)
            txn.put(b"stats", json.dumps(current).encode())

        self._write(fn)


def _end_work(txn: lmdb.Transaction) -> None:
    """End the work in progress (its record and its target's manifest) in ``txn``: the commit
    that records a version held ends the update that brought it."""
    txn.delete(b"wip")
    txn.delete(b"wip_manifest")


def _txn_json(txn: lmdb.Transaction, key: bytes) -> dict[str, Any]:
    """The JSON object stored at ``key`` in a write transaction ({} when absent or unreadable)."""
    raw = txn.get(key)
    if raw is None:
        return {}
    try:
        loaded = json.loads(bytes(raw))
    except ValueError:
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _slots_json(record: SlotsRecord) -> bytes:
    return json.dumps({
        "active": record.active, "boot_id": record.boot_id, "synced": record.synced,
        "slots": {k: {"version": v.version, "source": v.source, "files": v.files} for k, v in record.slots.items()},
    }).encode()


def _legacy_state(root: Path) -> LocalState | None:
    try:
        raw = json.loads((root / STATE_DIR / _LEGACY_STATE).read_text())
        return LocalState(int(raw["version"]), str(raw["version_digest"]), tuple(raw["files"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# -- the library functions the publisher's cache and the subscriber use -------------------------


def state_dir(root: str | os.PathLike[str]) -> Path:
    """``root/.deltasync``, refusing a symbolic link there: the copy's state, slots and lock
    would be written wherever it points (another copy, a system directory). A real directory
    or nothing yet is fine."""
    path = Path(root) / STATE_DIR
    if path.is_symlink():
        raise CheckpointError(
            str(path), f"is a symbolic link (to {os.readlink(path)!r}); a copy's state directory must be a real "
            "directory, deltasync does not write through links: remove the link"
        )
    return path


def read_local_state(out: str | os.PathLike[str]) -> LocalState | None:
    """The version the copy at ``out`` holds, or None."""
    db = StateDB.open(out, create=False)
    return db.state() if db is not None else _legacy_state(Path(out))


def write_local_state(out: str | os.PathLike[str], info: ManifestInfo, *, repo: str = "") -> None:
    """Record that the copy at ``out`` holds ``info`` (idempotent; ends any work in progress)."""
    db = StateDB.open(out)
    assert db is not None
    held = db.state()
    if (
        held is not None and db.wip() is None and held.holds(info) and (held.repo == repo or not repo)
        and db.manifest() is not None
    ):
        return
    db.record_version(info, repo=repo or (held.repo if held is not None else ""))


# -- the lock -----------------------------------------------------------------------------------


class _Held:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.count = 0
        self.thread_lock = threading.RLock()


_locks: dict[str, _Held] = {}
_locks_guard = threading.Lock()


@contextlib.contextmanager
def copy_lock(root: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the copy at ``root`` for changing it: other processes get CopyInUseError at once;
    other threads of this process wait; the same thread may nest."""
    sdir = state_dir(root)
    try:
        sdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(str(sdir), f"cannot create ({e.strerror})") from None
    state_dir(root)  # a link put there between the check and the mkdir
    key = os.path.realpath(sdir)
    with _locks_guard:
        held = _locks.get(key)
        if held is None:
            fd = os.open(sdir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = ""
                with contextlib.suppress(OSError, ValueError):
                    holder = f" (pid {int(os.pread(fd, 32, 0).decode().strip())})"
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise CopyInUseError(str(root), holder) from None
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            held = _locks[key] = _Held(fd)
        held.count += 1
    try:
        with held.thread_lock:
            yield
    finally:
        with _locks_guard:
            held.count -= 1
            if held.count == 0:
                del _locks[key]
                os.close(held.fd)  # releases the flock


# -- install (an older deltasync's journal; the switch itself is slots.py) ---------------------


def apply_legacy_journal(root: Path, staging: Path, info: ManifestInfo, wip: WorkInProgress, db: StateDB, repo: str) -> None:
    """Finish an install journaled by older deltasync (files moved from ``incoming/`` into ``root``)."""
    _refuse_symlinks(root, [*wip.remove, *wip.install])
    # Drop the old version's extra files first, and the directories that leaves empty, so
    # that a path which is a directory in one version and a file in the other installs.
    for rel in wip.remove:
        with contextlib.suppress(OSError, DeltasyncError):
            check_relpath(rel)
            (root / rel).unlink()
            _prune_empty_dirs(root, (root / rel).parent)
    dirs: set[Path] = set()
    for rel in wip.install:
        src, dest = staging / check_relpath(rel), root / rel
        if not os.path.lexists(src):
            continue  # moved before the crash
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dest)
        dirs.add(dest.parent)
    for d in dirs:  # make the renames durable before the version is recorded
        fsync_dir(d)
    db.record_version(info, repo=repo)
    shutil.rmtree(staging, ignore_errors=True)


def _refuse_symlinks(out: Path, rels: list[str]) -> None:
    """Refuse to write or delete through a directory symlink inside ``out``: it could point
    anywhere. (A symlink in place of a file is replaced by the file, never followed.)"""
    seen: set[str] = set()
    for rel in rels:
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in seen:
                seen.add(d)
                if (out / d).is_symlink():
                    raise CheckpointError(str(out / d), "is a symbolic link; deltasync does not write through links")


def _prune_empty_dirs(out: Path, d: Path) -> None:
    """Remove ``d`` and its parents below ``out`` while they are empty."""
    while d != out and out in d.parents:
        try:
            d.rmdir()
        except OSError:  # not empty (or not ours to remove): stop here
            return
        d = d.parent


@dataclass
class ProgressRecorder:
    """Counts chunks of a pull and writes the count to the WIP record at most every
    ``interval`` seconds (for ``deltasync status``; never needed for correctness)."""

    db: StateDB
    wip: WorkInProgress
    interval: float = 0.25
    done: int = 0
    _last: float = field(default=0.0)

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self.flush()

    def flush(self) -> None:
        with contextlib.suppress(lmdb.Error):
            self.db.set_wip(WorkInProgress(
                self.wip.target, self.wip.phase, self.wip.started_unix, self.done, self.wip.chunks_total
            ))


__all__ = [
    "INCOMING",
    "LIBRARY_FILE",
    "STATE_DIR",
    "CopyInUseError",
    "LocalState",
    "ProgressRecorder",
    "PullStopped",
    "SlotInfo",
    "SlotsRecord",
    "StateDB",
    "WorkInProgress",
    "copy_lock",
    "output_files",
    "read_local_state",
    "state_dir",
    "write_local_state",
]

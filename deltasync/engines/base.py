"""The engine interface: what verified versions are swapped into.

An engine serves one version at a time. Updating it has two phases:

* **stage** — fetch, decode and verify everything the target version needs, and work out
  what to write, while the old version keeps serving;
* **swap** — pause, write, resume. Requests in flight finish on the old version (or wait);
  none ever sees a mix of two versions.

The public methods here own validation, ordering, timing and the swap record; an
implementation overrides the private hooks ``_stage``, ``_write`` and ``_served_version``,
and ``_pause`` / ``_resume`` where pausing means more than holding the serving lock
(zarr's ``abc/codec.py`` does the same split: ``encode`` validates, ``_encode_single`` works).
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar

from ..errors import (
    EngineError as EngineError,  # defined there; importable here too
    StaleUpdateError as StaleUpdateError,
    UsageError,
)


@dataclass(frozen=True)
class LiveCheck:
    """What an engine's live weights hold against a version's chunk digests (``Engine.verify``)."""

    version: int
    chunks_checked: int
    drifted: list[tuple[str, int]]
    """(tensor name, chunk index) of each chunk whose bits are not the version's."""

    @property
    def ok(self) -> bool:
        return not self.drifted


@dataclass(frozen=True)
class SwapRecord:
    """One swap, as the engine measured it."""

    version: int
    """The version served after the swap."""
    previous: int | None
    """The version served before it (None: unknown, e.g. a freshly built module)."""
    pause_s: float
    """Seconds nothing was served because of the write: from holding the engine exclusively to resuming."""
    drain_s: float
    """Seconds before the pause spent letting requests in flight finish (new ones already waited)."""
    stage_s: float
    """Seconds spent staging: fetch, decode, verify, diff and (on GPU) upload, all before the pause."""
    bytes_written: int
    """Bytes written into the engine during the pause."""
    elements_changed: int
    """Elements (codec words) whose bits changed."""
    chunks_changed: int
    chunks_total: int
    fetched_bytes: int
    """Stored bytes the plan read from the repository."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Engine-specific figures, e.g. ``bytes_broadcast`` for the fan-out."""

    @property
    def blocked_s(self) -> float:
        """Longest time a new request could have waited: drain plus pause."""
        return self.drain_s + self.pause_s


@dataclass
class Staged:
    """An update made by :meth:`Engine.stage`; it applies only to the version served when staged.

    Implementations subclass it to carry what they write.
    """

    version: int
    base: int | None = None
    stage_s: float = 0.0
    elements_changed: int = 0
    chunks_changed: int = 0
    chunks_total: int = 0
    fetched_bytes: int = 0
    bytes_to_write: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    version_key: bytes = b""
    """The version's digest and its repository's identity (:meth:`Engine.version_key`; empty: unknown)."""
    _owner: int = 0
    _generation: int = -1


class ServingLock:
    """Reader-writer lock that prefers the writer.

    Requests hold it shared for their whole forward pass; a swap holds it exclusively only
    for the write. Once a swap waits, new requests wait too, so a stream of requests
    cannot starve it. Shared holds are re-entrant per thread (a forward that calls another
    guarded forward does not deadlock against a waiting swap).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._local = threading.local()

    @contextmanager
    def shared(self) -> Iterator[None]:
        depth: int = getattr(self._local, "depth", 0)
        if depth == 0:
            with self._cond:
                while self._writer or self._writers_waiting:
                    self._cond.wait()
                self._readers += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._readers -= 1
                    if self._readers == 0:
                        self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        if getattr(self._local, "depth", 0):
            raise UsageError("a swap cannot run inside engine.serving() on the same thread")
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True

    def release_exclusive(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()


class Engine(abc.ABC):
    """Something that serves one version of a model and can be brought to another.

    >>> record = engine.update(7)           # stage, then swap; None if 7 is already served
    >>> with engine.serving():              # around every inference call
    ...     logits = model(tokens)

    Or in two steps, to stage while the old version serves and swap at a moment of your
    choosing: ``staged = engine.stage(7)`` then ``engine.swap(staged)``. A rollback or a
    pinned version is staged and swapped exactly like a newer one.
    """

    kind: ClassVar[str] = "engine"
    needs_files: bool = False
    """Whether the engine loads versions from files (a directory copy an agent keeps) rather than
    staging them from the fetched, decoded changes; an engine-first agent refuses such engines.
    A class default an instance may set (a vLLM engine given no copy pulls from the repository)."""

    def __init__(self, *, version: int | None = None) -> None:
        self.swaps: list[SwapRecord] = []
        """Every completed swap, oldest first."""
        self._version = version
        self._version_key: bytes | None = None  # what it holds: digest and repository (None: unknown)
        self._generation = 0
        self._lock = ServingLock()
        self._mutex = threading.RLock()  # one stage/swap at a time
        self._closed = False

    # -- what is served --------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The version this engine last swapped in (None: unknown)."""
        return self._version

    def version_key(self, version: int) -> bytes | None:
        """What makes ``version`` the version it is in the repository this engine stages from:
        its version digest and its repository's identity (None when the engine cannot tell, e.g.
        it stages from no repository in this process). An engine holds version N only when it
        holds this, never by the number alone (another repository, or one deleted and created
        again at the same URL, has another version N)."""
        sub = getattr(self, "subscriber", None)
        repo = getattr(sub, "repo", None)
        manifest = getattr(repo, "manifest", None)
        if manifest is None:
            return None
        info = manifest(version)
        key: bytes = info.pb.version_digest + info.pb.repository_id
        return key

    def holds(self, version: int) -> bool:
        """Whether the engine holds ``version`` of the repository it stages from (see :meth:`version_key`)."""
        if version != self._version:
            return False
        if self._version_key is None:
            return True  # told its version (``version=``) or swapped before keys: the number is all there is
        return self.version_key(version) in (None, self._version_key)

    def served_version(self) -> int | None:
        """The version the engine reports it serves (an inference server is asked)."""
        self._check_open()
        return self._served_version()

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Hold around an inference call: a swap waits for it, and it waits for a swap."""
        with self._lock.shared():
            yield

    # -- updating -------------------------------------------------------------------------------

    def stage(self, version: int | None = None) -> Staged:
        """Fetch, decode and verify ``version`` (default: the latest) against what is served now."""
        self._check_open()
        if version is not None and (not isinstance(version, int) or version < 1):
            raise UsageError(f"version must be a positive integer, got {version!r}")
        with self._mutex:
            start = time.perf_counter()
            target = self._resolve(version)
            staged = self._stage(target)
            staged.version_key = self.version_key(target) or b""
            staged.stage_s = time.perf_counter() - start
            staged.base = self._version
            staged._owner = id(self)
            staged._generation = self._generation
            return staged

    def swap(self, staged: Staged) -> SwapRecord:
        """Pause, write ``staged``, resume; returns (and appends to ``swaps``) the record."""
        self._check_open()
        if staged._owner != id(self):
            raise UsageError("this update was staged by another engine")
        with self._mutex:
            if staged._generation != self._generation:
                raise StaleUpdateError(
                    f"update to version {staged.version} was staged against version {staged.base}, "
                    f"but the engine has swapped since (now {self._version}); stage it again",
                    version=staged.version, serving=self._version,
                )
            previous = self._version
            t0 = time.perf_counter()
            self._pause()
            t1 = time.perf_counter()
            written = 0
            try:
                written = self._write(staged)
                # From here the engine holds the new bits, whatever resuming reports.
                self._version = staged.version
                self._version_key = staged.version_key or None
                self._generation += 1
            finally:
                self._resume()
            t2 = time.perf_counter()
            self._after_swap(staged)
            record = SwapRecord(
                version=staged.version, previous=previous, pause_s=t2 - t1, drain_s=t1 - t0,
                stage_s=staged.stage_s, bytes_written=written, elements_changed=staged.elements_changed,
                chunks_changed=staged.chunks_changed, chunks_total=staged.chunks_total,
                fetched_bytes=staged.fetched_bytes, extra=dict(staged.extra),
            )
            self.swaps.append(record)
            return record

    def update(self, version: int | None = None, *, force: bool = False) -> SwapRecord | None:
        """Stage and swap ``version`` (default: latest). None when it is already served, unless ``force``."""
        self._check_open()
        if version is not None and (not isinstance(version, int) or version < 1):
            raise UsageError(f"version must be a positive integer, got {version!r}")
        with self._mutex:
            target = self._resolve(version)
            if not force and self.holds(target):
                return None
            return self.swap(self.stage(target))

    def close(self) -> None:
        """Release what the engine holds; it cannot be used afterwards."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- hooks -------------------------------------------------------------------------------------

    @abc.abstractmethod
    def _resolve(self, version: int | None) -> int:
        """``version``, or the latest one when None."""

    @abc.abstractmethod
    def _stage(self, version: int) -> Staged:
        """Everything but the write; must not change what is served."""

    @abc.abstractmethod
    def _write(self, staged: Staged) -> int:
        """Write ``staged`` while paused; returns bytes written. On failure, restore the old
        version before raising (a request must never see a mix)."""

    def _served_version(self) -> int | None:
        return self._version

    def _pause(self) -> None:
        self._lock.acquire_exclusive()

    def _resume(self) -> None:
        self._lock.release_exclusive()

    def _after_swap(self, staged: Staged) -> None:
        """Checks after resuming (an inference server's reported version, say)."""
        return None

    def _close(self) -> None:
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"{self.kind} engine is closed")

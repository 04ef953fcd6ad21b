"""The agent: a long-running subscriber that keeps a directory at the version to serve.

``Agent(repo, out).run()`` brings ``out`` to the target and returns; ``run(follow=True)``
keeps doing so for every new target until :meth:`Agent.stop`. The target is the version the
publisher pinned (``deltasync pin``), else the latest. The agent notices a new one within
``poll_interval`` (it reads ``refs/latest`` and ``refs/pin``, two tiny objects; a relay's
push stream, when the store has one, wakes it sooner) and sleeps in between: no busy loop.

How it moves (each version verified chunk by chunk into the slot not served, then served by
one atomic switch, journaled in the copy's LMDB state, resumable after a kill at any point —
see local/slotfill.py, local/slots.py and local/state.py):

* forwards: a pull (the planner picks the delta chain or snapshot plus chain); the payloads
  of the deltas applied are kept in the copy (``keep_versions``, local/cache.py);
* backwards (a pin to an earlier version, ``rollback``): the deltas in between are reversed
  from the local bits, reading the kept payloads (nothing downloaded) or, when not kept,
  the repository's small delta payloads; chunks that cannot be reversed come from the
  snapshot chain (local/slotfill.py);
* forwards again to versions whose payloads it kept: walked locally, nothing downloaded.

With trusted keys the refs must be signed by the publisher (repo/repository.py): an
unsigned, altered, expired (beyond ``ref_grace``) or replayed ref, or one naming a missing
manifest, is a RefError; the copy stays on its version, the error is recorded, and a
following agent keeps trying. The newest ref counters accepted are kept in the copy's state,
so a restart does not forget them.

Upstream errors are retried with jittered exponential backoff, capped: a one-shot run gives
up after ``retries`` attempts, a following agent keeps trying (each failure is recorded).
:meth:`stop` (SIGTERM/SIGINT in the command line) ends the run after the current chunk,
leaving the work done so far for the next run. Figures (versions, lag, bytes fetched, apply
time, last error) live in the copy's LMDB state, read by ``deltasync status`` while the
agent runs, and are served as Prometheus metrics with ``metrics_port``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    DeltasyncError,
    EmptyRepositoryError,
    ObjectNotFoundError,
    RefError,
    RepositoryIdentityError,
    SignatureError,
    UsageError,
)
from ..format.signing import PublicKeyLike
from ..local.cache import CachedStore, LocalCache
from ..local.slotfill import update_copy
from ..local.slots import finish_install
from ..local.state import STATE_DIR, EngineState, PullStopped, StateDB, copy_lock
from ..metrics import Metric, MetricsServer
from ..pull.subscriber import Subscriber, state_url
from ..repo.repository import LATEST, MARKER, MAX_REF_BYTES, Repository, ref_hint
from ..retry import Backoff
from ..storage import Store, open_store
from .config import FINAL, AgentConfig, Update
from .status import read_status

if TYPE_CHECKING:
    from ..engines.base import Engine, SwapRecord

log = logging.getLogger("deltasync.agents")

#: Seconds between writes of the figures when only the byte counters moved (an idle agent's polls).
COUNTERS_FLUSH_S = 30.0
_COUNTERS = frozenset({"bytes_fetched_total", "fetched_by_kind"})


@dataclass
class _Figures:
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


class Agent:
    """Keeps the directory ``out`` at the version to serve from ``repo`` (see the module doc)."""

    def __init__(
        self,
        repo: str | Store,
        out: str | os.PathLike[str],
        config: AgentConfig | None = None,
        *,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
        on_update: Callable[[Update], None] | None = None,
        on_ready: Callable[[Agent], None] | None = None,
        engine: Engine | None = None,
    ) -> None:
        """``on_update`` is called after each update; ``on_ready`` once :meth:`run` holds the
        copy (and serves metrics, on :attr:`metrics_port`). ``engine``: also keep this engine
        at the copy's version; one that stages from the fetched changes (torch, fan-out) is
        swapped before the copy is rewritten, one that loads files (``needs_files``) after.
        Without a copy, see :class:`deltasync.agents.engine.EngineAgent`."""
        self.config = config or AgentConfig()
        self.engine = engine
        self.last_swap: SwapRecord | None = None
        """The engine's record of the last update's swap (None: none, or already served)."""
        self.on_ready = on_ready
        self.metrics_port: int | None = None
        self.root = Path(out)
        self.trusted_keys = trusted_keys
        self.on_update = on_update
        inner = open_store(repo) if isinstance(repo, str) else repo
        self.cache = LocalCache(self.root / STATE_DIR / "objects") if self.config.keep_versions else None
        self.store = CachedStore(inner, self.cache)
        self.figures = _Figures(repo=state_url(inner.url))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._db: StateDB | None = None
        self._last_flush = 0.0
        self._flushed: dict[str, Any] | None = None  # the figures as last written
        self._last_write = -float("inf")
        self._last_listing = -float("inf")
        self._fetched_at_start = 0
        self._base_total = 0
        self._base_by_kind: dict[str, int] = {}
        self._fetched_by_kind_at_start: dict[str, int] = {}
        self._watched_latest: int | None = None
        self._identity: tuple[bytes | None] | None = None  # the repository's identity as last read
        self._identity_read_at = -float("inf")
        self._holds: tuple[Any, ...] | None = None  # (state, identity) found to hold their version: polls skip the manifest
        if engine is not None:
            self._bind(engine)

    def _bind(self, engine: Engine) -> None:
        """Make an engine that stages in this process read through the agent's store: what it
        fetches is counted, and kept for the copy (or restarts) when the agent keeps it."""
        sub = getattr(engine, "subscriber", None)
        if not isinstance(sub, Subscriber):
            return
        if state_url(sub.repo.url) != state_url(self.store.inner.url):
            raise UsageError(f"the engine stages from {sub.repo.url}, but the agent follows {self.store.inner.url}")
        engine.subscriber = Subscriber(  # type: ignore[attr-defined]
            Repository(self.store, trusted_keys=engine_keys(sub)), workers=sub.workers, progress=sub.progress,
        )

    # -- control -------------------------------------------------------------------------------

    def stop(self) -> None:
        """End :meth:`run` after the current chunk (thread- and signal-safe)."""
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self, *, follow: bool = False) -> int | None:
        """Bring the copy to the target and return its version; with ``follow``, keep doing
        so until :meth:`stop`. Returns the version held at the end (None: none yet)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with copy_lock(self.root):
            finish_install(self.root)
            self._open(follow)
            server = self._start_metrics()
            watcher = self._start_watch() if follow else None
            if self.on_ready is not None:
                self.on_ready(self)
            backoff = Backoff(self.config.backoff_initial, self.config.backoff_max)
            attempts = 0
            try:
                while not self._stop.is_set():
                    try:
                        target = self._observe()
                        if target is None:  # nothing committed yet: a follower waits for it
                            self._repository().ensure_exists()
                            if not follow:
                                raise EmptyRepositoryError(self.store.url)
                        elif self._needs_update(target):
                            self._update(target)
                        attempts = 0
                        backoff.reset()
                        self._set(state="idle", refused_ref=None)
                        if not follow:
                            break
                        self._wake.wait(self.config.poll_interval)
                        self._wake.clear()
                    except PullStopped:
                        break
                    except (DeltasyncError, OSError) as e:
                        attempts += 1
                        self._failed(e)
                        if not follow and (attempts >= self.config.retries or isinstance(e, FINAL)):
                            raise
                        self._set(state="backoff")
                        self._stop.wait(backoff.next())
            finally:
                if watcher is not None:
                    watcher()
                if server is not None:
                    server.close()
                self._set(state="stopped", running=False)
                self._flush(force=True)
        return self.current()

    def rollback(self, version: int) -> Update | None:
        """Move the copy to the earlier (or any other) ``version`` now: reversing the deltas
        in between where they allow it (no download when their payloads were kept), else
        from the snapshot chain. Returns the update, or None when already there."""
        self.root.mkdir(parents=True, exist_ok=True)
        with copy_lock(self.root):
            finish_install(self.root)
            self._open(follow=False)
            try:
                if not self._needs_update(version):
                    return None
                return self._update(version)
            except (DeltasyncError, OSError) as e:
                self._failed(e)
                raise
            finally:
                self._set(state="stopped", running=False)
                self._flush(force=True)

    def current(self) -> int | None:
        db = StateDB.open(self.root, create=False)
        state = db.state() if db is not None else None
        return state.version if state is not None else None

    # -- watching ------------------------------------------------------------------------------

    def _repository(self) -> Repository:
        # A fresh Repository per use: its manifest cache would otherwise grow with every
        # version a long-running agent sees (the copy's object cache keeps the recent ones).
        # The newest signed refs accepted live in the copy's state: a replayed (older) ref is
        # refused across restarts too.
        repo = Repository(self.store, trusted_keys=self.trusted_keys, ref_grace=self.config.ref_grace,
                          ref_memory=self._state_db())
        # The identity as last read (every look reads it again, _check_identity), else the one
        # the kept objects are of: a rollback among them reads nothing from the repository.
        known = self._identity if self._identity is not None else self.cache.bound() if self.cache is not None else None
        if known is not None:
            repo.assume_identity(known[0])
        return repo

    def _observe(self) -> int | None:
        """Read the pin and the latest version; returns the target (None: nothing to serve yet)."""
        repo = self._repository()
        if time.monotonic() - self._identity_read_at >= self.config.relist_interval:
            self._check_identity(repo)
        pinned = repo.pinned()
        latest = self._latest(repo)
        now = time.time()
        current = self.current()
        with self._lock:
            f = self.figures
            if latest != f.latest_version:
                f.latest_seen_unix = now
            f.latest_version, f.pinned_version = latest, pinned
            target = f.target_version = pinned if pinned is not None else latest
            if target is None or (current is not None and current == target):
                f.stale_since_unix = None
            elif f.stale_since_unix is None:
                f.stale_since_unix = _stale_since(repo, current, target, now)
        self._flush()
        return target

    def _check_identity(self, repo: Repository) -> None:
        """Read the repository's identity (repo/repository.py, Identity): at the first look and
        with every listing (``relist_interval``; signed refs name it, so with trusted keys a
        ref of another one is refused at once, see Repository.read_ref). With
        trusted keys it must be the one the copy recorded from this URL (RepositoryIdentityError:
        another repository's objects copied over it, or one deleted and created again). Without,
        another one there is followed as the repository now at that URL: objects kept of the
        old one are dropped, an engine reads it afresh, and the copy is rebuilt, since it does
        not hold the new one's version digests."""
        found = Repository(self.store).identity()  # read now, whatever the kept objects are of
        self._identity_read_at = time.monotonic()
        if found is None and not self.store.exists(MARKER):
            # No repository there (a path not mounted yet, a bucket being restored): nothing to
            # compare or rebind by. The kept objects stay: an engine-first agent restores from them.
            return
        if self._identity is not None and self._identity[0] == found:
            return
        state = self._state_db().state()
        recorded = state.repository_id if state is not None and state_url(state.repo) == self.figures.repo else ""
        shown = found.hex() if found is not None else ""
        if state is not None and recorded and shown != recorded and repo.trusted_keys is not None:
            raise RepositoryIdentityError(
                self.store.url, f"has identity {shown or '(none)'}, but {self.root} holds version {state.version} of "
                f"repository {recorded} from it: another repository's objects copied over it, or it was deleted and "
                "created again; refused (follow it into a new directory)")
        if self.cache is not None and self.cache.bind(found) and self._identity is not None:
            log.warning("%s is another repository now (identity %s): objects kept of the old one dropped",
                        self.store.url, shown or "(none)")
        if self._identity is not None and self.engine is not None:
            self._bind(self.engine)  # its repository object cached the old one's manifests
        self._identity = (found,)

    def _latest(self, repo: Repository) -> int | None:
        now = time.monotonic()
        known = self.figures.latest_version
        if known is None or now - self._last_listing >= self.config.relist_interval:
            self._last_listing = now
            try:
                return repo.latest()
            except EmptyRepositoryError:
                return None
        hint = known
        if repo.trusted_keys is not None:
            # Signed, unexpired, no older than seen, naming its manifest (RefError: recorded,
            # and the copy stays where it is).
            hint = repo.latest_ref() or known
        else:
            with contextlib.suppress(ObjectNotFoundError):
                hint = ref_hint(self.store.get(LATEST, max_bytes=MAX_REF_BYTES)) or known
        if self._watched_latest is not None:
            hint = max(hint, self._watched_latest)
        if hint > known:
            repo.manifest(hint)  # committed (the ref is written after the manifest)
            return hint
        return known

    def _start_watch(self) -> Callable[[], None] | None:
        """Follow the store's push stream (a relay's Watch), if it has one: each version
        announced wakes the loop at once. Returns a function that ends it."""
        watch = getattr(self.store.inner, "watch", None)
        if watch is None:
            return None
        current: list[Any] = []

        def loop() -> None:
            backoff = Backoff(self.config.backoff_initial, self.config.backoff_max)
            while not self._stop.is_set():
                try:
                    stream = watch(self._watched_latest or self.figures.latest_version or 0)
                    current[:] = [stream]
                    for version in stream:
                        backoff.reset()
                        self._watched_latest = max(version, self._watched_latest or 0)
                        self._wake.set()
                except DeltasyncError as e:  # polling goes on meanwhile
                    log.info("watch stream ended (%s); polling until it is back", e)
                self._stop.wait(backoff.next())

        thread = threading.Thread(target=loop, name="deltasync-watch", daemon=True)
        thread.start()

        def end() -> None:
            for stream in current:
                with contextlib.suppress(Exception):
                    stream.close()
            thread.join(2)

        return end

    # -- updating ------------------------------------------------------------------------------

    def _needs_update(self, target: int) -> bool:
        db = self._state_db()
        state, wip = db.state(), db.wip()
        if state is None or state.version != target:
            return True
        if self._holds != (state, self._identity):
            # Held only with the target's version digest and repository, never by the number
            # (checked once per state and identity: versions do not change under one identity).
            if not state.holds(self._repository().manifest(target)):
                return True
            self._holds = (state, self._identity)
        if wip is not None:  # an interrupted move to another version (its slot stays marked dirty)
            db.set_wip(None)
        if self.engine is None:
            return False
        if self.engine.holds(target):
            self._engine_phase("serving")  # this process's engine, at the copy's version
            return False
        return True

    def _engine_phase(self, phase: str) -> None:
        if self.figures.engine_phase != phase:
            self._set(engine_phase=phase)
            self._flush(force=True)

    def _update(self, target: int) -> Update:
        repo = self._repository()
        sub = Subscriber(repo, workers=self.config.workers, progress=self.config.progress)
        previous = self.current()
        start, fetched = time.monotonic(), self.store.fetched_bytes
        self._set(state="updating", target_version=target)
        self.last_swap = None
        try:
            how = self._move(sub, repo, previous, target)
        except (CorruptObjectError, ChecksumMismatchError):
            if self.cache is not None:
                self.cache.forget_packs()  # a damaged kept payload must not fail the retry
            raise
        finally:
            self.store.capture = set()
        update = Update(target, previous, how, self.store.fetched_bytes - fetched, time.monotonic() - start,
                        self.last_swap)
        with self._lock:
            f = self.figures
            f.updates_total += 1
            f.highest_version = max(f.highest_version, target)
            f.last_update = {
                "version": target, "previous": previous, "how": how, "fetched_bytes": update.fetched_bytes,
                "seconds": round(update.seconds, 6), "finished_unix": time.time(),
            }
            if f.latest_version is None or target >= f.latest_version:
                f.stale_since_unix = None
        self._retain(target)
        self._flush(force=True)
        if self.on_update is not None:
            self.on_update(update)
        return update

    def _move(self, sub: Subscriber, repo: Repository, previous: int | None, target: int) -> str:
        # Forwards or back, the slot not served is brought to the target in place (slotfill.py);
        # payloads of the deltas it walks come from the kept objects when they are there.
        self.store.capture = self._capture(repo, previous, target)
        engine = self.engine
        if (engine is not None and not engine.needs_files and previous is not None and previous < target
                and engine.holds(previous)):
            # The engine, at the copy's version, takes the change straight from the fetch: its
            # swap does not wait for the copy's rewrite (at RL densities about a copy of the
            # model, DESIGN.md 6); what its plan reads is kept while it stages (the deltas since
            # the copy's version, or a snapshot chain), and the copy's fill reads it there.
            # Otherwise (a first load, an engine that knows no version, a pin moving back, where
            # the copy reverses deltas the engine's plan would not read) the copy goes first and
            # the engine reads the chunks that changed from it: one fetch either way.
            kept = self.store.capture
            self.store.capture = kept | self._plan_packs(repo, previous, target)
            try:
                self.last_swap = self._swap_engine(target)
            finally:
                self.store.capture = kept
        result = update_copy(sub, self.root, repo.manifest(target), stop=self._should_stop,
                             move_aside=self.config.move_aside, fsync=self.config.fsync, repo_url=state_url(repo.url))
        if engine is not None and not engine.holds(target):
            # An engine that loads files, or one catching up with a copy already there (read from it).
            self.last_swap = self._swap_engine(target)
        return str(result)

    def _engine_update(self, engine: Engine, target: int, force: bool) -> SwapRecord | None:
        """How the engine takes ``target``. One that knows no version (a first load, a restart, a
        node joining) is loaded in place where it can (``TorchEngine.load``: memory O(chunks in
        flight), not a staged copy of the model and of its old bits; it serves nothing known yet)."""
        load = getattr(engine, "load", None)
        if engine.version is None and callable(load):
            record: SwapRecord = load(target)
            return record
        return engine.update(target, force=force)

    def _swap_engine(self, target: int, *, force: bool = False) -> SwapRecord | None:
        """``engine.update(target)``, its outcome recorded in the state (:class:`EngineState`,
        shown by ``deltasync status``): the version the engine holds after it, or why it did
        not take the target, which is then raised. A version that did not reach the engine is
        a failed update, retried like any other (the engine serves what it held: its update
        restores it on failure); a run without ``follow`` fails once its retries are spent."""
        engine = self.engine
        assert engine is not None
        db = self._state_db()
        held = db.engine() or EngineState(engine.kind)
        try:
            swap = self._engine_update(engine, target, force)
        except (DeltasyncError, OSError) as e:
            message = str(e) if isinstance(e, DeltasyncError) else f"{type(e).__name__}: {e}"
            same = held.version == engine.version
            db.set_engine(replace(held, kind=engine.kind, version=engine.version,
                                  version_digest=held.version_digest if same else "",
                                  repository_id=held.repository_id if same else "", last_error=message,
                                  last_error_unix=time.time(), last_error_version=target))
            raise
        info = self._repository().manifest(target)
        db.set_engine(replace(held, kind=engine.kind, version=target, version_digest=info.pb.version_digest.hex(),
                              repository_id=info.pb.repository_id.hex(), updated_unix=time.time()))
        if type(self) is Agent:  # an engine-first agent says so once it has recorded the version (_move)
            self._engine_phase("serving")
        return swap

    def _capture(self, repo: Repository, previous: int | None, target: int) -> set[str]:
        """Packs worth keeping from this pull: those of the deltas between the version held
        and the target, within the versions the copy keeps."""
        keep = self.config.keep_versions
        if self.cache is None or previous is None or target <= previous:
            return set()
        try:
            chain = repo.chain(target, stop_at=previous)
        except DeltasyncError:
            return set()
        return {p.key for info in chain if not info.is_snapshot and info.version > target - keep for p in info.pb.packs}

    def _plan_packs(self, repo: Repository, previous: int, target: int) -> set[str]:
        """Every pack a move from ``previous`` to ``target`` may read: the target's chain from
        its snapshot and the deltas between the two (kept only for the move: ``_retain`` then
        prunes what no kept version needs)."""
        if self.cache is None:
            return set()
        keys: set[str] = set()
        with contextlib.suppress(DeltasyncError):
            keys.update(p.key for info in repo.chain(target) for p in info.pb.packs)
            low, high = min(previous, target), max(previous, target)
            keys.update(p.key for info in repo.chain(high, stop_at=low) for p in info.pb.packs)
        return keys

    def _retain(self, current: int) -> None:
        if self.cache is None:
            return
        newest = max(self.figures.highest_version, current)
        keep = {v for v in self.cache.versions() if v > newest - self.config.keep_versions} | {current}
        self.cache.prune(keep)

    def _should_stop(self) -> bool:
        self._flush()  # between chunks: keep the figures current for `deltasync status`
        return self._stop.is_set()

    # -- figures -------------------------------------------------------------------------------

    def _state_db(self) -> StateDB:
        if self._db is None:
            self._db = StateDB.open(self.root)
        assert self._db is not None
        return self._db

    def _open(self, follow: bool) -> None:
        stats = self._state_db().stats()
        with self._lock:
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
            if self.engine is not None and f.engine_phase is None:
                f.engine_phase = "loading"
        self._fetched_at_start = self.store.fetched_bytes
        self._fetched_by_kind_at_start = self.store.fetched_by_kind()
        self._base_total = self.figures.bytes_fetched_total
        self._flush(force=True)

    def _set(self, **fields: Any) -> None:
        with self._lock:
            for k, v in fields.items():
                setattr(self.figures, k, v)
        self._flush(force="state" in fields)

    def _failed(self, e: BaseException) -> None:
        message = str(e) if isinstance(e, DeltasyncError) else f"{type(e).__name__}: {e}"
        log.warning("update failed: %s", message)
        refused = self._refused(e)
        with self._lock:
            self.figures.errors_total += 1
            self.figures.last_error, self.figures.last_error_unix = message, time.time()
            if refused is not None:
                self.figures.refused_ref = refused
        self._flush(force=True)

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

    def _flush(self, *, force: bool = False) -> None:
        """Write the figures to the copy's state (at most every half second unless ``force``;
        only when they changed)."""
        now = time.monotonic()
        if not force and now - self._last_flush < 0.5:
            return
        self._last_flush = now
        with self._lock:
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
            self._state_db().update_stats(record)
            self._flushed, self._last_write = record, now

    def metrics(self) -> list[Metric]:
        """The figures as Prometheus metrics (what ``/metrics`` serves)."""
        self._flush()
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

    def _start_metrics(self) -> MetricsServer | None:
        if self.config.metrics_port is None:
            return None
        server = MetricsServer(self.metrics, port=self.config.metrics_port, host=self.config.metrics_host)
        self.metrics_port = server.port
        return server


def engine_keys(sub: Subscriber) -> list[PublicKeyLike] | None:
    """The keys a subscriber's repository trusts, as keys a new Repository takes."""
    keys = sub.repo.trusted_keys
    return None if keys is None else list(keys.keys.values())


def _stale_since(repo: Repository, current: int | None, target: int, now: float) -> float:
    """When the copy fell behind its target: the commit time of the first version after it."""
    for v in ([current + 1] if current is not None and current + 1 < target else []) + [target]:
        with contextlib.suppress(DeltasyncError):
            return min(now, repo.manifest(v).pb.created_unix or now)
    return now


def rollback(
    out: str | os.PathLike[str],
    version: int,
    *,
    repo: str | Store | None = None,
    config: AgentConfig | None = None,
    trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
) -> Update | None:
    """Move the copy at ``out`` to ``version`` (see :meth:`Agent.rollback`); ``repo``
    defaults to the repository it was pulled from."""
    if repo is None:
        db = StateDB.open(out, create=False)
        state = db.state() if db is not None else None
        if state is None or not state.repo:
            raise UsageError(f"{out} records no repository; pass one")
        repo = state.repo
    return Agent(repo, out, config, trusted_keys=trusted_keys).rollback(version)


__all__ = ["Agent", "engine_keys", "rollback"]

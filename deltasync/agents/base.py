"""What every agent does, whatever holds its weights: the run loop (observe a source of targets,
move when due, retries with backoff, stop), the bookkeeping of each move (its :class:`Update`,
the figures, the kept objects pruned), and an engine's swaps recorded in the state.

A way of holding weights is a subclass (:class:`~.directory.Agent`: a directory copy;
:class:`~.engine.EngineAgent`: an engine alone) saying what it holds (:meth:`BaseAgent.current`),
whether a target needs a move (``_needs_update``), how it moves (``_move``) and what of the
kept objects it still needs (``_retain``). The source of targets is :attr:`BaseAgent.source`:
the repository watched (:class:`~.watch.RepositoryWatch`, always at :attr:`BaseAgent.watch`,
which reads manifests for every agent) unless a subclass gives another (packcast rounds).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DeltasyncError, EmptyRepositoryError, UsageError
from ..format.signing import PublicKeyLike
from ..local.cache import CachedStore, LocalCache
from ..local.kept import KeptObjects
from ..local.slots import finish_install
from ..local.state import STATE_DIR, EngineState, PullStopped, StateDB, copy_lock
from ..metrics import Metric
from ..pull.subscriber import Subscriber, state_url
from ..repo.repository import Repository
from ..retry import Backoff
from ..storage import Store, open_store
from .config import FINAL, AgentConfig, Update
from .figures import FigureBook, Figures
from .watch import RepositoryWatch, Targets

if TYPE_CHECKING:
    from ..engines.base import Engine, SwapRecord


class BaseAgent:
    """An agent whose state is at ``root``, following ``repo`` (see the module doc).

    ``keep``: keep objects read under ``root/.deltasync/objects`` (:class:`KeptObjects`).
    ``engine``: the engine kept at the held version, rebound to read through :attr:`store`.
    """

    def __init__(self, repo: str | Store, root: str | os.PathLike[str], config: AgentConfig | None, *,
                 trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None, engine: Engine | None,
                 keep: bool) -> None:
        self.config = config or AgentConfig()
        self.engine = engine
        self.root = Path(root)
        self.trusted_keys = trusted_keys
        self.on_update: Callable[[Update], None] | None = None
        """Called with each update, once it is done."""
        self.on_ready: Callable[[Any], None] | None = None
        """Called with the agent once :meth:`run` holds the state (and serves metrics, on
        :attr:`metrics_port`); typed by each way of holding, which passes itself."""
        self.last_swap: SwapRecord | None = None
        """The engine's record of the last update's swap (None: none, or already served)."""
        self.metrics_port: int | None = None
        inner = open_store(repo) if isinstance(repo, str) else repo
        self.store = CachedStore(inner)
        self.kept = KeptObjects(LocalCache(self.root / STATE_DIR / "objects"), self.store) if keep else None
        self._db: StateDB | None = None
        self.book = FigureBook(self.root, self.store, self.state_db, repo=state_url(inner.url))
        self.watch = RepositoryWatch(self)
        self.source: Targets = self.watch
        self._stop = threading.Event()
        self._wake = threading.Event()
        if engine is not None:
            self.bind_engine()

    @property
    def figures(self) -> Figures:
        """What the agent knows now (mirrored into its state)."""
        return self.book.figures

    def bind_engine(self) -> None:
        """Make the engine, when it stages in this process, read through the agent's store: what
        it fetches is counted, and kept when the agent keeps objects."""
        sub = getattr(self.engine, "subscriber", None)
        if self.engine is None or not isinstance(sub, Subscriber):
            return
        if state_url(sub.repo.url) != state_url(self.store.inner.url):
            raise UsageError(f"the engine stages from {sub.repo.url}, but the agent follows {self.store.inner.url}")
        self.engine.subscriber = Subscriber(  # type: ignore[attr-defined]
            Repository(self.store, trusted_keys=engine_keys(sub)), workers=sub.workers, progress=sub.progress,
        )

    # -- what the holder says (a subclass each) --------------------------------------------------

    def current(self) -> int | None:
        """The version held (None: none yet)."""
        raise NotImplementedError

    def _needs_update(self, target: int) -> bool:
        raise NotImplementedError

    def _move(self, sub: Subscriber, repo: Repository, previous: int | None, target: int) -> str:
        """Bring what holds the weights to ``target``; returns how (for the update's record)."""
        raise NotImplementedError

    def _retain(self, current: int) -> None:
        """Prune the kept objects to what the holder still needs, now at ``current``."""

    def unreachable(self, cause: BaseException) -> None:
        """The repository could not be read (the watch raises ``cause`` after this)."""

    def other_repository(self) -> None:
        """Another repository is at the URL now (read by the watch): the engine reads it afresh."""
        if self.engine is not None:
            self.bind_engine()  # its repository object cached the old one's manifests

    # -- control ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """End :meth:`run` after the current chunk (thread- and signal-safe)."""
        self._stop.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Look at the source of targets now rather than after ``poll_interval``."""
        self._wake.set()

    def pause(self, seconds: float) -> None:
        """Wait ``seconds``, or until :meth:`stop`."""
        self._stop.wait(seconds)

    def state_db(self) -> StateDB:
        if self._db is None:
            self._db = StateDB.open(self.root)
        assert self._db is not None
        return self._db

    def repository(self) -> Repository:
        """The repository as the agent reads it now (:meth:`RepositoryWatch.repository`)."""
        return self.watch.repository()

    def metrics(self) -> list[Metric]:
        """The figures as Prometheus metrics (what ``/metrics`` serves)."""
        return self.book.metrics()

    def should_stop(self) -> bool:
        """Between chunks of a move: the figures kept current for `deltasync status`, and whether to stop."""
        self.book.flush()
        return self._stop.is_set()

    def run(self, *, follow: bool = False) -> int | None:
        """Bring what holds the weights to the target and return its version; with ``follow``,
        keep doing so until :meth:`stop`. Returns the version held at the end (None: none yet)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with copy_lock(self.root):
            finish_install(self.root)
            self.book.open(follow=follow, engine=self.engine is not None)
            server = self.book.serve_metrics(self.config)
            self.metrics_port = server.port if server is not None else None
            self.source.start(follow)
            try:
                if self.on_ready is not None:
                    self.on_ready(self)
                self._loop(follow)
            finally:
                self.source.close()
                if server is not None:
                    server.close()
                self.book.set(state="stopped", running=False)
                self.book.flush(force=True)
        return self.current()

    def _loop(self, follow: bool) -> None:
        backoff = Backoff(self.config.backoff_initial, self.config.backoff_max)
        attempts = 0
        while not self._stop.is_set():
            try:
                target = self.source.observe()
                if target is None:  # nothing committed yet: a follower waits for it
                    if not follow:
                        raise EmptyRepositoryError(self.store.url)
                elif self._needs_update(target) or self.source.due():
                    self._update(target)
                attempts = 0
                backoff.reset()
                self.book.set(state="idle", refused_ref=None)
                if not follow:
                    break
                self._wake.wait(self.config.poll_interval)
                self._wake.clear()
            except PullStopped:
                break
            except (DeltasyncError, OSError) as e:
                attempts += 1
                self.book.failed(e)
                if not follow and (attempts >= self.config.retries or isinstance(e, FINAL)):
                    raise
                self.book.set(state="backoff")
                self._stop.wait(backoff.next())

    def rollback(self, version: int) -> Update | None:
        """Move to the earlier (or any other) ``version`` now (a copy reverses the deltas in
        between where they allow it, reading their kept payloads, else rebuilds from the
        snapshot chain). Returns the update, or None when already there."""
        self.root.mkdir(parents=True, exist_ok=True)
        with copy_lock(self.root):
            finish_install(self.root)
            self.book.open(follow=False, engine=self.engine is not None)
            try:
                if not self._needs_update(version):
                    return None
                return self._update(version)
            except (DeltasyncError, OSError) as e:
                self.book.failed(e)
                raise
            finally:
                self.book.set(state="stopped", running=False)
                self.book.flush(force=True)

    # -- one move --------------------------------------------------------------------------------

    def _update(self, target: int) -> Update:
        repo = self.repository()
        sub = Subscriber(repo, workers=self.config.workers, progress=self.config.progress)
        previous = self.current()
        start, fetched = time.monotonic(), self.store.fetched_bytes
        self.book.set(state="updating", target_version=target)
        self.last_swap = None
        try:
            # A damaged kept payload drops the kept packs: the loop's next attempt reads them again.
            how = (self.kept.read(lambda: self._move(sub, repo, previous, target), retry=False) if self.kept is not None
                   else self._move(sub, repo, previous, target))
        except BaseException:
            self.source.abandoned()
            raise
        how = self.source.moved(target, how)
        update = Update(target, previous, how, self.store.fetched_bytes - fetched, time.monotonic() - start,
                        self.last_swap)
        self.book.moved(update)
        self._retain(target)
        self.book.flush(force=True)
        if self.on_update is not None:
            self.on_update(update)
        return update

    def _engine_update(self, engine: Engine, target: int, force: bool) -> SwapRecord | None:
        """How the engine takes ``target``. One that knows no version (a first load, a restart, a
        node joining) is loaded in place where it can (``TorchEngine.load``: memory O(chunks in
        flight), not a staged copy of the model and of its old bits; it serves nothing known yet)."""
        load = getattr(engine, "load", None)
        if engine.version is None and callable(load):
            record: SwapRecord = load(target)
            return record
        return engine.update(target, force=force)

    def _swap_engine(self, target: int, *, force: bool = False, via: Targets | None = None) -> SwapRecord | None:
        """``engine.update(target)`` (through ``via``, a source that carries versions to the
        engine itself), its outcome recorded in the state (:class:`EngineState`, shown by
        ``deltasync status``): the version the engine holds after it, or why it did not take
        the target, which is then raised. A version that did not reach the engine is a failed
        update, retried like any other (the engine serves what it held: its update restores it
        on failure); a run without ``follow`` fails once its retries are spent."""
        engine = self.engine
        assert engine is not None
        db = self.state_db()
        held = db.engine() or EngineState(engine.kind)
        try:
            if via is None:
                swap = self._engine_update(engine, target, force)
            else:
                swap = via.deliver(target, lambda version: self._engine_update(engine, version, force))
        except (DeltasyncError, OSError) as e:
            message = str(e) if isinstance(e, DeltasyncError) else f"{type(e).__name__}: {e}"
            same = held.version == engine.version
            db.set_engine(replace(held, kind=engine.kind, version=engine.version,
                                  version_digest=held.version_digest if same else "",
                                  repository_id=held.repository_id if same else "", last_error=message,
                                  last_error_unix=time.time(), last_error_version=target))
            raise
        info = self.repository().manifest(target)
        db.set_engine(replace(held, kind=engine.kind, version=target, version_digest=info.pb.version_digest.hex(),
                              repository_id=info.pb.repository_id.hex(), updated_unix=time.time()))
        return swap


def engine_keys(sub: Subscriber) -> list[PublicKeyLike] | None:
    """The keys a subscriber's repository trusts, as keys a new Repository takes."""
    keys = sub.repo.trusted_keys
    return None if keys is None else list(keys.keys.values())


__all__ = ["BaseAgent", "engine_keys"]

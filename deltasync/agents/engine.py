"""The engine-first agent: keeps an engine at the version to serve, with no directory copy.

``EngineAgent(engine, state_dir).run(follow=True)`` follows the repository the engine stages
from (the pin, else the latest; see directory.py for watching, retries and figures) and brings
the engine to each target with ``engine.update``: the engine fetches, decodes and verifies
only the chunks that changed (or, for an engine holding some tensors, only those covering
what it holds) and writes them in place. Nothing goes through a directory: a version costs
the local disk what its state and kept objects take, about its stored bytes, not the model.

``state_dir`` holds, under ``.deltasync/``:

* ``state.lmdb`` — the version the engine holds and its version digest (one small record per
  version, ``StateDB.record_engine``), the repository's URL, the agent's figures and last
  error (``deltasync status --state DIR``, :func:`deltasync.agents.status.read_status`);
* ``objects/`` — the manifests and packs read for the chain from the latest snapshot to the
  version held, and the deltas of the last ``keep_versions`` versions (local/cache.py). A restart,
  a fresh engine or a rollback among them reads them here, not from the repository.

The engine's own bits are the truth, not the numbers: on its first update in a run the
agent restages the engine against the target's digests (``update(force=True)``), so an
engine that starts empty, from its own weights or from a version the state no longer
describes is brought to the target bit-exact (chunks that already match are kept, the
others come from a snapshot plus the chain). A kill at any point loses at most the version
being staged; the next run starts over from the engine's bits.

Engines that load versions from files (``http:...``, a ``VllmEngine`` given a copy;
``Engine.needs_files``) need a directory copy: use :class:`~deltasync.agents.directory.Agent` with
``engine=`` instead. A ``VllmEngine`` with no copy is taken: the server's workers pull what
changes from the repository, so the agent reads manifests only and keeps no packs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..errors import DeltasyncError, RepositoryNotFoundError, StoreError, UsageError
from ..format.signing import PublicKeyLike
from ..local.cache import LocalCache
from ..local.state import STATE_DIR, StateDB, WorkInProgress
from ..pull.subscriber import Subscriber, state_url
from ..repo.history import check_extends
from ..repo.repository import Repository
from ..storage import Store
from .config import AgentConfig, Update
from .directory import Agent, engine_keys

if TYPE_CHECKING:
    from ..engines.base import Engine

log = logging.getLogger("deltasync.agents")


class EngineAgent(Agent):
    """Keeps ``engine`` at the version to serve, recording its state in ``state_dir`` (see the module doc).

    >>> engine = TorchEngine(model, "s3://bucket/run-7")
    >>> EngineAgent(engine, "/var/lib/deltasync/run-7").run(follow=True)

    ``repo`` defaults to the repository the engine stages from; the engine is rebound to read
    it through the agent's store (counted, and served from the kept objects when they hold
    what it reads). ``on_update`` receives each :class:`Update`, its ``swap`` the engine's
    record. :meth:`run`, :meth:`stop` and :meth:`rollback` are the agent's.
    """

    def __init__(
        self,
        engine: Engine,
        state_dir: str | os.PathLike[str],
        config: AgentConfig | None = None,
        *,
        repo: str | Store | None = None,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
        on_update: Callable[[Update], None] | None = None,
        on_ready: Callable[[Agent], None] | None = None,
    ) -> None:
        if engine.needs_files:
            raise UsageError(
                f"the {engine.kind} engine loads versions from files: keep a directory copy for it "
                "(subscribe --out DIR, or Agent(repo, out, engine=...))"
            )
        sub = getattr(engine, "subscriber", None)
        if not isinstance(sub, Subscriber):
            raise UsageError(f"the {engine.kind} engine does not stage versions in this process (no subscriber)")
        if repo is None:
            repo = sub.repo.store
        if trusted_keys is None:
            trusted_keys = engine_keys(sub)
        super().__init__(repo, state_dir, config, trusted_keys=trusted_keys, on_update=on_update, on_ready=on_ready,
                         engine=engine)  # which rebinds the engine to read through self.store
        db = StateDB.open(self.root, create=False)
        if db is not None and db.slots() is not None:
            raise UsageError(f"{self.root} is a directory copy; give an engine-first agent a state directory of its own")
        # Always a cache: the chain from the latest snapshot is what a restart is rebuilt from.
        self.cache = LocalCache(self.root / STATE_DIR / "objects")
        self.store.cache = self.cache
        self._verified = False  # the engine's bits were checked against a target in this run
        self._restore_tried = False  # a restore from the kept objects was tried (_restore_offline)

    # -- what the engine holds ----------------------------------------------------------------

    def current(self) -> int | None:
        """The version the engine holds, once this agent has brought it there (None before)."""
        assert self.engine is not None
        return self.engine.version if self._verified else None

    def recorded(self) -> int | None:
        """The version the state records (what the engine held when last recorded, maybe by an earlier run)."""
        db = StateDB.open(self.root, create=False)
        state = db.state() if db is not None else None
        return state.version if state is not None else None

    def restage(self) -> None:
        """Have the run's loop check the engine's bits against its target chunk by chunk again
        and rewrite those that differ (as at a start): the repair of a live check's drift."""
        self._verified = False
        self._wake.set()

    def _needs_update(self, target: int) -> bool:
        assert self.engine is not None
        return not self._verified or not self.engine.holds(target)

    def _observe(self) -> int | None:
        try:
            target = super()._observe()
            if target is None and not self._verified:
                self._repository().ensure_exists()  # a repository path gone (not mounted yet): out of reach too
            return target
        except (StoreError, OSError, RepositoryNotFoundError) as e:
            # The repository is out of reach at the start of a run: the engine need not wait
            # for it to serve what it held. The version the state records is restored from
            # the kept objects, then the run retries the repository as usual.
            if not self._verified and not self._restore_tried:
                self._restore_tried = True  # once per agent: a restore that failed is not retried per poll
                self._restore_offline(e)
            raise

    def _check_identity(self, repo: Repository) -> None:
        before = self._identity
        super()._check_identity(repo)
        if before is not None and self._identity != before:
            # Another repository at the URL now (one deleted and created again, a relay pointed
            # elsewhere): what the engine holds was of the old one, so its bits are checked
            # against the new one's digests at the next move, as at a start.
            self._verified = False
            self._engine_phase("loading")

    def _restore_offline(self, cause: BaseException) -> None:
        """Bring the engine to the version the state records from the kept objects alone (the
        chain from its snapshot: local/cache.py), when they hold it and its manifest is the one the
        state recorded (same version digest and repository). Every chunk is still checked by
        its digest; when the kept objects lack one, the engine is left claiming no version
        (a load may have written some of its tensors) and waits for the repository, which
        then brings it to its target checked chunk by chunk, as at any start. The identity
        the objects were kept by stands as the one read: when the repository answers with
        another, the engine is rebound and checked again (:meth:`_check_identity`)."""
        assert self.engine is not None and self.cache is not None
        db = StateDB.open(self.root, create=False)
        state = db.state() if db is not None else None
        if state is None:
            return
        kept, bound = self.cache.manifest(state.version), self.cache.bound()
        if kept is None or bound is None or not state.holds(kept):
            return
        sub = getattr(self.engine, "subscriber", None)
        if isinstance(sub, Subscriber):  # the engine reads the identity the objects were kept by
            sub.repo.assume_identity(bound[0])
        self._engine_phase("restoring")
        try:
            swap = self._swap_engine(state.version, force=True)
        except (DeltasyncError, OSError) as e:
            log.warning("version %d is not restorable from the kept objects (%s); waiting for the repository",
                        state.version, e)
            self._engine_phase("loading")
            return
        self._verified = True
        self._engine_phase("serving")
        self._identity = bound  # what the engine now holds is of this repository
        self.last_swap = swap
        log.warning("repository unreachable (%s): the engine serves version %d, restored from the kept objects",
                    cause, state.version)
        with self._lock:
            self.figures.last_update = {
                "version": state.version, "previous": None, "how": "restored from the kept objects (offline)",
                "fetched_bytes": 0, "seconds": swap.pause_s if swap is not None else 0.0,
                "finished_unix": time.time(),
            }
        self._flush(force=True)

    def _move(self, sub: Subscriber, repo: Repository, previous: int | None, target: int) -> str:
        assert self.engine is not None
        info = repo.manifest(target)
        db = self._state_db()
        held = db.state()
        if held is not None and held.repository_id == info.pb.repository_id.hex():
            # History only moves forward (repo/history.py): a fork is refused, the engine stays.
            check_extends(repo.store, repo.url, held.version, held.history_digest, info,
                          strict=repo.trusted_keys is not None)
        self.store.capture = self._capture(repo, previous, target)
        db.set_wip(WorkInProgress(target, "engine", time.time()))
        # First update of a run: the engine's bits are checked chunk by chunk against the
        # target's digests (whatever version it or the state claims); one that knows no
        # version is loaded in place (Agent._engine_update).
        swap = self._swap_engine(target, force=not self._verified)
        self._verified = True
        db.record_engine(info, repo=state_url(repo.url), engine=self.engine.kind)
        self._engine_phase("serving")
        self.last_swap = swap
        if swap is None:
            return "engine already there"
        how = f"engine: {swap.chunks_changed}/{swap.chunks_total} chunks changed, pause {swap.pause_s * 1e3:.1f} ms"
        return how if previous is not None else f"{how} (from a snapshot)"

    def _capture(self, repo: Repository, previous: int | None, target: int) -> set[str]:
        """Packs worth keeping: those of the chain from the target's snapshot, and of the
        deltas within ``keep_versions`` (read only when the plan needs them)."""
        try:
            chain = repo.chain(target)
        except DeltasyncError:
            return set()
        return {p.key for info in chain for p in info.pb.packs}

    def _retain(self, current: int) -> None:
        if self.cache is None:
            return
        newest = max(self.figures.highest_version, current)
        recent = {v for v in self.cache.versions() if v > newest - self.config.keep_versions}
        try:
            chain = [info.version for info in self._repository().chain(current)]
        except DeltasyncError:
            chain = [current]
        self.cache.prune(recent | set(chain), snapshots=chain)


__all__ = ["EngineAgent"]

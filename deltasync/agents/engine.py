"""The engine-first agent: keeps an engine at the version to serve, with no directory copy.

``EngineAgent(engine, state_dir).run(follow=True)`` follows the repository the engine stages
from (the pin, else the latest; see watch.py for watching, base.py for retries, figures.py for figures) and brings
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

from ..errors import DeltasyncError, UsageError
from ..format.signing import PublicKeyLike
from ..local.kept import chain_packs
from ..local.state import StateDB, WorkInProgress
from ..pull.subscriber import Subscriber, state_url
from ..repo.history import check_extends
from ..repo.repository import Repository
from ..storage import Store
from .base import BaseAgent, engine_keys
from .config import AgentConfig, Update

if TYPE_CHECKING:
    from ..engines.base import Engine

log = logging.getLogger("deltasync.agents")


class EngineAgent(BaseAgent):
    """Keeps ``engine`` at the version to serve, recording its state in ``state_dir`` (see the module doc).

    >>> engine = TorchEngine(model, "s3://bucket/run-7")
    >>> EngineAgent(engine, "/var/lib/deltasync/run-7").run(follow=True)

    ``repo`` defaults to the repository the engine stages from; the engine is rebound to read
    it through the agent's store (counted, and served from the kept objects when they hold
    what it reads). ``on_update`` receives each :class:`Update`, its ``swap`` the engine's
    record. :meth:`run`, :meth:`stop` and :meth:`rollback` are every agent's.
    """

    engine: Engine

    def __init__(
        self,
        engine: Engine,
        state_dir: str | os.PathLike[str],
        config: AgentConfig | None = None,
        *,
        repo: str | Store | None = None,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
        on_update: Callable[[Update], None] | None = None,
        on_ready: Callable[[EngineAgent], None] | None = None,
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
        # Always kept objects: the chain from the latest snapshot is what a restart is rebuilt from.
        super().__init__(repo, state_dir, config, trusted_keys=trusted_keys, engine=engine,
                         keep=True)  # which rebinds the engine to read through self.store
        self.on_update, self.on_ready = on_update, on_ready
        db = StateDB.open(self.root, create=False)
        if db is not None and db.slots() is not None:
            raise UsageError(f"{self.root} is a directory copy; give an engine-first agent a state directory of its own")
        self._verified = False  # the engine's bits were checked against a target in this run
        self._restore_tried = False  # a restore from the kept objects was tried (_restore_offline)

    # -- what the engine holds ----------------------------------------------------------------

    def current(self) -> int | None:
        """The version the engine holds, once this agent has brought it there (None before)."""
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
        self.wake()

    def _needs_update(self, target: int) -> bool:
        return not self._verified or not self.engine.holds(target)

    def unreachable(self, cause: BaseException) -> None:
        # The repository is out of reach at the start of a run: the engine need not wait for
        # it to serve what it held. The version the state records is restored from the kept
        # objects, then the run retries the repository as usual.
        if not self._verified and not self._restore_tried:
            self._restore_tried = True  # once per agent: a restore that failed is not retried per poll
            self._restore_offline(cause)

    def other_repository(self) -> None:
        super().other_repository()
        # What the engine holds was of the old one (one deleted and created again, a relay
        # pointed elsewhere), so its bits are checked against the new one's digests at the
        # next move, as at a start.
        self._verified = False
        self.book.engine_phase("loading")

    def _restore_offline(self, cause: BaseException) -> None:
        """Bring the engine to the version the state records from the kept objects alone (the
        chain from its snapshot: local/kept.py), when they hold it and its manifest is the one
        the state recorded (same version digest and repository). Every chunk is still checked
        by its digest; when the kept objects lack one, the engine is left claiming no version
        (a load may have written some of its tensors) and waits for the repository, which
        then brings it to its target checked chunk by chunk, as at any start. The identity
        the objects were kept by stands as the one read: when the repository answers with
        another, the engine is rebound and checked again (:meth:`other_repository`)."""
        assert self.kept is not None
        db = StateDB.open(self.root, create=False)
        state = db.state() if db is not None else None
        if state is None:
            return
        kept, bound = self.kept.cache.manifest(state.version), self.kept.bound()
        if kept is None or bound is None or not state.holds(kept):
            return
        sub = getattr(self.engine, "subscriber", None)
        if isinstance(sub, Subscriber):  # the engine reads the identity the objects were kept by
            sub.repo.assume_identity(bound[0])
        self.book.engine_phase("restoring")
        try:
            swap = self._swap_engine(state.version, force=True)
        except (DeltasyncError, OSError) as e:
            log.warning("version %d is not restorable from the kept objects (%s); waiting for the repository",
                        state.version, e)
            self.book.engine_phase("loading")
            return
        self._verified = True
        self.book.engine_phase("serving")
        self.watch.identity = bound  # what the engine now holds is of this repository
        self.last_swap = swap
        log.warning("repository unreachable (%s): the engine serves version %d, restored from the kept objects",
                    cause, state.version)
        self.book.restored(state.version, "restored from the kept objects (offline)",
                           swap.pause_s if swap is not None else 0.0)

    def _move(self, sub: Subscriber, repo: Repository, previous: int | None, target: int) -> str:
        info = repo.manifest(target)
        db = self.state_db()
        held = db.state()
        if held is not None and held.repository_id == info.pb.repository_id.hex():
            # History only moves forward (repo/history.py): a fork is refused, the engine stays.
            check_extends(repo.store, repo.url, held.version, held.history_digest, info,
                          strict=repo.trusted_keys is not None)
        assert self.kept is not None
        # Worth keeping: the chain from the target's snapshot, what a restart is rebuilt from
        # (_retain then prunes to the held version's chain and the last keep_versions).
        self.kept.capture(chain_packs(repo, target))
        db.set_wip(WorkInProgress(target, "engine", time.time()))
        # First update of a run: the engine's bits are checked chunk by chunk against the
        # target's digests (whatever version it or the state claims); one that knows no
        # version is loaded in place (BaseAgent._engine_update). The source may carry the
        # version's bytes to the engine itself (packcast rounds).
        swap = self._swap_engine(target, force=not self._verified, via=self.source)
        self._verified = True
        db.record_engine(info, repo=state_url(repo.url), engine=self.engine.kind)
        self.book.engine_phase("serving")
        self.last_swap = swap
        if swap is None:
            return "engine already there"
        how = f"engine: {swap.chunks_changed}/{swap.chunks_total} chunks changed, pause {swap.pause_s * 1e3:.1f} ms"
        return how if previous is not None else f"{how} (from a snapshot)"

    def _retain(self, current: int) -> None:
        assert self.kept is not None
        newest = max(self.figures.highest_version, current)
        try:
            chain = [info.version for info in self.repository().chain(current)]
        except DeltasyncError:
            chain = [current]
        self.kept.prune(self.kept.recent(newest, self.config.keep_versions) | set(chain), chains=chain)


__all__ = ["EngineAgent"]

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
  of the deltas applied are kept in the copy (``keep_versions``, local/kept.py);
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
agent runs, and are served as Prometheus metrics with ``metrics_port`` (figures.py). The run
loop, retries and engine swaps are every agent's (base.py); watching the repository is
watch.py's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..format.signing import PublicKeyLike
from ..local.kept import chain_packs
from ..local.slotfill import FillOptions, update_copy
from ..local.state import StateDB
from ..pull.subscriber import Subscriber, state_url
from ..repo.repository import Repository
from ..storage import Store
from .base import BaseAgent
from .config import AgentConfig, Update

if TYPE_CHECKING:
    from ..engines.base import Engine


class Agent(BaseAgent):
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
        config = config or AgentConfig()
        super().__init__(repo, out, config, trusted_keys=trusted_keys, engine=engine, keep=config.keep_versions > 0)
        self.on_update, self.on_ready = on_update, on_ready
        self._holds: tuple[Any, ...] | None = None  # (state, identity) found to hold their version: polls skip the manifest

    def current(self) -> int | None:
        db = StateDB.open(self.root, create=False)
        state = db.state() if db is not None else None
        return state.version if state is not None else None

    def _needs_update(self, target: int) -> bool:
        db = self.state_db()
        state, wip = db.state(), db.wip()
        if state is None or state.version != target:
            return True
        if self._holds != (state, self.watch.identity):
            # Held only with the target's version digest and repository, never by the number
            # (checked once per state and identity: versions do not change under one identity).
            if not state.holds(self.repository().manifest(target)):
                return True
            self._holds = (state, self.watch.identity)
        if wip is not None:  # an interrupted move to another version (its slot stays marked dirty)
            db.set_wip(None)
        if self.engine is None:
            return False
        if self.engine.holds(target):
            self.book.engine_phase("serving")  # this process's engine, at the copy's version
            return False
        return True

    def _move(self, sub: Subscriber, repo: Repository, previous: int | None, target: int) -> str:
        # Forwards or back, the slot not served is brought to the target in place (slotfill.py);
        # payloads of the deltas it walks come from the kept objects when they are there.
        kept = self.kept
        if kept is not None and previous is not None and target > previous:
            # The deltas between the version held and the target, within the versions kept.
            kept.capture(chain_packs(repo, target, stop_at=previous, deltas_after=target - self.config.keep_versions))
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
            with kept.also(self._plan_packs(repo, previous, target)) if kept is not None else contextlib.nullcontext():
                self._swap(target)
        result = update_copy(sub, self.root, repo.manifest(target), FillOptions(
            stop=self.should_stop, move_aside=self.config.move_aside, fsync=self.config.fsync, repo_url=state_url(repo.url)))
        if engine is not None and not engine.holds(target):
            # An engine that loads files, or one catching up with a copy already there (read from it).
            self._swap(target)
        return str(result)

    def _swap(self, target: int) -> None:
        self.last_swap = self._swap_engine(target)
        self.book.engine_phase("serving")

    @staticmethod
    def _plan_packs(repo: Repository, previous: int, target: int) -> set[str]:
        """Every pack a move from ``previous`` to ``target`` may read: the target's chain from
        its snapshot and the deltas between the two (kept only for the move: ``_retain`` then
        prunes what no kept version needs)."""
        low, high = min(previous, target), max(previous, target)
        return chain_packs(repo, target) | chain_packs(repo, high, stop_at=low)

    def _retain(self, current: int) -> None:
        if self.kept is not None:
            newest = max(self.figures.highest_version, current)
            self.kept.prune(self.kept.recent(newest, self.config.keep_versions) | {current})


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


__all__ = ["Agent", "rollback"]

"""Sources of targets: what tells an agent which version to serve next.

:class:`Targets` is what an agent asks; :class:`RepositoryWatch` is the source every agent
has: a repository watched (its pin, else its latest; the ``refs/latest`` hint read every
``poll_interval``, the versions listed again every ``relist_interval`` since a publisher may
die between its manifest and its ref; a relay's Watch stream waking the loop at once; the
repository's identity read again with each listing). A packcast node's rounds are another
source (:mod:`.packcast`), which falls back to the watch while node 0 is gone.

The watch tells the agent what it sees through two public hooks of the holder
(:class:`~.base.BaseAgent`): ``unreachable`` (the repository cannot be read) and
``other_repository`` (another one is at the URL now).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import (
    DeltasyncError,
    EmptyRepositoryError,
    ObjectNotFoundError,
    RepositoryIdentityError,
    RepositoryNotFoundError,
    StoreError,
)
from ..pull.subscriber import state_url
from ..repo.repository import LATEST, MARKER, MAX_REF_BYTES, Repository, ref_hint
from ..retry import Backoff

if TYPE_CHECKING:
    from ..engines.base import SwapRecord
    from .base import BaseAgent

log = logging.getLogger("deltasync.agents")


class Targets:
    """A source of targets. :meth:`observe` is the one question; the others let a source
    that carries versions itself (packcast rounds) take part in a move."""

    def start(self, follow: bool) -> None:
        """A run begins (``follow``: it goes on until stopped)."""

    def observe(self) -> int | None:
        """The version to serve now (None: nothing to serve yet)."""
        raise NotImplementedError

    def due(self) -> bool:
        """Whether a move is due even when the holder is at the target (a round to take)."""
        return False

    def deliver(self, target: int, apply: Callable[[int], SwapRecord | None]) -> SwapRecord | None:
        """Bring ``target`` to the engine with ``apply`` (a source may carry its bytes first)."""
        return apply(target)

    def moved(self, target: int, how: str) -> str:
        """A move to ``target`` is done (``how``: what it did). Returns ``how``, with what the
        source adds to it."""
        return how

    def abandoned(self) -> None:
        """A move failed."""

    def close(self) -> None:
        """The run ended."""


class RepositoryWatch(Targets):
    """The pin, else the latest version of the repository ``agent`` reads (see the module doc)."""

    def __init__(self, agent: BaseAgent) -> None:
        self.agent = agent
        self.identity: tuple[bytes | None] | None = None
        """The repository's identity as last read (a 1-tuple; None: not read yet)."""
        self.identity_read_at = -float("inf")
        self._last_listing = -float("inf")
        self._watched: int | None = None  # the newest version the Watch stream announced
        self._end: Callable[[], None] | None = None

    # -- the repository ----------------------------------------------------------------------

    def repository(self) -> Repository:
        # A fresh Repository per use: its manifest cache would otherwise grow with every
        # version a long-running agent sees (the kept objects keep the recent ones). The
        # newest signed refs accepted live in the agent's state: a replayed (older) ref is
        # refused across restarts too.
        agent = self.agent
        repo = Repository(agent.store, trusted_keys=agent.trusted_keys, ref_grace=agent.config.ref_grace,
                          ref_memory=agent.state_db())
        # The identity as last read (every look reads it again, check_identity), else the one
        # the kept objects are of: a rollback among them reads nothing from the repository.
        known = self.identity if self.identity is not None else agent.kept.bound() if agent.kept is not None else None
        if known is not None:
            repo.assume_identity(known[0])
        return repo

    def observe(self) -> int | None:
        """Read the pin and the latest version; returns the target (None: nothing to serve yet)."""
        agent = self.agent
        try:
            repo = self.repository()
            if time.monotonic() - self.identity_read_at >= agent.config.relist_interval:
                self.check_identity(repo)
            pinned = repo.pinned()
            latest = self._latest(repo)
            current = agent.current()
            target = pinned if pinned is not None else latest
            agent.book.saw(latest=latest, pinned=pinned, target=target, current=current,
                           stale_since=lambda: _stale_since(repo, current, target, time.time()))
            if target is None:  # nothing committed yet, or no repository there (not mounted yet)
                repo.ensure_exists()
            return target
        except (StoreError, OSError, RepositoryNotFoundError) as e:
            agent.unreachable(e)
            raise

    def check_identity(self, repo: Repository) -> None:
        """Read the repository's identity (repo/repository.py, Identity): at the first look and
        with every listing (``relist_interval``; signed refs name it, so with trusted keys a
        ref of another one is refused at once, see Repository.read_ref). With trusted keys it
        must be the one the state recorded from this URL (RepositoryIdentityError: another
        repository's objects copied over it, or one deleted and created again). Without,
        another one there is followed as the repository now at that URL: objects kept of the
        old one are dropped and the holder is told (``other_repository``: an engine reads it
        afresh, a copy is rebuilt, since it does not hold the new one's version digests)."""
        agent = self.agent
        found = Repository(agent.store).identity()  # read now, whatever the kept objects are of
        self.identity_read_at = time.monotonic()
        if found is None and not agent.store.exists(MARKER):
            # No repository there (a path not mounted yet, a bucket being restored): nothing to
            # compare or rebind by. The kept objects stay: an engine-first agent restores from them.
            return
        if self.identity is not None and self.identity[0] == found:
            return
        state = agent.state_db().state()
        recorded = state.repository_id if state is not None and state_url(state.repo) == agent.figures.repo else ""
        shown = found.hex() if found is not None else ""
        if state is not None and recorded and shown != recorded and repo.trusted_keys is not None:
            raise RepositoryIdentityError(
                agent.store.url, f"has identity {shown or '(none)'}, but {agent.root} holds version {state.version} of "
                f"repository {recorded} from it: another repository's objects copied over it, or it was deleted and "
                "created again; refused (follow it into a new directory)")
        if agent.kept is not None and agent.kept.bind(found) and self.identity is not None:
            log.warning("%s is another repository now (identity %s): objects kept of the old one dropped",
                        agent.store.url, shown or "(none)")
        before, self.identity = self.identity, (found,)
        if before is not None:
            agent.other_repository()

    def _latest(self, repo: Repository) -> int | None:
        now = time.monotonic()
        agent = self.agent
        known = agent.figures.latest_version
        if known is None or now - self._last_listing >= agent.config.relist_interval:
            self._last_listing = now
            try:
                return repo.latest()
            except EmptyRepositoryError:
                return None
        hint = known
        if repo.trusted_keys is not None:
            # Signed, unexpired, no older than seen, naming its manifest (RefError: recorded,
            # and the holder stays where it is).
            hint = repo.latest_ref() or known
        else:
            with contextlib.suppress(ObjectNotFoundError):
                hint = ref_hint(agent.store.get(LATEST, max_bytes=MAX_REF_BYTES)) or known
        if self._watched is not None:
            hint = max(hint, self._watched)
        if hint > known:
            repo.manifest(hint)  # committed (the ref is written after the manifest)
            return hint
        return known

    # -- the push stream ---------------------------------------------------------------------

    def start(self, follow: bool) -> None:
        """With ``follow``, follow the store's push stream (a relay's Watch), if it has one:
        each version announced wakes the agent's loop at once."""
        agent = self.agent
        watch = getattr(agent.store.inner, "watch", None)
        if not follow or watch is None:
            return
        current: list[Any] = []

        def loop() -> None:
            backoff = Backoff(agent.config.backoff_initial, agent.config.backoff_max)
            while not agent.stopping:
                try:
                    stream = watch(self._watched or agent.figures.latest_version or 0)
                    current[:] = [stream]
                    for version in stream:
                        backoff.reset()
                        self._watched = max(version, self._watched or 0)
                        agent.wake()
                except DeltasyncError as e:  # polling goes on meanwhile
                    log.info("watch stream ended (%s); polling until it is back", e)
                agent.pause(backoff.next())

        thread = threading.Thread(target=loop, name="deltasync-watch", daemon=True)
        thread.start()

        def end() -> None:
            for stream in current:
                with contextlib.suppress(Exception):
                    stream.close()
            thread.join(2)

        self._end = end

    def close(self) -> None:
        end, self._end = self._end, None
        if end is not None:
            end()


def _stale_since(repo: Repository, current: int | None, target: int | None, now: float) -> float:
    """When the holder fell behind its target: the commit time of the first version after it."""
    if target is None:
        return now
    for v in ([current + 1] if current is not None and current + 1 < target else []) + [target]:
        with contextlib.suppress(DeltasyncError):
            return min(now, repo.manifest(v).pb.created_unix or now)
    return now


__all__ = ["RepositoryWatch", "Targets"]

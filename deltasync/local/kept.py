"""Kept objects: the one way a reader keeps the chain of objects it follows on its own disk.

Three readers keep a repository's objects beside them: a directory copy's agent (the deltas
of its last versions, for rollbacks and returns that read nothing), an engine-first agent
(the chain from the latest snapshot, which a restart is rebuilt from) and a vLLM worker with
no copy (the chain its reloads read). Each does the same three things, here:

* capture: before a pull, the packs worth keeping from it are named (:meth:`KeptObjects.capture`,
  widened for a part of the move by :meth:`KeptObjects.also`); only those are written as they
  are read through the :class:`~deltasync.local.cache.CachedStore` (manifests and blob parts
  always are);
* damage: a kept payload that decodes wrong (``CorruptObjectError``, ``ChecksumMismatchError``)
  drops every kept pack, so that the next read fetches them again; :meth:`KeptObjects.read`
  tries once more at once (a worker) or leaves the retry to its caller's loop (an agent);
* prune: after a move, what the versions still wanted need is kept and the rest deleted
  (:meth:`KeptObjects.prune`; :meth:`KeptObjects.recent` names the last versions kept).

The objects themselves live in a :class:`~deltasync.local.cache.LocalCache` (files under
their store keys); what the reader keeps is its choice: :func:`chain_packs` names the packs of
a chain, or of the deltas in part of it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from ..errors import ChecksumMismatchError, CorruptObjectError, DeltasyncError
from ..repo.repository import Repository
from .cache import CachedStore, LocalCache

log = logging.getLogger("deltasync.local")

T = TypeVar("T")

#: What a damaged kept object raises when read (a manifest or blob part is checked, and
#: dropped, as it is read: CachedStore).
DAMAGE = (CorruptObjectError, ChecksumMismatchError)


def chain_packs(repo: Repository, target: int, *, stop_at: int | None = None,
                deltas_after: int | None = None) -> set[str]:
    """The packs of ``target``'s chain: from its snapshot, or from ``stop_at`` (the version
    held) up; with ``deltas_after``, only those of deltas newer than that version. Empty when
    the chain cannot be read (nothing is kept then: keeping is never worth a failed move)."""
    try:
        chain = repo.chain(target, stop_at=stop_at)
    except DeltasyncError:
        return set()
    return {p.key for info in chain if deltas_after is None or (not info.is_snapshot and info.version > deltas_after)
            for p in info.pb.packs}


class KeptObjects:
    """The objects a reader keeps of the repository it reads through ``store`` (see the module doc).

    ``store`` is made to keep into ``cache``; ``what`` names the keeper in warnings.
    """

    def __init__(self, cache: LocalCache, store: CachedStore, *, what: str = "kept objects") -> None:
        self.cache = cache
        self.store = store
        self.what = what
        store.cache = cache

    def capture(self, keys: Iterable[str]) -> None:
        """Keep the packs ``keys`` as the next reads fetch them (until :meth:`read` ends)."""
        self.store.capture = set(keys)

    @contextlib.contextmanager
    def also(self, keys: Iterable[str]) -> Iterator[None]:
        """Keep ``keys`` too while the block reads (an engine staging before the copy's fill)."""
        before = self.store.capture
        self.store.capture = before | set(keys)
        try:
            yield
        finally:
            self.store.capture = before

    def read(self, pull: Callable[[], T], *, retry: bool) -> T:
        """``pull()``, keeping what :meth:`capture` named. A damaged kept payload drops every
        kept pack; with ``retry`` the pull runs once more (its packs then come from the
        repository), else the error goes to the caller, whose next attempt reads them there."""
        try:
            try:
                return pull()
            except DAMAGE as e:
                self.cache.forget_packs()
                if not retry:
                    raise
                log.warning("%s: %s; reading from the repository instead", self.what, e)
                return pull()
        finally:
            self.store.capture = set()

    def recent(self, newest: int, count: int) -> set[int]:
        """The kept versions among the ``count`` up to ``newest``."""
        return {v for v in self.cache.versions() if v > newest - count}

    def prune(self, keep: Iterable[int], *, chains: Iterable[int] = ()) -> None:
        """Keep the manifests of ``keep`` (and of ``chains``), their blob parts, the packs of
        their deltas and of the versions in ``chains`` whole (a snapshot a restart is rebuilt
        from); delete the rest."""
        self.cache.prune(keep, snapshots=chains)

    def bind(self, identity: bytes | None) -> bool:
        """Keep objects of the repository with ``identity`` only (:meth:`LocalCache.bind`)."""
        return self.cache.bind(identity)

    def bound(self) -> tuple[bytes | None] | None:
        """The identity the objects are kept for (:meth:`LocalCache.bound`)."""
        return self.cache.bound()


__all__ = ["DAMAGE", "KeptObjects", "chain_packs"]

"""Publish leases: a publish in flight is visible to gc, which deletes nothing it may commit.

A publisher uploads packs and blobs, then commits the manifest that names them; until the
commit nothing references them, and a gc could take them (or an older object the version
reuses, content-addressed) for an orphan. A grace period is a guess at how long a publish
takes; a lease makes it a fact (restic's locks do the same for its prune).

* Before its first upload, a publish writes ``leases/<32 hex>.json``: ``{"format": 1,
  "kind": "publish", "what": ..., "started_unix", "expires_unix", "host", "pid"}``. A thread
  rewrites it every ``ttl / 4`` with a new expiry while the publish runs; it is deleted after
  the commit or the abandon (:class:`Lease`, a context manager). One lease per version
  publish (a :class:`~deltasync.publish.distributed.DistributedPublisher`'s rank 0 holds it
  for every rank, from before any rank uploads until its commit).
* gc (ops/retention.py) reads the leases right before deleting any pack or blob: while one
  is live it deletes none (whatever ``--grace`` says; unreferenced ones wait, recorded, for
  a run without live leases). A lease is live until :data:`LEASE_SKEW` seconds after its
  expiry (clocks of the publisher's and gc's hosts may differ); later, its publisher was
  killed (or lost the store) and gc deletes the lease.
* A lease that is not one (unreadable, or claiming to live longer than :data:`MAX_LEASE_TTL`
  from now: a hostile writer must not stop gc for good) counts as stale.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from ..errors import DeltasyncError, ObjectNotFoundError
from ..storage import Store

LEASES = "leases/"
#: Seconds a lease lives unless rewritten (a publisher rewrites it every quarter of this).
LEASE_TTL = 600.0
#: Seconds past its expiry that gc still honours a lease (clock skew between hosts).
LEASE_SKEW = 300.0
#: A lease claiming to live longer than this from now is not one of ours (stale).
MAX_LEASE_TTL = 24 * 3600.0
#: A lease is a few hundred bytes; a larger object is not one.
MAX_LEASE_BYTES = 4096

_KEY = re.compile(r"leases/[0-9a-f]{32}\.json")
log = logging.getLogger(__name__)


def is_lease_key(key: str) -> bool:
    return _KEY.fullmatch(key) is not None


@dataclass(frozen=True)
class LeaseInfo:
    """One lease as read by gc."""

    key: str
    what: str
    started_unix: float
    expires_unix: float
    host: str = ""
    pid: int = 0

    def live(self, now: float) -> bool:
        """Whether gc must honour it at ``now`` (see the module doc)."""
        return self.expires_unix + LEASE_SKEW >= now and self.expires_unix <= now + MAX_LEASE_TTL

    def describe(self) -> str:
        return f"{self.key} ({self.what or 'publish'} on {self.host or '?'} pid {self.pid})"


def read_leases(store: Store) -> tuple[list[LeaseInfo], list[str]]:
    """(leases read, keys under ``leases/`` that are not readable leases)."""
    found: list[LeaseInfo] = []
    bad: list[str] = []
    for key in sorted(store.list(LEASES)):
        if not is_lease_key(key):
            continue  # not a name a publisher writes: not ours to read or remove
        try:
            body = json.loads(store.get(key, max_bytes=MAX_LEASE_BYTES))
            found.append(LeaseInfo(key, str(body.get("what", "")), float(body["started_unix"]),
                                   float(body["expires_unix"]), str(body.get("host", "")), int(body.get("pid", 0))))
        except ObjectNotFoundError:
            continue  # its publish ended meanwhile
        except (DeltasyncError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            bad.append(key)
    return found, bad


class Lease:
    """A publish in flight, visible to gc while it runs (see the module doc).

    >>> with Lease(repo.store, "version 7"):
    ...     upload_packs(); commit()
    """

    def __init__(self, store: Store, what: str, *, ttl: float = LEASE_TTL, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.what = what
        self.ttl = ttl
        self.clock = clock
        self.key = f"{LEASES}{secrets.token_hex(16)}.json"
        self.started_unix = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewals = 0
        """Renewals ended (written or not), counted as each ends (:meth:`forget`)."""

    def _write(self) -> None:
        body = {"format": 1, "kind": "publish", "what": self.what, "started_unix": self.started_unix,
                "expires_unix": self.clock() + self.ttl, "host": socket.gethostname(), "pid": os.getpid()}
        self.store.put(self.key, json.dumps(body, sort_keys=True).encode())

    def __enter__(self) -> Lease:
        self._write()  # a failure here fails the publish (what it uploaded beside it is removed)
        self._thread = threading.Thread(target=self._refresh, name="deltasync-lease", daemon=True)
        self._thread.start()
        return self

    def _refresh(self) -> None:
        while not self._stop.wait(self.ttl / 4):
            try:
                self._write()
            except DeltasyncError as e:  # the next rewrite tries again; gc honours it LEASE_SKEW longer
                log.warning("could not renew the publish lease %s (%s)", self.key, e)
            finally:
                self.renewals += 1

    def release(self) -> None:
        """Stop renewing and delete the lease (once; a publish calls it right after its commit,
        beside its other after-commit requests, and leaving the ``with`` does nothing more)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(DeltasyncError):  # left behind, it expires
            self.store.delete(self.key)

    def forget(self, renewals: int) -> None:
        """Stop renewing: the lease was deleted where the repository is (a writable relay that
        committed the version, Repository.commit), asked when :attr:`renewals` was
        ``renewals``. A renewal that ended since may have written it again after that
        deletion: it is then deleted here (else, left behind, it would expire)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.renewals != renewals:
            with contextlib.suppress(DeltasyncError):
                self.store.delete(self.key)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


"""Objects on their way from the upstream to a relay's readers.

An immutable object (pack, blob, manifest, squash) is fetched from the upstream once, whole,
into the cache (:mod:`deltasync.relay.cache`), however many readers ask at the same moment:
one :class:`Flight` per key. With ``stream`` a reader is served from the flight's temporary
file as the pieces land (:class:`~deltasync.relay.cache.Landing`), else once the object is
whole. Refs and other mutable keys are never cached: they are read from the upstream a piece
at a time (:meth:`Fetches.from_upstream`).

A download runs on a thread of its own pool (:attr:`Fetches.pool`, ``workers`` threads), not
on the relay's pool that serves reads (``in_thread``): a download can last as long as its
link makes it, and with ``cluster_relays`` it waits on pieces another relay serves from its
own download, so downloads holding every serving thread would leave no thread to send a
piece (or start the download) a peer waits for, on either relay. At most ``workers``
downloads run at once (each holds a piece in flight: the memory bound of
:class:`~.gauge.UpstreamGauge`); the others wait their turn on the event loop, holding no
thread. In a cluster of ``n`` relays ``workers // n`` of them are for downloads anyone asks
for and the rest kept for objects a peer asked this relay for a piece of
(:data:`~.shares.PEER_METADATA`): such a download starts at once while a kept slot is free,
so a peer's download never waits on one here that waits on the peer (with the same
``workers`` on each relay, every download a peer asks for traces back to an ordinary slot of
another relay, at most ``(n - 1) x (workers // n)``, which the kept slots hold).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import ObjectTooLargeError, StoreError
from ..storage import Store
from ..storage.wire import CHUNK_BYTES
from ..v1 import relay_pb2 as pb
from .cache import Entry, Landing, ObjectCache, size_limit
from .config import RelayConfig
from .shares import ClusterShares

log = logging.getLogger("deltasync.relay")

#: Runs a blocking function on the relay's thread pool: ``await in_thread(fn, *args)``.
InThread = Callable[..., Coroutine[Any, Any, Any]]


class FetchFailed(Exception):
    """The upstream fetch a Get waited for failed (``cause``: why)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Flight:
    """(Loop) One object being fetched into the cache, shared by every reader of it."""

    def __init__(self, key: str, loop: asyncio.AbstractEventLoop) -> None:
        self.key = key
        self.landing = Landing(key, notify=self._notify)
        self.task: asyncio.Task[Entry]  # set by Fetches.fetch
        self.for_peer = False
        """A relay of the cluster asked for a piece of it: it may take a slot kept for peers."""
        self.started = False
        """Its download has a slot (it runs, or has run)."""
        self._changed = asyncio.Event()
        self._loop = loop

    def _notify(self) -> None:  # (the download's thread)
        # A relay stopped mid-download has closed its loop: no reader is left to wake, and the
        # download must still close its file and clear its temporary one.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.wake)

    def wake(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    async def covering(self, end: int) -> Landing:
        """The landing once its size is known and ``end`` bytes are written (the whole object
        verified when ``end`` reaches its size), or once it failed."""
        landing = self.landing
        while True:
            changed = self._changed  # taken before looking, so no progress slips between
            size = landing.size
            if landing.finished or (size is not None and (landing.verified or (end < size and landing.written >= end))):
                return landing
            await changed.wait()


@dataclass
class Source:
    """An open cached object (or one still arriving: ``flight``), held against eviction."""

    key: str
    fd: int
    size: int
    entry: Entry | None
    flight: Flight | None

    def close(self, cache: ObjectCache) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            cache.release(self.key)


class Fetches:
    """(Loop) The relay's fetches from its upstream: single flight per key into the cache, and
    the uncached keys read through. ``counters`` are the service's (``cache_hits``,
    ``coalesced``, ``streamed``, ``fetch_errors``, ``warm_fetches``)."""

    def __init__(
        self, upstream: Store, cache: ObjectCache, config: RelayConfig, in_thread: InThread, counters: dict[str, int],
        shares: ClusterShares | None = None,
    ) -> None:
        self.upstream = upstream
        self.cache = cache
        self.config = config
        self.in_thread = in_thread
        self.counters = counters
        self.shares = shares
        """The relays of this cluster that objects are fetched in shares with (None: alone)."""
        self.inflight: dict[str, Flight] = {}
        self.pool = ThreadPoolExecutor(config.workers, thread_name_prefix="deltasync-relay-fetch")
        """The threads downloads run on, apart from the serving pool (see the module doc)."""
        self.running = {"any": 0, "peer": 0}
        """Downloads running in ordinary slots and in the slots kept for peers."""
        self._slot_freed = asyncio.Event()

    def slots(self) -> tuple[int, int]:
        """How many downloads may run at once: for anyone, and kept for peers' objects."""
        members = self.shares.size if self.shares is not None else 1
        ordinary = max(1, self.config.workers // members)
        return ordinary, self.config.workers - ordinary

    def close(self) -> None:
        """(Any thread but the loop's) Wait for the downloads running to end and start no more
        (the relay stops: ObjectCache.stopping ends them at their next piece)."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    def known_size(self, key: str) -> int | None:
        """The size of ``key`` if it is cached or its fetch has learned it; else None."""
        entry = self.cache.lookup(key, touch=False)
        flight = self.inflight.get(key) if entry is None else None
        return entry.size if entry is not None else flight.landing.size if flight is not None else None

    async def from_upstream(self, key: str, byte_range: tuple[int, int] | None) -> AsyncIterator[pb.GetChunk]:
        """An uncached object (or a range of it) read from the upstream a piece at a time."""
        if byte_range is None:
            try:  # small, as refs are: one read, so the object cannot change between pieces
                data = await self.in_thread(functools.partial(self.upstream.get, key, max_bytes=CHUNK_BYTES))
            except ObjectTooLargeError:
                byte_range = (0, await self.in_thread(self.upstream.size, key))
            else:
                yield pb.GetChunk(data=data, total_bytes=len(data))
                return
        offset, length = byte_range
        position, end = offset, offset + length
        while True:
            n = min(CHUNK_BYTES, end - position)
            piece = await self.in_thread(self.upstream.get, key, (position, n))
            yield pb.GetChunk(data=piece, total_bytes=length if position == offset else 0)
            position += n
            if position >= end:
                return

    async def open_cached(self, key: str, *, for_peer: bool = False) -> Source:
        """The cached object, open for reading (held against eviction until closed), fetching
        it first if needed; with ``stream``, the object while it is still being fetched, as
        soon as its size is known. FetchFailed when the fetch fails. ``for_peer``: a relay of
        the cluster asks (see :meth:`fetch`)."""
        for _ in range(3):
            entry = self.cache.lookup(key)
            if entry is None:
                flight = self.fetch(key, for_peer=for_peer)
                if self.config.stream:
                    landing = await flight.covering(0)
                    if landing.error is not None:
                        raise FetchFailed(landing.error)
                    self.cache.hold(key)
                    try:
                        fd = landing.open()
                    except FileNotFoundError:  # landed, then evicted before we opened it
                        self.cache.release(key)
                        await asyncio.sleep(0)  # the finished flight leaves inflight first
                        continue
                    except BaseException:
                        self.cache.release(key)
                        if landing.error is not None:  # it failed between the wait and the open
                            raise FetchFailed(landing.error) from None
                        raise
                    assert landing.size is not None
                    streaming = landing.entry is None
                    self.counters["streamed" if streaming else "cache_hits"] += 1
                    return Source(key, fd, landing.size, landing.entry, flight if streaming else None)
                try:
                    entry = await asyncio.shield(flight.task)
                except Exception as e:
                    raise FetchFailed(e) from None
            elif not await self.in_thread(self.cache.intact, key, entry):
                continue  # damaged (or cached unchecked by an older relay): dropped, fetched again
            else:
                self.counters["cache_hits"] += 1
            self.cache.hold(key)
            try:
                return Source(key, os.open(entry.path, os.O_RDONLY), entry.size, entry, None)
            except FileNotFoundError:  # evicted (or removed) between lookup and open
                self.cache.release(key)
                self.cache.forget(key, entry)
            except BaseException:
                self.cache.release(key)
                raise
        # Not damage and not a bad request: the cache is churning (evicting faster than it is read).
        raise OSError(f"the relay cache keeps losing {key} between finding and opening it; try again")

    def fetch(self, key: str, *, warm: bool = False, size_hint: int | None = None,
              source: Store | None = None, for_peer: bool = False) -> Flight:
        """Single flight: concurrent requests for one key share one upstream fetch, which
        carries on into the cache even if the client that started it goes away. ``size_hint``:
        see ObjectCache.fetch (the warmer's, from the manifest). ``source``: where to read it
        instead of the upstream (a manifest an upstream relay's event carried: feed.py),
        checked on arrival as anything fetched is. With :attr:`shares`, an object from the
        upstream is fetched in shares with the cluster's other relays (:mod:`.shares`).
        ``for_peer``: one of them asks for a piece of it: its download may take a slot kept
        for peers (the module doc), also when it was already waiting for an ordinary one."""
        flight = self.inflight.get(key)
        if flight is not None:
            if not (warm or flight.landing.entry is not None):
                self.counters["coalesced"] += 1
            if for_peer and not flight.started and not flight.for_peer:
                flight.for_peer = True
                self._freed()  # it may start now, in a kept slot
            return flight
        loop = asyncio.get_running_loop()
        flight = Flight(key, loop)
        flight.for_peer = for_peer
        fetch = functools.partial(self.cache.fetch, key, source or self.upstream, max_size=size_limit(key),
                                  landing=flight.landing, size_hint=size_hint,
                                  shares=self.shares if source is None else None)
        flight.task = loop.create_task(self._download(flight, fetch))
        self.inflight[key] = flight
        flight.task.add_done_callback(functools.partial(self._landed, flight))
        self.counters["warm_fetches"] += int(warm)
        return flight

    async def _download(self, flight: Flight, fetch: Callable[[], Entry]) -> Entry:
        """Run ``fetch`` on :attr:`pool` once a slot is free: an ordinary one, or (a peer's
        object) one kept for peers; until then it waits here, holding no thread."""
        while True:
            ordinary, kept = self.slots()
            if self.running["any"] < ordinary:
                kind = "any"
                break
            if flight.for_peer and self.running["peer"] < kept:
                kind = "peer"
                break
            freed = self._slot_freed  # (no await since the look: no wake-up slips between)
            await freed.wait()
        self.running[kind] += 1
        flight.started = True
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fetch)
        finally:
            self.running[kind] -= 1
            self._freed()

    def _freed(self) -> None:
        """Wake the downloads waiting for a slot (one ended, or a waiting one became a peer's)."""
        old, self._slot_freed = self._slot_freed, asyncio.Event()
        old.set()

    def _landed(self, flight: Flight, task: asyncio.Task[Entry]) -> None:
        if self.inflight.get(flight.key) is flight:
            del self.inflight[flight.key]
        error: BaseException | None = StoreError("the relay stopped") if task.cancelled() else task.exception()
        if error is not None:  # retrieved: no "never retrieved" noise
            self.counters["fetch_errors"] += 1
            log.debug("fetching %s failed: %s", flight.key, error)
            if not flight.landing.finished:  # cancelled before the fetch ran: tell its readers
                flight.landing.error = error
        flight.wake()

"""What a relay knows of its upstream's versions: :class:`VersionFeed`, one per relay and shared
by every watcher, follows the upstream while anyone watches (polling ``refs/latest`` and listing
the manifests, or following an upstream relay's Watch stream); :class:`Warmer` fetches each
version it learns of into the cache before anyone asks.

Copies (issue 30 item 2): an event for a new version carries the small mutable objects a
reader of it asks for next, as stored upstream (:data:`COPIED`: the refs, the marker, the
``squashes/`` listing; ``VersionEvent.copies``). A relay following an upstream relay keeps the
copies of the newest event for ``hint_ttl`` seconds and answers those reads from them (and
forwards them to its own watchers), so a reader behind a long link learns of a version and
reads its refs without a round trip across it per read. They are hints like any read through
a relay: agents check refs (signed ones against their trusted keys), the marker and every
object exactly as before. A relay over a repository (not a relay) reads them there once per
new version; one over a relay that sends none sends none (its readers ask as before)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..errors import CorruptObjectError, DeltasyncError, ObjectNotFoundError, ObjectTooLargeError
from ..format.manifest import BLOB_PART_SIZE, manifest_key, parse_manifest
from ..repo.repository import LATEST, MARKER, MAX_REF_BYTES, PIN, SQUASHES, Repository, blob_key, ref_hint
from ..storage import GrpcStore, MemoryStore, Store, VersionWatch, check_key
from ..v1 import manifest_pb2 as manifest_pb, relay_pb2 as pb
from .cache import ObjectCache, served
from .config import RelayConfig
from .fetch import Fetches, InThread
from .push import PushedPacks

log = logging.getLogger("deltasync.relay")
T = TypeVar("T")

_RECENT = 4096  # versions a feed remembers, to send each new one to watchers in order
_IDLE_STOP = 30.0  # seconds without watchers after which a feed stops polling the upstream
_WARM_BACKLOG = 8  # newest versions of one feed update that are warmed (older ones: on demand)
_PER_VERSION = 8  # versions whose event copies and push plans are kept, for watchers behind
#: What an event for a new version carries copies of (module doc): objects, and listed prefixes.
COPIED = (PIN, LATEST, MARKER, SQUASHES)
_COPY_BYTES = 64 << 10  # a larger ref or marker is not copied (readers ask for it as before)
_COPY_KEYS = 1000  # nor a listing of more keys
_MANIFEST_COPY_BYTES = 256 << 10  # a version's manifest up to this is sent with its event
# The marker and the squashes/ listing change rarely (a repository created again, a squash
# added, neither of which a reader misses for long: identities are read again every 30 s, a
# squash is only a shorter path): their copies serve this many times ``hint_ttl``.
_LASTING = 10


class VersionFeed:
    """The relay's view of the upstream's committed versions, shared by every watcher."""

    def __init__(
        self,
        upstream: Store,
        in_thread: InThread,
        watchers: Callable[[], int],
        config: RelayConfig,
        on_new: Callable[[list[int], bool], None] | None = None,
        fetches: Fetches | None = None,
        on_manifest: Callable[[str, bytes], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self.upstream = upstream
        self.in_thread = in_thread
        self.watchers = watchers
        self.config = config
        self.on_new = on_new  # (versions, fresh): new versions, and whether the feed just (re)started
        self.fetches = fetches  # the cache, where the manifests sent with events are (_manifest_copy)
        self.cache = fetches.cache if fetches is not None else None
        self.on_manifest = on_manifest  # (key, bytes): a manifest an event carried, into the cache
        self._pending: asyncio.Task[None] | None = None  # the newest announced version, landing its manifest
        self._fresh = True
        self.latest = 0
        self.recent: list[int] = []  # newest committed versions, ascending
        self.succeeded = False  # the upstream answered at least once
        self.error: str | None = None
        self.failing_since = 0.0
        self.changed = asyncio.Event()
        self._poked = asyncio.Event()  # poke(): look at the upstream now
        self._task: asyncio.Task[None] | None = None
        self._watch: VersionWatch | None = None
        self._closed = False
        self._next_scan = 0.0  # poller thread state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hints: dict[str, tuple[pb.UpstreamCopy, float]] = {}  # from the upstream relay's events, and when
        self._copies: dict[int, asyncio.Task[list[pb.UpstreamCopy]]] = {}  # sent with our events
        self._plans: dict[int, asyncio.Task[list[pb.PushedObject]]] = {}  # pushed after them (push_plan)
        self.pushes: PushedPacks | None = None
        """The packs the upstream relay pushes on its Watch stream, while it does (relay/push.py)."""
        self.always = False
        """Follow the upstream with no watcher too (a relay of a cluster, ``cluster_relays``: the
        cluster's agents watch one of its relays, and each must hear of every version at once
        to fetch its share of it)."""

    def start(self) -> None:
        if self._task is None and not self._closed:
            self._fresh = True
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run())

    @property
    def running(self) -> bool:
        return self._task is not None

    def after(self, version: int) -> list[int]:
        return self.recent[bisect.bisect_right(self.recent, version) :]

    def unavailable(self) -> str | None:
        """Why watchers should move to another relay: the upstream has not answered yet, or
        has not for ``upstream_grace`` seconds. None while all is well."""
        if self.error is None:
            return None
        if not self.succeeded or time.monotonic() - self.failing_since >= self.config.upstream_grace:
            return self.error
        return None

    def wake(self) -> None:
        old, self.changed = self.changed, asyncio.Event()
        old.set()

    def poke(self) -> None:
        """(Loop) Look at the upstream now, not after ``poll_interval``: this relay has just
        written the latest ref there (a publish through it), so its watchers hear of the
        version at once instead of up to a poll later. Idle while following an upstream relay
        (its Watch stream says)."""
        self._poked.set()

    def hint(self, key: str) -> pb.UpstreamCopy | None:
        """The upstream relay's copy of ``key`` (an object, or a listed prefix) sent with its
        newest event, while under ``hint_ttl`` old (the marker and the listing, which change
        rarely: ``_LASTING`` times that); None: ask the upstream."""
        got = self._hints.get(key)
        if got is None:
            return None
        ttl = self.config.hint_ttl * (1 if key.startswith("refs/") else _LASTING)
        return got[0] if time.monotonic() - got[1] < ttl else None

    def copies(self, version: int) -> asyncio.Task[list[pb.UpstreamCopy]]:
        """(Loop) The copies to send with the event for ``version``, gathered once per version
        for every watcher: the upstream relay's (fresh, as they came), else, over a
        repository, read there now; none over a relay that sent none."""
        return _once(self._copies, version, self._gather)

    def push_plan(self, version: int) -> asyncio.Task[list[pb.PushedObject]]:
        """(Loop) The packs of ``version`` to push after its event to a relay that asks
        (relay/push.py): those its manifest names, when the event carries that manifest;
        worked out once per version for every watcher."""
        return _once(self._plans, version, self._plan)

    async def _plan(self, version: int) -> list[pb.PushedObject]:
        key = manifest_key(version)
        manifest = next((c for c in await self.copies(version) if c.key == key and not c.absent), None)
        if manifest is None:
            return []
        try:
            info = await self.in_thread(functools.partial(parse_manifest, manifest.data, expect_version=version))
        except Exception as e:  # the relays below fetch it and say what is wrong
            log.debug("not pushing version %d: its manifest does not parse: %s", version, e)
            return []
        return [pb.PushedObject(key=p.key, size=p.size) for p in info.pb.packs]

    async def _gather(self, version: int) -> list[pb.UpstreamCopy]:
        manifest = self._manifest_copy(version)
        if isinstance(self.upstream, GrpcStore):
            copies = [c for k in COPIED if (c := self.hint(k)) is not None]
            got: list[object] = list(await asyncio.gather(manifest, return_exceptions=True))
        else:
            got = await asyncio.gather(manifest, *(self.in_thread(self._read_copy, key) for key in COPIED),
                                       return_exceptions=True)
            copies = []
        return copies + [c for c in got if isinstance(c, pb.UpstreamCopy)]

    async def _manifest_copy(self, version: int) -> pb.UpstreamCopy | None:
        """The manifest of ``version`` when it is small (most deltas'), from the cache: where a
        copy from the upstream relay landed, or, over a repository, fetched now (the warmer's
        fetch of it, single flight; not with warming off). A relay following this one starts its packs on the event.
        Over a relay that sent none: none (not a round trip across the link before the event)."""
        key = manifest_key(version)
        if self.cache is None or self.fetches is None:
            return None
        entry = self.cache.lookup(key, touch=False)
        if entry is None and self.config.warm and not isinstance(self.upstream, GrpcStore):
            entry = await asyncio.shield(self.fetches.fetch(key, warm=True).task)
        if entry is None or entry.size > _MANIFEST_COPY_BYTES:
            return None
        try:
            data = await self.in_thread(entry.path.read_bytes)
        except OSError:  # evicted meanwhile
            return None
        return pb.UpstreamCopy(key=key, data=data)

    def _read_copy(self, key: str) -> pb.UpstreamCopy | None:
        """(Thread) ``key`` as stored upstream now, or None when it is not to be copied."""
        if key.endswith("/"):
            keys = [k for k in self.upstream.list(key) if served(k)]
            return pb.UpstreamCopy(key=key, keys=keys) if len(keys) <= _COPY_KEYS else None
        try:
            return pb.UpstreamCopy(key=key, data=self.upstream.get(key, max_bytes=_COPY_BYTES))
        except ObjectNotFoundError:
            return pb.UpstreamCopy(key=key, absent=True)
        except ObjectTooLargeError:
            return None

    def _announced(self, version: int, copies: list[pb.UpstreamCopy], pushed: list[pb.PushedObject]) -> None:
        """(Loop) The upstream relay announced ``version`` with ``copies``: the hints kept,
        the fetches of the packs it pushes begun (they wait for the pushed bytes: relay/push.py),
        its manifest (if sent) into the cache as if fetched (checked the same way), then the
        version published (so the warmer finds the manifest there and asks for its packs,
        joining those fetches)."""
        self._expect_pushed(pushed, wanted=version > self.latest)
        if version > self.latest:
            now = time.monotonic()
            self._hints.update((c.key, (c, now)) for c in copies if c.key in COPIED)
        key = manifest_key(version)
        manifest = next((c for c in copies if c.key == key and not c.absent), None)
        if self.on_manifest is None or version <= self.latest:
            manifest = None
        before = self._pending
        if manifest is None and (before is None or before.done()):
            self.publish([version])
            return
        # Published in the order announced, each after its manifest landed.
        self._pending = asyncio.get_running_loop().create_task(self._land_then_publish(version, manifest, before))

    def _expect_pushed(self, pushed: list[pb.PushedObject], *, wanted: bool) -> None:
        """(Loop) A fetch of each pushed pack this relay lacks (of a version ``wanted``: newer
        than any known), reading the push (a reader of it joins that fetch); the bytes of the
        others let go of."""
        pushes = self.pushes
        if pushes is None:
            return
        for obj in pushed:
            key = obj.key
            if (not wanted or self.fetches is None or self.cache is None
                    or self.cache.lookup(key, touch=False) is not None or key in self.fetches.inflight):
                pushes.discard(key)
                continue
            flight = self.fetches.fetch(key, warm=True, size_hint=obj.size, source=pushes)
            flight.task.add_done_callback(functools.partial(_discard, pushes, key))

    async def _land_then_publish(self, version: int, manifest: pb.UpstreamCopy | None,
                                 before: asyncio.Task[None] | None) -> None:
        if before is not None:
            await asyncio.wait([before])
        if manifest is not None and self.on_manifest is not None:
            try:
                await self.on_manifest(manifest.key, manifest.data)
            except Exception as e:  # not that manifest: the warmer (or a reader) fetches it as before
                log.warning("the manifest of version %d that the upstream relay sent is refused: %s", version, e)
        self.publish([version])

    def publish(self, versions: list[int]) -> None:
        new = sorted({v for v in versions if v > self.latest})
        if new:
            self.recent.extend(new)
            del self.recent[:-_RECENT]
            self.latest = new[-1]
            self.wake()
            fresh, self._fresh = self._fresh, False
            if self.on_new is not None:
                self.on_new(new, fresh)

    async def close(self) -> None:
        self._closed = True
        if self._pending is not None:
            self._pending.cancel()
        if self._watch is not None:
            self._watch.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        repo = Repository(self.upstream)
        follow = isinstance(self.upstream, GrpcStore)
        idle_since = time.monotonic()
        while not self._closed:
            if self.always or self.watchers():
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > _IDLE_STOP:
                # Nobody is watching: stop polling. The next watcher restarts the feed and
                # hears nothing until it has fresh news.
                self._task, self.succeeded, self.error = None, False, None
                return
            self._poked.clear()  # a poke from here on is for the next look
            try:
                self.publish(await self.in_thread(self._poll, repo))
                self._ok()
                if follow:  # push from the upstream relay until its stream fails
                    await self.in_thread(self._follow)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._failed(e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poked.wait(), self.config.poll_interval)

    def _ok(self) -> None:
        if self.error is not None:
            log.info("upstream %s answers again", self.upstream.url)
        self.error = None
        if not self.succeeded:
            self.succeeded = True
            self.wake()

    def _failed(self, e: Exception) -> None:
        message = str(e) if isinstance(e, DeltasyncError) else f"{type(e).__name__}: {e}"
        if self.error is None:
            self.failing_since = time.monotonic()
        if message != self.error:
            log.warning("cannot follow upstream %s: %s", self.upstream.url, message)
        self.error = message
        self.wake()  # watchers re-check whether to give up on this relay

    def _poll(self, repo: Repository) -> list[int]:
        """(Thread) Versions newer than the newest known: read the ref each time, list the
        manifests when it moved and every ``rescan_interval``."""
        try:
            # Either form of the ref (plain or signed); only a hint to list sooner: the relay
            # holds no keys, its subscribers check signed refs themselves.
            hint: int | None = ref_hint(self.upstream.get(LATEST, max_bytes=MAX_REF_BYTES))
        except (ObjectNotFoundError, ObjectTooLargeError):  # no hint, or none readable
            hint = None
        now = time.monotonic()
        if (hint is None or hint <= self.latest) and now < self._next_scan:
            return []
        self._next_scan = now + self.config.rescan_interval
        return [v for v in repo.versions() if v > self.latest]

    def _follow(self) -> None:
        """(Thread) Relay the upstream relay's Watch stream until it fails or the feed closes."""
        assert isinstance(self.upstream, GrpcStore) and self._loop is not None
        pushes = self.pushes
        if pushes is None:
            watch = self.upstream.watch(self.latest)
        else:
            watch = self.upstream.watch(self.latest, push_bytes=pushes.limit, on_piece=pushes.piece, on_end=pushes.end)
        self._watch = watch
        if self._closed:
            watch.close()
        for version in watch:
            # Expected before the next message is read: the pushed bytes follow the event.
            pushed = pushes.expect(watch.pushed) if pushes is not None else []
            self._loop.call_soon_threadsafe(self._announced, version, watch.copies, pushed)


def _once(tasks: dict[int, asyncio.Task[T]], version: int,
          work: Callable[[int], Coroutine[Any, Any, T]]) -> asyncio.Task[T]:
    """(Loop) ``work(version)`` begun once for every watcher, kept in ``tasks`` for the newest
    :data:`_PER_VERSION` versions."""
    task = tasks.get(version)
    if task is None:
        task = asyncio.get_running_loop().create_task(work(version))
        tasks[version] = task
        for old in sorted(tasks)[:-_PER_VERSION]:
            del tasks[old]
    return task


def _discard(pushes: PushedPacks, key: str, _done: object) -> None:
    pushes.discard(key)


class Warmer:
    """(Loop) Fetches the versions the feed learns of into the cache (``warm``), manifest then
    packs and blobs in the manifest's order (the order agents read them in), ``warm_concurrency``
    objects at a time; a relay of a cluster of ``n`` (``cluster_relays``) fetches only 1/n of
    each object over its own link, so it warms ``n`` times as many at once (as many bytes in
    flight over its link as a relay on its own: with small packs at a long round trip, four
    objects' shares left the link idle between them)."""

    def __init__(self, fetches: Fetches, upstream_url: str, config: RelayConfig, counters: dict[str, int]) -> None:
        self.fetches = fetches
        self.cache: ObjectCache = fetches.cache
        self.in_thread = fetches.in_thread
        self.upstream_url = upstream_url
        self.config = config
        self.counters = counters
        self.stopping = False
        self._slots: asyncio.Semaphore | None = None  # made on the loop, in start()
        self._warming: set[asyncio.Task[None]] = set()
        self._versions: dict[int, asyncio.Task[None]] = {}  # the newest versions' warms

    def start(self) -> None:
        shares = len(self.config.cluster_relays) if self.config.cluster_relays else 1
        self._slots = asyncio.Semaphore(self.config.warm_concurrency * shares)

    async def close(self) -> None:
        for task in list(self._warming):
            task.cancel()
        await asyncio.gather(*self._warming, return_exceptions=True)

    def warm_new(self, versions: list[int], fresh: bool) -> None:
        """(Loop) The feed learned of ``versions``: fetch them into the cache before anyone asks
        (when the feed has just started, only the newest: older ones are fetched on demand)."""
        if not self.config.warm or self.stopping or not versions:
            return
        for version in versions[-1:] if fresh else versions[-_WARM_BACKLOG:]:
            running = self._versions.get(version)
            if running is not None and not running.done():
                continue  # begun already (from a ref read: warm_ahead)
            task = asyncio.get_running_loop().create_task(self._warm(version))
            self._warming.add(task)
            task.add_done_callback(self._warming.discard)
            self._versions[version] = task
            for old in sorted(self._versions)[:-_WARM_BACKLOG]:
                del self._versions[old]

    def warm_ahead(self, ref: bytes, known: int) -> None:
        """(Loop) A reader's ``refs/latest``, read through from the upstream, names a version
        newer than ``known`` (the feed's newest): a reader polling the ref learns of a version
        before the upstream's event comes, and will read its manifest and packs next, so
        their fetches begin now, joined by its reads (the ref is only a hint: a version it
        names that is not there is a failed warm, nothing more)."""
        version = ref_hint(ref)
        if version is not None and version > known:
            self.warm_new([version], False)

    async def _warm(self, version: int) -> None:
        key = manifest_key(version)
        try:
            await self._warm_object(key)
            keys, total, sizes = await self.in_thread(self._version_objects, key, version)
            limit = self.cache.max_bytes
            if limit is not None and total > limit // 2:
                # Warming it would evict what agents behind it still read: leave it to demand.
                self.counters["warm_skipped"] += 1
                log.info("not warming version %d: %s bytes to fetch, over half the cache limit", version, f"{total:,}")
                return
            # Packs by the size their manifest names: their ranges requested at once, with the
            # manifest's round trip the only one before them (the bytes checked as always).
            await asyncio.gather(*(self._warm_object(k, sizes.get(k)) for k in keys))
            self.counters["warmed_versions"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.counters["warm_errors"] += 1
            log.warning("cannot warm version %d from %s: %s", version, self.upstream_url, e)

    async def land(self, key: str, data: bytes) -> None:
        """(Loop) ``data``, the upstream relay's copy of manifest ``key``, into the cache as a
        fetch of it (one flight: readers asking meanwhile join it), checked as every fetched
        manifest is; a copy refused is fetched from the upstream when next asked for."""
        if self.cache.lookup(key, touch=False) is not None or key in self.fetches.inflight:
            return
        source = MemoryStore("memory://upstream-copy")
        source.put(key, data)
        await asyncio.shield(self.fetches.fetch(key, warm=True, source=source).task)

    async def _warm_object(self, key: str, size_hint: int | None = None) -> None:
        assert self._slots is not None
        async with self._slots:
            if self.stopping or self.cache.lookup(key, touch=False) is not None:
                return
            await asyncio.shield(self.fetches.fetch(key, warm=True, size_hint=size_hint).task)

    def _version_objects(self, key: str, version: int) -> tuple[list[str], int, dict[str, int]]:
        """(Thread) The packs and blobs the cached manifest ``key`` names that the cache lacks,
        their bytes (blobs counted at their bound), and the packs' sizes as it names them."""
        entry = self.cache.lookup(key, touch=False)
        if entry is None:
            raise CorruptObjectError(key, "evicted before it could be read")
        info = parse_manifest(entry.path.read_bytes(), expect_version=version)
        sizes = {p.key: p.size for p in info.pb.packs}
        for f in info.pb.files:
            if f.kind == manifest_pb.File.BLOB:
                sizes.update(dict.fromkeys((blob_key(d) for d in f.blob_parts), BLOB_PART_SIZE))
        missing = [k for k in sizes if self.cache.lookup(k, touch=False) is None]  # the manifest's order
        for k in missing:
            check_key(k)
        return missing, sum(sizes[k] for k in missing), {p.key: p.size for p in info.pb.packs}

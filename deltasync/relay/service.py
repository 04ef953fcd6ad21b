"""The relay's gRPC service: Get, Stat, List, Watch, Put, Upload and Delete, bound by hand to the
methods of the wire definition (:mod:`deltasync.storage.wire`). Each call is answered here and
its work done by the relay's parts: fetches (:mod:`.fetch`), the version feed and warming
(:mod:`.feed`), uploads (:mod:`.uploads`). A failure ends the call with the status code the
wire's table gives its error (:data:`~deltasync.storage.wire.STATUS_CODES`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc

from ..errors import CorruptObjectError, ObjectNotFoundError, ObjectRangeError
from ..repo.repository import LATEST
from ..storage import GrpcStore, Store, check_key
from ..storage.wire import (
    CHUNK_BYTES,
    LIST_BATCH,
    MAX_OFFSET,
    METHODS,
    SERVICE,
    UPLOAD_CHECKS,
    UPLOAD_COMMITS,
    UPLOAD_WAITS,
    status_code,
)
from ..v1 import relay_pb2 as pb
from .auth import HANDLER_FACTORIES, check_served, check_writable
from .cache import SERVED_KEYS, SERVED_PREFIXES, CacheFullError, ObjectCache, cacheable, served
from .config import RelayConfig
from .feed import VersionFeed, Warmer
from .fetch import Fetches, FetchFailed, Source
from .push import PushedPacks
from .shares import PEER_METADATA
from .uploads import SESSION_IDLE_SECONDS, Budget, Refused, SendCredit, Session, Turn, Uploads, piece_data

log = logging.getLogger("deltasync.relay")

T = TypeVar("T")

_FLUSH_EVERY = 30.0  # seconds between writes of access times to the cache index


class RelayService:
    """The seven RPCs. Lives on the relay event loop; blocking work goes to ``executor``."""

    def __init__(
        self, upstream: Store, upstream_url: str, cache: ObjectCache, executor: ThreadPoolExecutor, config: RelayConfig
    ) -> None:
        self.upstream = upstream
        self.upstream_url = upstream_url
        self.cache = cache
        self.executor = executor
        self.config = config
        self.stopping = False
        self._flusher: asyncio.Task[None] | None = None
        self.counters = {
            "requests": 0, "served_bytes": 0, "cache_hits": 0, "coalesced": 0, "watchers": 0,
            "uploads": 0, "uploaded_bytes": 0, "uploads_refused": 0, "deletes": 0,
            "streamed": 0, "fetch_errors": 0,
            "warmed_versions": 0, "warm_fetches": 0, "warm_skipped": 0, "warm_errors": 0,
            "pushed_bytes": 0,
        }
        self.fetches = Fetches(upstream, cache, config, self.in_thread, self.counters)
        self.warmer = Warmer(self.fetches, upstream_url, config, self.counters)
        self.feed = VersionFeed(upstream, self.in_thread, lambda: self.counters["watchers"], config, self.warmer.warm_new,
                                fetches=self.fetches, on_manifest=self.warmer.land)
        if isinstance(upstream, GrpcStore) and config.push_bytes and config.warm and config.cluster_relays is None:
            self.feed.pushes = PushedPacks(upstream, config.push_bytes)
        self.uploads = Uploads(upstream, cache, config, self.in_thread)
        # A publish through this relay ends with the latest ref: its watchers hear of the
        # version from that write, not a poll later.
        self.uploads.on_stored = lambda key: self.feed.poke() if key == LATEST else None

    def handler(self) -> Any:
        behaviors: dict[str, Callable[..., Any]] = {
            "Get": self.get, "Stat": self.stat, "List": self.list, "Watch": self.watch,
            "Put": self.put, "Upload": self.upload, "UploadSession": self.upload_session, "Delete": self.delete,
        }
        handlers: dict[str, Any] = {}
        for name, (request, response, kind) in METHODS.items():
            factory = HANDLER_FACTORIES[kind]
            # Upload's messages are taken as they came (see Uploads.piece_data): grpc hands the bytes over.
            decode = None if name in ("Upload", "UploadSession") else request.FromString
            handlers[name] = factory(
                behaviors[name], request_deserializer=decode, response_serializer=response.SerializeToString
            )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def start(self) -> None:
        self.uploads.start()
        self.warmer.start()
        self._flusher = asyncio.get_running_loop().create_task(self._flush_periodically())

    def begin_stop(self) -> None:
        self.stopping = self.warmer.stopping = True
        self.feed.wake()

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        await self.feed.close()
        await self.warmer.close()

    def metrics(self) -> dict[str, int]:
        out = dict(self.counters)
        out.update(
            upstream_fetches=self.cache.fetches,
            upstream_bytes=self.cache.fetched_bytes,
            evictions=self.cache.evictions,
            cached_objects=len(self.cache),
            cached_bytes=self.cache.total_bytes,
            fetching=len(self.fetches.inflight),
            following_upstream=int(self.feed.running),
        )
        out["manifest_waits"] = self.uploads.waited  # manifests whose check waited for their packs' uploads
        out["manifest_rechecks"] = self.uploads.rechecked  # checked again after another upload ended
        out["manifest_pending_waits"] = self.uploads.pending_waited  # waited for packs said to be on their way
        out["commits_here"] = self.uploads.committed  # manifests committed here: ref, lease, check after
        pushes = self.feed.pushes
        if pushes is not None:  # packs the upstream relay pushed: taken from the push, or read after all
            out.update(push_landed=pushes.landed, push_missed=pushes.missed)
        return out

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(_FLUSH_EVERY)
            try:
                await self.in_thread(self.cache.flush)
            except Exception as e:  # a full disk must not stop the relay serving
                log.warning("cannot write the cache index: %s", e)

    async def _abort(self, context: Any, e: BaseException, key: str | None, *, fetch: bool = False,
                     sent: int = 0) -> NoReturn:
        """End the call with the status code that tells the client what happened: the wire
        table's for ``e``. With ``fetch``, ``e`` is why the upstream fetch of the object a Get
        waits for failed (``sent`` bytes of it already sent): never the reader's fault, so a
        range or an argument the relay's own fetch got wrong is damage (DATA_LOSS) or the
        upstream failing (UNAVAILABLE), and the client retries, here or at another relay,
        resuming where it stopped."""
        after = f" after {sent:,} bytes were sent" if sent else ""
        name = status_code(e)
        if fetch and name in ("OUT_OF_RANGE", "INVALID_ARGUMENT"):
            name = "DATA_LOSS" if isinstance(e, ObjectRangeError) else "UNAVAILABLE"
        if name == "NOT_FOUND":
            message = f"object not found: {key}"
        elif name == "ALREADY_EXISTS":
            message = f"object already exists: {key}"
        elif isinstance(e, CorruptObjectError):
            message = f"{e.detail} (fetching {key} from the upstream{after})" if fetch else e.detail
        elif name == "INVALID_ARGUMENT":
            message = str(e)
        elif name is not None:
            log.warning("upstream %s: %s", self.upstream_url, e)
            message = f"relay upstream {self.upstream_url}: {e}{after}"
        elif isinstance(e, OSError):
            log.error("cache %s: %s", self.cache.root, e)
            name, message = "UNAVAILABLE", f"relay cache error: {e.strerror or e}"
        elif fetch:
            log.error("relay error fetching %s: %s: %s", key, type(e).__name__, e)
            name, message = "UNAVAILABLE", f"relay error fetching {key}: {type(e).__name__}: {e}"
        else:
            log.exception("relay error serving %s", key)
            name, message = "INTERNAL", f"relay error: {type(e).__name__}: {e}"
        await context.abort(grpc.StatusCode[name], message)
        raise AssertionError("unreachable: abort raises")

    # -- Get, Stat, List -------------------------------------------------------------------------

    async def get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetChunk]:
        self.counters["requests"] += 1
        key = request.key
        byte_range = (request.offset, request.length) if request.has_range else None
        source: Source | None = None
        try:
            check_served(key)
            if byte_range is not None and (byte_range[0] > MAX_OFFSET or byte_range[1] > MAX_OFFSET):
                raise ObjectRangeError(key, f"range {byte_range[0]}+{byte_range[1]} is past the end of any object")
            if cacheable(key):
                source = await self.fetches.open_cached(key, for_peer=_from_peer(context))
                offset, length = byte_range if byte_range is not None else (0, source.size)
                if offset + length > source.size:
                    raise ObjectRangeError(key, f"range {offset}+{length} past end of {source.size}-byte object")
        except FetchFailed as e:
            if not isinstance(e.cause, CacheFullError):
                await self._abort(context, e.cause, key, fetch=True)
            # The cache's disk cannot take it even with everything evictable gone: served from
            # the upstream as it is read, not cached (the reader checks it, as every reader does).
            self.counters["passed_through"] = self.counters.get("passed_through", 0) + 1
        except Exception as e:
            if source is not None:
                source.close(self.cache)
            await self._abort(context, e, key)
        if source is None:
            copy = self.feed.hint(key) if byte_range is None else None
            if copy is not None and not copy.key.endswith("/"):
                # The upstream relay sent it with its newest event (feed.py): no read across the
                # link. A hint, as any read through a relay is: the reader checks it.
                if copy.absent:
                    await self._abort(context, ObjectNotFoundError(key), key)
                self.counters["hinted"] = self.counters.get("hinted", 0) + 1
                self.counters["served_bytes"] += len(copy.data)
                yield pb.GetChunk(data=copy.data, total_bytes=len(copy.data))
                return
            # Refs and the marker: never cached, never held whole (a hostile upstream's 2 GiB
            # refs/latest passes through in 1 MiB pieces).
            try:
                async for chunk in self.fetches.from_upstream(key, byte_range):
                    self.counters["served_bytes"] += len(chunk.data)
                    if key == LATEST and byte_range is None:  # (one chunk: a ref is small)
                        self.warmer.warm_ahead(chunk.data, self.feed.latest)
                    yield chunk
            except Exception as e:
                await self._abort(context, e, key)
            return
        position = offset
        try:
            async for piece in self._pieces_of(source, offset, length):
                self.counters["served_bytes"] += len(piece)
                yield pb.GetChunk(data=piece, total_bytes=length if position == offset else 0)
                position += len(piece)
        except FetchFailed as e:
            await self._abort(context, e.cause, key, fetch=True, sent=position - offset)
        except _Truncated as e:
            await context.abort(grpc.StatusCode.DATA_LOSS, str(e))
        finally:
            source.close(self.cache)

    async def _pieces_of(self, source: Source, offset: int, length: int) -> AsyncIterator[bytes]:
        """``length`` bytes of ``source`` from ``offset``, a piece (1 MiB) at a time, each once it
        has arrived (an object still being fetched). FetchFailed: its fetch failed; _Truncated:
        the cache file was damaged under us (forgotten: fetched again next time)."""
        position, end = offset, offset + length
        while True:
            n = min(CHUNK_BYTES, end - position)
            if source.flight is not None:  # still arriving: wait until these bytes are in
                landing = await source.flight.covering(position + n)
                if landing.error is not None:
                    raise FetchFailed(landing.error)
                if landing.verified:
                    source.flight = None
            piece = await self.in_thread(os.pread, source.fd, n, position) if n else b""
            if len(piece) != n:
                if source.entry is not None:
                    self.cache.forget(source.key, source.entry)
                raise _Truncated(f"relay cache file of {source.key} is truncated")
            yield piece
            position += n
            if position >= end:
                return

    async def stat(self, request: pb.StatRequest, context: Any) -> pb.StatResponse:
        self.counters["requests"] += 1
        key = request.key
        try:
            check_served(key)
            known = self.fetches.known_size(key) if cacheable(key) else None
            copy = self.feed.hint(key) if known is None else None
            if copy is not None and not copy.key.endswith("/"):
                if copy.absent:
                    raise ObjectNotFoundError(key)
                known = len(copy.data)
            size = known if known is not None else await self.in_thread(self.upstream.size, key)
        except Exception as e:
            await self._abort(context, e, key)
        return pb.StatResponse(size=size)

    async def list(self, request: pb.ListRequest, context: Any) -> AsyncIterator[pb.ListResponse]:
        self.counters["requests"] += 1
        prefix = request.prefix
        try:
            if prefix:
                check_key(prefix.rstrip("/"))
            copy = self.feed.hint(prefix) if prefix.endswith("/") else None
            if copy is not None:  # a listing the upstream relay sent with its newest event
                keys = list(copy.keys)
            else:
                keys = await self.in_thread(_layout_keys, self.upstream, prefix)
        except Exception as e:
            await self._abort(context, e, prefix or None)
        for start in range(0, len(keys), LIST_BATCH):
            yield pb.ListResponse(keys=keys[start : start + LIST_BATCH])

    # -- Put, Delete ---------------------------------------------------------------------------

    async def put(self, requests: AsyncIterator[pb.PutChunk], context: Any) -> pb.PutResponse:
        """The old upload (clients before Upload): not held back by credit, so grpc may park
        up to a window of its bytes while it waits for its turn; that window is charged to
        the upload budget until the call ends, and a call it does not fit is refused with
        UNAVAILABLE (the client tries another relay, then again)."""
        self.counters["requests"] += 1
        if not self.config.accept_writes:  # the interceptor refuses first; kept for library use
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this relay does not accept writes")
        parked = self.config.upload_window
        if not self.uploads.budget.take(parked):
            self.counters["uploads_refused"] += 1
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the relay's upload budget ({self.config.upload_buffer:,} bytes) is taken: a Put holds a "
                f"{parked:,}-byte window of it (clients that use Upload are not refused; try again)",
            )
        try:
            size = await self._upload(requests, context, None, lambda chunk: memoryview(chunk.data))
        finally:
            self.uploads.budget.give(parked)
        self.counters["uploads"] += 1
        self.counters["uploaded_bytes"] += size
        return pb.PutResponse()

    async def upload(self, requests: AsyncIterator[bytes], context: Any) -> None:
        """An upload under the relay's byte credit (:mod:`.uploads`): the credit messages are
        written to the call as the budget grants them; the call ends OK once it is stored."""
        self.counters["requests"] += 1
        if not self.config.accept_writes:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this relay does not accept writes")
        size = await self._upload(requests, context, context.write, piece_data)
        self.counters["uploads"] += 1
        self.counters["uploaded_bytes"] += size

    async def upload_session(self, requests: AsyncIterator[bytes], context: Any) -> None:
        """Objects one after another under credit that outlives each (:class:`.uploads.Session`):
        each is answered ``stored`` once written; the call ends OK when the client closes it,
        when it has waited :data:`SESSION_IDLE_SECONDS` for a header, or at once when it is idle
        holding standing credit another upload waits for (the client sends an object whose
        header was not answered again, on a new call)."""
        self.counters["requests"] += 1
        if not self.config.accept_writes:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this relay does not accept writes")
        # What it checks (uploads.missing_references) and that it waits for the uploads it is
        # receiving of what a manifest names (uploads.Uploads.references_landed); before any credit.
        # And that it commits a manifest sent with commit_latest (uploads.Uploads._commit_here).
        await context.send_initial_metadata(
            ((UPLOAD_CHECKS[0], f"{UPLOAD_CHECKS[1]},{UPLOAD_WAITS},{UPLOAD_COMMITS}"),))
        loop = asyncio.get_running_loop()
        budget = self.uploads.budget
        call = _SessionCall(context)
        session = Session(call.write, budget, self.config.upload_window)
        inbox: asyncio.Queue[Any] = asyncio.Queue(maxsize=1)
        reader = loop.create_task(_read_into(aiter(requests), inbox))
        call.granter = loop.create_task(session.keep_granting())
        try:
            while True:
                head = await _next_header(inbox, session, budget)
                if head is None:
                    return
                size = await self._upload(_object_messages(head, inbox), call, None, piece_data, session)
                # Counted before the answer: a client that saw ``stored`` sees the relay's counters too.
                self.counters["uploads"] += 1
                self.counters["uploaded_bytes"] += size
                await session.answer_stored()
        finally:
            reader.cancel()
            try:
                await call.stop_granting()
            finally:
                if call.granter is not None:  # stopping was itself cancelled: the granter goes now
                    call.granter.cancel()
                budget.give(session.granted - session.landed)  # granted, never sent (or never landed)

    async def _upload(self, requests: AsyncIterator[Any], context: Any, send_credit: SendCredit | None,
                      data_of: Callable[[Any], memoryview], session: Session | None = None) -> int:
        """Take one upload (its turn first); its size, or the call aborted with why not.
        ``data_of``: a message's piece of the object."""
        assert self.uploads.turn is not None
        key = ""
        size = 0
        turn = Turn(self.uploads.turn, self.uploads.budget)
        await turn.take()  # bounds the spool: max_uploads objects received at once
        try:
            try:
                messages = aiter(requests)
                head = await anext(messages, None)
                if head is None:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "empty upload (no header)")
                first = head if isinstance(head, pb.PutChunk) else _header(head)
                key, size = first.key, first.total_bytes
                await self.uploads.take(first, _pieces(messages, data_of), send_credit, session, turn)
            except Refused as e:
                self.counters["uploads_refused"] += 1
                log.log(e.log_level, "refused upload of %s: %s", key or "?", e.message)
                await context.abort(e.code, e.message)
            except Exception as e:
                await self._abort(context, e, key or None)
        finally:
            turn.give()
        return size

    async def delete(self, request: pb.DeleteRequest, context: Any) -> pb.DeleteResponse:
        self.counters["requests"] += 1
        if not self.config.accept_writes:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this relay does not accept writes")
        key = request.key
        try:
            check_writable(key)
            await self.in_thread(self.uploads.delete, key)
        except Exception as e:
            await self._abort(context, e, key)
        self.counters["deletes"] += 1
        return pb.DeleteResponse()

    # -- Watch ---------------------------------------------------------------------------------

    async def watch(self, request: pb.WatchRequest, context: Any) -> AsyncIterator[pb.VersionEvent]:
        self.counters["requests"] += 1
        self.counters["watchers"] += 1
        feed = self.feed
        feed.start()
        last = request.after_version
        caught_up = False  # the first event carries only the newest version
        sent_at = time.monotonic()
        try:
            while True:
                changed = feed.changed  # taken before looking, so no change slips between
                if self.stopping:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "relay is shutting down")
                reason = feed.unavailable()
                if reason is not None:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, f"relay cannot reach its upstream {self.upstream_url}: {reason}"
                    )
                new = feed.after(last) if feed.succeeded else []
                if new and not caught_up:
                    new = new[-1:]
                caught_up = caught_up or feed.succeeded
                for version in new:
                    copies = await asyncio.shield(feed.copies(version)) if version == feed.latest else []
                    pushed = await asyncio.shield(feed.push_plan(version)) if copies and request.push_bytes else []
                    if sum(p.size for p in pushed) > request.push_bytes:
                        pushed = []
                    yield pb.VersionEvent(version=version, latest=feed.latest, copies=copies, pushed=pushed)
                    last = version
                    async for piece in self._push(pushed):
                        yield pb.VersionEvent(version=0, latest=feed.latest, piece=piece)
                    sent_at = time.monotonic()
                wait = self.config.keepalive_interval - (time.monotonic() - sent_at)
                if wait <= 0:
                    yield pb.VersionEvent(version=0, latest=feed.latest)
                    sent_at = time.monotonic()
                    continue
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), wait)
        finally:
            self.counters["watchers"] -= 1

    async def _push(self, objects: Sequence[pb.PushedObject]) -> AsyncIterator[pb.PushedPiece]:
        """The pieces of ``objects`` (a version's packs, pushed to a relay watching: feed.py),
        from the cache, each pack as it arrives when still being fetched; a pack that cannot be
        sent whole is sent as dropped (the watcher reads it as before)."""
        for obj in objects:
            key, sent = obj.key, 0
            try:
                source = await self.fetches.open_cached(key)
            except Exception as e:
                log.info("not pushing %s to a watching relay: %s", key, e)
                yield pb.PushedPiece(key=key, dropped=True)
                continue
            try:
                if source.size != obj.size:
                    raise CorruptObjectError(key, f"{source.size} bytes, its manifest names {obj.size}")
                async for data in self._pieces_of(source, 0, source.size):
                    yield pb.PushedPiece(key=key, offset=sent, data=data)
                    sent += len(data)
                    self.counters["served_bytes"] += len(data)
                    self.counters["pushed_bytes"] += len(data)
            except (FetchFailed, _Truncated, CorruptObjectError) as e:
                log.info("not pushing %s to a watching relay: %s", key, e)
                yield pb.PushedPiece(key=key, offset=sent, dropped=True)
            finally:
                source.close(self.cache)


class _Truncated(Exception):
    """A cache file shorter than its object (damaged under the relay)."""


async def _pieces(messages: AsyncIterator[Any], data_of: Callable[[Any], memoryview]) -> AsyncIterator[memoryview]:
    """The data of each message, held by nothing here while the next one is awaited (a piece
    kept alive across that wait would be one more megabyte per upload beyond its credit)."""
    async for message in messages:
        piece = data_of(message)
        del message
        yield piece
        del piece


_EOF = object()


class _SessionCall:
    """An UploadSession's context, its writes one at a time: grpc takes one write (or the
    status) in progress on a call, and the credit granter writes while the session answers
    ``stored`` or aborts. The granter is stopped between writes, never inside one."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.lock = asyncio.Lock()
        self.granter: asyncio.Task[None] | None = None

    async def write(self, message: pb.UploadCredit) -> None:
        async with self.lock:
            await self.context.write(message)

    async def stop_granting(self) -> None:
        async with self.lock:
            if self.granter is not None:
                self.granter.cancel()  # not inside a write: that holds the lock
                self.granter = None

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        await self.stop_granting()
        async with self.lock:
            await self.context.abort(code, details)
        raise AssertionError("abort returned")  # pragma: no cover - context.abort raises

    def __getattr__(self, name: str) -> Any:
        return getattr(self.context, name)


async def _read_into(messages: AsyncIterator[Any], inbox: asyncio.Queue[Any]) -> None:
    """An UploadSession's messages into ``inbox`` (one at a time), then :data:`_EOF` or the error."""
    try:
        async for message in messages:
            await inbox.put(message)
            del message
        await inbox.put(_EOF)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        await inbox.put(e)


async def _next_header(inbox: asyncio.Queue[Any], session: Session, budget: Budget) -> Any:
    """The next object's header, or None when the session ends: the client closed it, it waited
    :data:`SESSION_IDLE_SECONDS`, or it holds standing credit another upload waits for."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SESSION_IDLE_SECONDS
    get = loop.create_task(inbox.get())
    try:
        while not get.done():
            now = loop.time()
            if now >= deadline:
                return None
            if budget.waiting:
                if session.standing:
                    return None  # give it back: the client sends its next object on a new call
                await asyncio.wait({get}, timeout=min(0.1, deadline - now))  # look again: it may get some
            else:
                wanted = loop.create_task(budget.wanted.wait())
                try:
                    await asyncio.wait({get, wanted}, timeout=deadline - now, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wanted.cancel()
        item = get.result()
    finally:
        get.cancel()
    if item is _EOF:
        return None
    if isinstance(item, BaseException):
        raise item
    return item


async def _object_messages(head: Any, inbox: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    """One object's messages of an UploadSession: its header, then those that carry its bytes
    (up to its size; the call ending first is a short upload, refused as such)."""
    yield head
    first = head if isinstance(head, pb.PutChunk) else _header(head)
    remaining = first.total_bytes - len(first.data)
    del head, first
    while remaining > 0:
        item = await inbox.get()
        if item is _EOF:
            return
        if isinstance(item, BaseException):
            raise item
        remaining -= len(piece_data(item))
        yield item
        del item


def _header(raw: bytes) -> pb.PutChunk:
    try:
        return pb.PutChunk.FromString(raw)
    except Exception:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "the upload's header is not a PutChunk") from None


def _layout_keys(upstream: Store, prefix: str) -> list[str]:
    """(Thread) Keys under ``prefix`` within the repository layout only: the upstream is
    listed under the layout's prefixes, so nothing else of it is shown (or walked)."""
    keys: list[str] = []
    for top in sorted((*SERVED_PREFIXES, *SERVED_KEYS)):
        if top.startswith(prefix):
            listed = upstream.list(top)
        elif top.endswith("/") and prefix.startswith(top):
            listed = upstream.list(prefix)
        else:
            continue
        keys.extend(k for k in listed if served(k) and k.startswith(prefix))
    return sorted(keys)


def _from_peer(context: Any) -> bool:
    """Whether a call comes from another relay of the cluster reading a piece (relay/shares.py)."""
    return any(key == PEER_METADATA for key, _ in context.invocation_metadata() or ())

"""Writes through a relay (``accept_writes``): an upload is taken in pieces of at most 1 MiB,
into memory up to :data:`SPOOL_BYTES` and into a :class:`Spool` file beyond, checked whole (its
size, the digest its header announced, :func:`content_problem`, :func:`missing_references`),
and only then written with the upstream store's own atomic put; :class:`Quota` keeps the
repository under ``write_quota``. At most ``max_uploads`` are received at once
(:attr:`Uploads.turn`).

Memory is one budget for every upload together (``upload_buffer``, :class:`Budget`), not a
window per stream: grpcio's flow-control settings are per server, so a window large enough to
fill a long link, times many uploaders, would be any amount. An Upload call (the path clients
use) sends only within the byte credit the relay grants it (:class:`Credit`): a small upload
is granted its whole size at once if it fits in the budget (held in memory, then written);
any other is spooled to a file and granted at most ``upload_window`` ahead of the bytes
written to the file, each grant taken from the budget and given back as the pieces land on
disk. However many upload at once, the bytes of uploads in the relay's memory (granted, not
yet on disk) stay within the budget; one that waits for its turn or for the budget is granted
nothing and sends nothing but its header (which may carry a whole object of at most
``UNCREDITED_BYTES``, 256 KiB: a lease, a ref, a manifest in one round trip). An
UploadSession call (what clients use now) carries objects one after another under one
:class:`Session` credit that outlives each object, so the next object's first bytes need no
grant of their own (that credit, too, from the budget, and only while no upload waits).
The old Put (clients before Upload) cannot be held
back that way: grpc may park up to a window of its bytes before the relay reads them, so each
Put call is charged one window from the same budget while it waits and runs, and refused
(UNAVAILABLE: the client tries again, at another relay or a moment later) when it does not
fit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import re
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from ..errors import ObjectNotFoundError, UsageError
from ..format.digest import digest
from ..format.manifest import manifest_key, version_from_key
from ..repo.leases import is_lease_key
from ..repo.repository import LATEST, blob_key
from ..storage import LocalStore, Store, check_key
from ..storage.wire import CHUNK_BYTES, UNCREDITED_BYTES
from ..v1 import manifest_pb2 as manifest_pb, relay_pb2 as pb
from .auth import check_writable
from .cache import ObjectCache, cacheable, content_problem, size_limit
from .config import RelayConfig
from .fetch import InThread

log = logging.getLogger("deltasync.relay")

_MANIFEST_KEY = re.compile(r"^(manifests/\d{20}\.pb|squashes/\d{20}-\d{20}\.pb)$")
#: Threads one commit done here (``commit_latest``) checks its manifest's objects on.
COMMIT_CHECKS = 16


MANIFEST_WAIT_SECONDS = 10.0
"""How long a manifest whose packs are missing may wait for them before it is refused: holding
its turn, for the uploads this relay is receiving meanwhile (:meth:`Uploads._another_landed`);
or, when its header says they are on their way (``references_pending``), without its turn, for
them to land here or in the repository through another relay (:meth:`Uploads._pending_landed`)."""
PENDING_POLL_SECONDS = (0.005, 0.05)
"""How often a manifest whose packs are on their way looks for them in the repository (they may
come through another relay): first after 5 ms, then each time twice as long, at most every 50 ms
(on S3, a request per missing object each time)."""

#: Uploads larger than this are always spooled to a file as they arrive (a pack, typically).
SPOOL_BYTES = 4 << 20
UPLOAD_WINDOW_BYTES = 32 << 20
"""The default of ``upload_window``: how far ahead of the bytes on disk one upload is granted
credit (and grpc's flow-control window of a stream, which must not be the smaller). Over a
long link an upload moves about this per round trip: 32 MiB is some 160 MiB/s at 200 ms, so
one publisher fills an 800 Mbit/s link to the other side of the planet with one stream; the
budget (``upload_buffer``), not this, bounds the memory of all uploads together."""

#: Sends one credit message to the client (grpc's ``context.write``).
SendCredit = Callable[[pb.UploadCredit], Awaitable[None]]


class Budget:
    """(Loop) Bytes of uploads in the relay's memory, all uploads together (``upload_buffer``):
    small uploads held whole until written, the credit granted to spooled ones and not yet on
    disk, a window for each old Put call."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._waiters: list[asyncio.Future[None]] = []
        self.waiting = 0  # uploads waiting for room (grant()) or for their turn (turn())
        self.wanted = asyncio.Event()  # set while any is (made unbound: any loop may wait on it)

    def take(self, n: int) -> bool:
        """Reserve ``n`` bytes if they fit (True), else nothing."""
        if self.used + n > self.limit:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    async def grant(self, want: int, least: int) -> int:
        """Reserve up to ``want`` bytes, waiting until at least ``least`` (at most the limit) fit."""
        least = min(least, want, self.limit)
        while self.limit - self.used < least:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            self.want(1)
            try:
                await waiter
            finally:
                self.want(-1)
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        n = min(want, self.limit - self.used)
        self.used += n
        self.peak = max(self.peak, self.used)
        return n

    def want(self, n: int) -> None:
        """One more (1) or one fewer (-1) upload waiting: for this budget, or for its turn."""
        self.waiting += n
        if self.waiting:
            self.wanted.set()
        else:
            self.wanted.clear()

    async def turn(self, turn: asyncio.Semaphore) -> None:
        """Acquire an upload's turn, counted as waiting while it waits (standing credit is then
        neither granted nor kept: :class:`Session`)."""
        if not turn.locked():
            await turn.acquire()
            return
        self.want(1)
        try:
            await turn.acquire()
        finally:
            self.want(-1)

    def give(self, n: int) -> None:
        if n <= 0:
            return
        self.used -= n
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:  # each looks again; those that still do not fit wait again
            if not waiter.done():
                waiter.set_result(None)


class Turn:
    """(Loop) One upload's place among the ``max_uploads`` received at once (``places``): taken
    before its header is read, given back when it ends, and lent while a manifest waits for
    packs on their way (:meth:`lent`), which may need a place to arrive."""

    def __init__(self, places: asyncio.Semaphore, budget: Budget) -> None:
        self.places = places
        self.budget = budget
        self.held = False

    async def take(self) -> None:
        await self.budget.turn(self.places)
        self.held = True

    def give(self) -> None:
        if self.held:
            self.held = False
            self.places.release()

    @contextlib.asynccontextmanager
    async def lent(self) -> AsyncIterator[None]:
        """Without the place meanwhile; taken again after, unless what ran without it raised
        (the upload ends: there is nothing to give back then, nor after a cancellation while
        it waits for the place again)."""
        self.give()
        yield
        await self.take()


class Credit:
    """(Loop) One Upload call's credit: ``granted`` bytes the client may have sent (taken from
    the budget), ``landed`` of them on disk or in the upload's memory for good (given back, for
    a spooled upload, as they land)."""

    def __init__(self, send: SendCredit) -> None:
        self.send = send
        self.granted = 0
        self.landed = 0
        self.progress = asyncio.Event()

    async def grant_all(self, size: int, send: bool = True) -> None:
        """A small upload held in memory: its whole size, already taken from the budget (sent
        to the client unless it came whole in the header)."""
        self.granted = size
        if send:
            await self.send(pb.UploadCredit(send_until=size))

    async def keep_granting(self, budget: Budget, size: int, ahead: int) -> None:
        """A spooled upload: credit up to ``ahead`` bytes past what landed, while the budget
        has it, until the whole size is granted."""
        while self.granted < size:
            need = min(CHUNK_BYTES, size - self.granted, ahead)  # a window under 1 MiB: pieces of it
            room = ahead - (self.granted - self.landed)
            if room < need:
                self.progress.clear()
                await self.progress.wait()
                continue
            self.granted += await budget.grant(min(room, size - self.granted), need)
            await self.send(pb.UploadCredit(send_until=self.granted))

    def landed_piece(self, n: int, budget: Budget | None) -> None:
        self.landed += n
        if budget is not None:
            budget.give(n)
        self.progress.set()
SESSION_IDLE_SECONDS = 10.0
"""How long an UploadSession may wait for its next header before the relay ends it (it ends
at once when it is idle holding credit that another upload waits for)."""


class Session:
    """(Loop) One UploadSession call's credit, counted over all its objects together: the client
    may send to ``granted`` (taken from the budget); ``received`` arrived; ``landed`` of them
    are on disk or written (given back). ``end`` is where the object in progress (or the last
    one) ends. Credit is granted up to ``ahead`` past ``landed``; past ``end`` (the *standing*
    credit the next object's first bytes use, so they go out with its header) only once an
    object has begun, from room the budget has now, while no other upload waits (for the
    budget or for its turn: :meth:`Budget.turn`), so an uploader waiting for its turn is
    granted nothing, and an idle session never holds what a waiting upload needs for long
    (``RelayService.upload_session`` then ends the call)."""

    def __init__(self, send: SendCredit, budget: Budget, ahead: int) -> None:
        self.send = send
        self.budget = budget
        self.ahead = ahead
        self.granted = 0
        self.received = 0
        self.landed = 0
        self.end = 0
        self.stored = 0
        self.started = False  # no standing credit before the first object: it comes with its header
        self.progress = asyncio.Event()
        self.gone: list[str] = []  # a manifest committed here (commit_latest): what is missing after
        self.unchecked = False  # ... or that it could not be checked

    @property
    def standing(self) -> int:
        """Credit granted past the object in progress (idle: the next object's)."""
        return max(0, self.granted - self.end)

    def begin(self, credited: int) -> None:
        """A new object of ``credited`` bytes (those not in its header) starts at ``received``."""
        self.end = self.received + credited
        self.started = True
        self.progress.set()

    def landed_piece(self, n: int) -> None:
        self.landed += n
        self.budget.give(n)
        self.progress.set()

    async def keep_granting(self) -> None:
        """Runs for the whole call (cancelled at its end)."""
        budget = self.budget
        while True:
            self.progress.clear()
            room = self.landed + self.ahead - self.granted
            if self.granted < self.end:  # the object in progress: wait for the budget if need be
                need = min(CHUNK_BYTES, self.end - self.granted, self.ahead)  # a window under 1 MiB: pieces of it
                if room >= need:
                    self.granted += await budget.grant(min(room, self.end - self.granted), need)
                    await self._send()
                    continue
            elif self.started and not budget.waiting:  # standing credit: only what is free now, and not wanted
                n = min(room, budget.limit - budget.used)
                if n >= min(CHUNK_BYTES, self.ahead) and budget.take(n):
                    self.granted += n
                    await self._send()
                    continue
            await self.progress.wait()

    async def _send(self) -> None:
        await self.send(pb.UploadCredit(send_until=self.granted))

    async def answer_stored(self) -> None:
        self.stored += 1
        gone, unchecked, self.gone, self.unchecked = self.gone, self.unchecked, [], False
        await self.send(pb.UploadCredit(send_until=self.granted, stored=self.stored, gone=gone, unchecked=unchecked))


def piece_data(raw: bytes) -> memoryview:
    """The data (field 5) of a serialized PutChunk, a view of ``raw`` rather than a copy: a
    1 MiB piece is then held once in the relay's memory, not three times over (grpc's message,
    the decoded message, its bytes). A message with any other field is decoded whole."""
    if len(raw) > 1 and raw[0] == 0x2A:  # field 5, length-delimited
        length, shift, pos = 0, 0, 1
        while pos < len(raw) and shift < 64:
            byte = raw[pos]
            length |= (byte & 0x7F) << shift
            pos += 1
            if not byte & 0x80:
                if pos + length == len(raw):
                    return memoryview(raw)[pos:]
                break
            shift += 7
    return memoryview(pb.PutChunk.FromString(raw).data)


class Spool:
    """(Threads) One upload written to a new file under ``directory`` as its pieces arrive,
    then mapped read-only (:meth:`view`) for the checks and the upstream put; :meth:`close`
    removes it. The directory is the cache's ``tmp/``, cleared when a relay starts, so a
    relay killed mid-upload leaves nothing behind for long."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"upload-{uuid.uuid4().hex}"
        self._file = open(self.path, "x+b")  # noqa: SIM115 - closed by close(); readable, for mmap
        self._map: mmap.mmap | None = None

    def write(self, data: bytes | memoryview) -> None:
        self._file.write(data)

    def view(self) -> memoryview:
        self._file.flush()
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(self._map)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: the mapping goes with it
                self._map.close()
        self._file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class Refused(Exception):
    """An upload the relay will not write, with the status code that says why."""

    log_level = logging.WARNING
    """How the relay logs it."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class MissingReferences(Refused):
    """A manifest or squash that names objects the repository lacks (``missing``)."""

    # One that came ahead of a pack it names (a publisher sends it while its last packs are on
    # their way, wire.UPLOAD_WAITS) is put again once they are stored; the publisher raises
    # if the pack never comes. Not a warning.
    log_level = logging.INFO

    def __init__(self, key: str, missing: list[str]) -> None:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION,
                         f"{key} names objects the repository lacks ({missing[0]}{more}): upload them before the manifest")
        self.missing = missing


#: A manifest or squash as uploaded: it parsed, and the keys of the packs and blobs it names, sorted.
Referenced = tuple[manifest_pb.Manifest, list[str]]


def referenced(key: str, data: bytes | bytearray | memoryview) -> Referenced | None:
    """(Thread) For a manifest or squash: it parsed, and the keys of the packs and blobs it
    names (Refused: not a manifest, or an invalid key); None for any other object."""
    if not _MANIFEST_KEY.match(key):
        return None
    try:
        manifest = manifest_pb.Manifest.FromString(bytes(data))  # small: capped by size_limit on arrival
    except Exception:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{key} is not a manifest") from None
    keys = sorted({p.key for p in manifest.packs}
                  | {blob_key(part) for f in manifest.files if f.kind == manifest_pb.File.BLOB for part in f.blob_parts})
    for k in keys:
        try:
            check_key(k)
        except UsageError:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{key} names an invalid key {k!r}") from None
    return manifest, keys


def missing_references(upstream: Store, key: str, parsed: Referenced | None) -> list[str]:
    """(Thread) For a manifest or squash (``parsed``: :func:`referenced`): the packs and blobs
    it names that ``upstream`` lacks, and for a delta's manifest its parent's manifest, so a
    broken or hostile publisher cannot commit a version that cannot be pulled (nor one a
    concurrent gc took the base of: the check right before the write, the publisher's own
    check before its commit)."""
    if parsed is None:
        return []
    manifest, keys = parsed
    missing = [k for k in keys if not upstream.exists(k)]
    if (key.startswith("manifests/") and manifest.kind == manifest_pb.DELTA and manifest.has_parent
            and not upstream.exists(parent := manifest_key(manifest.parent))):
        missing.append(parent)
    return missing


class Quota:
    """Bytes the upstream repository holds, kept under a limit: counted once at start (a walk
    of a local directory, temporary files included; else one listing with sizes, which S3
    answers 1,000 keys a request), then tracked through this relay's puts and deletes. Writes
    are serialised with the accounting, so racing uploads cannot both pass the last free
    bytes. Other writers to the same repository are not seen until the relay restarts."""

    def __init__(self, upstream: Store, limit: int) -> None:
        self.upstream = upstream
        self.limit = limit
        self.used = _tree_bytes(upstream.root) if isinstance(upstream, LocalStore) else upstream.total_bytes()
        self._lock = threading.Lock()

    def _refusal(self, key: str, size: int) -> Refused:
        return Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"write quota exceeded: {key} ({size:,} bytes) would bring the repository to "
            f"{self.used + size:,} of {self.limit:,} bytes (serve --write-quota)",
        )

    def check(self, key: str, size: int) -> None:
        if self.used + size > self.limit:
            raise self._refusal(key, size)

    def put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        with self._lock:
            try:
                old = self.upstream.size(key)
            except ObjectNotFoundError:
                old = 0
            if not (if_absent and old) and self.used - old + len(data) > self.limit:
                raise self._refusal(key, len(data))
            self.upstream.put(key, data, if_absent=if_absent)
            self.used += len(data) - old

    def delete(self, key: str) -> None:
        with self._lock:
            try:
                old = self.upstream.size(key)
            except ObjectNotFoundError:
                return
            self.upstream.delete(key)
            self.used = max(0, self.used - old)


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


class Uploads:
    """(Loop) The relay's writes to its upstream; blocking work goes to ``in_thread``."""

    def __init__(self, upstream: Store, cache: ObjectCache, config: RelayConfig, in_thread: InThread) -> None:
        self.upstream = upstream
        self.cache = cache
        self.config = config
        self.in_thread = in_thread
        self.quota = Quota(upstream, config.write_quota) if config.write_quota is not None else None
        self.turn: asyncio.Semaphore | None = None  # made on the loop, in start()
        self.budget = Budget(config.upload_buffer)
        self.on_stored: Callable[[str], None] | None = None  # (loop) a key just written upstream
        self.receiving: dict[str, list[asyncio.Future[None]]] = {}
        """Keys being received (holding their turn), each done when its upload ends, stored or not."""
        self.waited = 0
        """Manifests whose check waited for the uploads of objects they name (references_landed)."""
        self.rechecked = 0
        """Manifests checked again once another upload ended (_another_landed)."""
        self.pending_waited = 0
        """Manifests whose packs were on their way and missing at first (_pending_landed)."""
        self.committed = 0
        """Versions committed here: refs/latest, the lease and the check after (_commit_here)."""
        self._moved: asyncio.Event | None = None  # set (and replaced) when an upload begins or ends here

    def start(self) -> None:
        self.turn = asyncio.Semaphore(self.config.max_uploads)

    async def take(self, first: pb.PutChunk, requests: AsyncIterator[bytes | memoryview],
                   send_credit: SendCredit | None = None, session: Session | None = None,
                   turn: Turn | None = None) -> None:
        """:meth:`_take`, the key counted among those :attr:`receiving` meanwhile. ``turn``: the
        upload's place, held (lent while a manifest waits for packs on their way)."""
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waits = self.receiving.setdefault(first.key, [])
        waits.append(ended)
        self._move()
        try:
            await self._take(first, requests, send_credit, session, turn)
        finally:
            ended.set_result(None)
            waits.remove(ended)
            if not waits and self.receiving.get(first.key) is waits:
                del self.receiving[first.key]
            self._move()

    def _move(self) -> None:
        if self._moved is not None:
            self._moved.set()
            self._moved = None

    async def references_landed(self, keys: list[str]) -> None:
        """Before a manifest's check (:func:`missing_references`): wait for the uploads being
        received right now of the packs and blobs it names (``keys``), so that a publisher may
        send its manifest while its last packs are still on their way (``wire.UPLOAD_WAITS``)
        and the check still finds them. Each such upload holds its turn and has its own
        deadlines; a pack whose upload has not begun, or that fails, is missing to the check as
        before."""
        waits = [f for k in keys for f in self.receiving.get(k, ())]
        if waits:
            self.waited += 1
            await asyncio.wait(waits)

    async def _take(self, first: pb.PutChunk, requests: AsyncIterator[bytes | memoryview],
                    send_credit: SendCredit | None = None, session: Session | None = None,
                    turn: Turn | None = None) -> None:
        """Check an upload's header (``first``), take its pieces (``requests``: the data of
        each message after the header), check and store it. Refused
        (or the store's error) when it cannot be written. Call holding :attr:`turn`. With
        ``send_credit`` (an Upload call) the client sends only within the credit granted;
        without (an old Put), the caller has charged the budget a window for it. With
        ``session`` (an UploadSession call) the credit is the session's, and ``requests`` ends
        with the object's last byte."""
        key, size = first.key, first.total_bytes
        check_writable(key)
        kind_cap = size_limit(key)  # what a valid object of this kind can be (manifests: 64 MiB)
        cap = self.config.max_object_bytes if kind_cap is None else min(kind_cap, self.config.max_object_bytes)
        if size > cap:
            raise Refused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{key} is {size:,} bytes, over the relay's object size cap of {cap:,} bytes "
                "(serve --max-object-bytes)",
            )
        if self.quota is not None:
            self.quota.check(key, size)  # before receiving: a refused upload costs no memory
        credit = Credit(send_credit) if send_credit is not None else None
        credited = credit is not None or session is not None
        whole = credited and len(first.data) == size  # sent in its header, before credit
        if credited and first.data and not (whole and size <= UNCREDITED_BYTES):
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"upload of {key} sent {len(first.data):,} bytes before any credit")
        if session is not None:
            await self._take_in_session(key, size, first, requests, session, whole, turn)
            return
        # Created and removed on the event loop itself (a file open and an unlink): an
        # executor job can be cancelled before it runs when the client cancels the
        # upload, which would leave the spool file behind.
        if whole:
            self.budget.used += size  # already here: held, counted, whatever the budget says
            in_memory = True
        else:
            in_memory = size <= SPOOL_BYTES and self.budget.take(size)
        spool = None if in_memory else Spool(self.cache.root / "tmp")
        granter: asyncio.Task[None] | None = None
        try:
            if credit is not None and in_memory:
                await credit.grant_all(size, send=not whole)
            elif credit is not None:
                granter = asyncio.get_running_loop().create_task(
                    credit.keep_granting(self.budget, size, self.config.upload_window))
            await self._receive(key, size, first, requests, spool, credit, None, turn)
            if granter is not None:
                await granter  # done: every byte was granted (its last credit message may be on its way)
                granter = None
        finally:
            if granter is not None:
                granter.cancel()  # it takes nothing more: cancelled at its next wait
            if credit is not None and spool is not None:
                self.budget.give(credit.granted - credit.landed)  # granted, never sent
            if spool is not None:
                spool.close()
            if in_memory:
                self.budget.give(size)

    async def _take_in_session(self, key: str, size: int, first: pb.PutChunk,
                               requests: AsyncIterator[bytes | memoryview], session: Session, whole: bool,
                               turn: Turn | None = None) -> None:
        """An object of an UploadSession: its bytes come under the session's credit, which
        stays taken while they are in memory (a small object, until it is written) and goes
        back as a spooled one's pieces land on disk."""
        if whole:
            self.budget.used += size  # already here: held, counted, whatever the budget says
        session.begin(0 if whole else size)
        in_memory = whole or size <= min(SPOOL_BYTES, self.config.upload_window)
        spool = None if in_memory else Spool(self.cache.root / "tmp")
        try:
            await self._receive(key, size, first, requests, spool, None, session, turn)
        finally:
            if spool is not None:
                spool.close()
            if whole:
                self.budget.give(size)
            session.landed_piece(session.received - session.landed)  # what this object held, freed

    async def _receive(self, key: str, size: int, first: pb.PutChunk, requests: AsyncIterator[bytes | memoryview],
                       spool: Spool | None, credit: Credit | None, session: Session | None = None,
                       turn: Turn | None = None) -> None:
        """Take an upload's pieces (into memory, or into ``spool``), then check and store it.
        With ``credit``, a spooled piece's credit goes back to the budget once it is written."""
        data = bytearray(first.data) if spool is None else None
        if spool is not None and first.data:
            await self.in_thread(spool.write, first.data)
        received = len(first.data)
        async for piece in requests:
            n = len(piece)
            if received + n > size:
                raise Refused(grpc.StatusCode.DATA_LOSS, f"upload of {key} sent more than its {size:,} bytes")
            if credit is not None and received + n > credit.granted:
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"upload of {key} sent past its credit ({credit.granted:,} bytes)")
            if session is not None:
                if session.received + n > session.granted:
                    raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"upload of {key} sent past the session's credit ({session.granted:,} bytes)")
                session.received += n
            received += n
            if data is not None:
                data += piece
            else:
                assert spool is not None
                await self.in_thread(spool.write, piece)
                del piece  # before its credit goes back: the next piece may be on its way
                if credit is not None:
                    credit.landed_piece(n, self.budget)
                elif session is not None:
                    session.landed_piece(n)
        if received != size:
            raise Refused(grpc.StatusCode.DATA_LOSS, f"upload of {key} ended after {received:,} of {size:,} bytes")
        if data is not None:  # the bytearray itself: a copy would double the memory an upload holds
            await self._store(key, data, first, turn, session)
        else:
            assert spool is not None
            view = await self.in_thread(spool.view)
            try:
                await self._store(key, view, first, turn, session)
            finally:
                with contextlib.suppress(BufferError):
                    view.release()
        if self.on_stored is not None:
            self.on_stored(key)

    async def _store(self, key: str, data: bytes | bytearray | memoryview, first: pb.PutChunk,
                     turn: Turn | None = None, session: Session | None = None) -> None:
        """Check a complete upload (:meth:`_checked`), wait for the uploads being received of
        what a manifest names (:meth:`references_landed`), then write it (:meth:`_write`); a
        manifest missing some is checked again when they may have come (:meth:`_pending_landed`
        when its header says they are on their way, else :meth:`_another_landed`). A manifest
        of an upload session whose header asks for it (``commit_latest``) is then committed
        here (:meth:`_commit_here`), what it found missing left for the session's answer."""
        if_absent = first.if_absent
        commit_here = first.commit_latest and session is not None
        if commit_here and version_from_key(key) is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{key}: only a version's manifest is committed here")
        if commit_here and first.release and not is_lease_key(first.release):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{key}: the lease to release is not a lease's key "
                          f"({first.release[:80]!r})")
        parsed = await self.in_thread(self._checked, key, data, bytes(first.digest))
        if parsed is None:
            await self.in_thread(self._write, key, data, if_absent, None)
            return
        await self._write_manifest(key, data, if_absent, parsed, first.references_pending, turn)
        if commit_here:
            assert session is not None
            gone = await self.in_thread(self._commit_here, parsed, first.release)
            session.gone, session.unchecked = gone or [], gone is None
            self.committed += 1
            if self.on_stored is not None:
                self.on_stored(LATEST)

    async def _write_manifest(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool,
                              parsed: Referenced, pending: bool, turn: Turn | None) -> None:
        """Write a checked manifest once every object it names is there (Refused if they never
        are): those being received are waited for first; ``pending``: its header says they are
        on their way."""
        await self.references_landed(parsed[1])
        until = asyncio.get_running_loop().time() + MANIFEST_WAIT_SECONDS
        while True:
            try:
                await self.in_thread(self._write, key, data, if_absent, parsed)
                return
            except MissingReferences as e:
                if pending:
                    pending = False  # once: after the wait, only what this relay receives is waited for
                    if await self._pending_landed(e.missing, until, turn):
                        continue
                if not await self._another_landed(e.missing, until):
                    raise

    async def _pending_landed(self, missing: list[str], until: float, turn: Turn | None) -> bool:
        """A manifest whose header says the packs and blobs it names are on their way, and whose
        check found ``missing``: wait (before ``until``) until each is in the repository,
        brought by an upload here (:meth:`references_landed`, looked at again whenever an upload
        begins or ends here) or through another relay of the same repository (looked for there
        every :data:`PENDING_POLL_SECONDS`). True once they all are (the manifest is then
        checked whole again), False at ``until``. A missing manifest (a delta's parent) is
        not on its way: False at once. Its turn is lent meanwhile, so waiting manifests never
        keep their own packs from a place."""
        if any(_MANIFEST_KEY.match(k) for k in missing):
            return False
        loop = asyncio.get_running_loop()
        self.pending_waited += 1
        poll, most = PENDING_POLL_SECONDS
        left = missing
        async with turn.lent() if turn is not None else contextlib.nullcontext():
            while left:
                remaining = until - loop.time()
                if remaining <= 0:
                    return False
                if self._moved is None:
                    self._moved = asyncio.Event()
                moved = self._moved
                if not any(k in self.receiving for k in left):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(moved.wait(), min(poll, remaining))
                    poll = min(2 * poll, most)
                await self.references_landed(left)
                left = await self.in_thread(self._absent, left)
        return True

    def _absent(self, keys: list[str]) -> list[str]:
        """(Thread) Those of ``keys`` the repository lacks."""
        return [k for k in keys if not self.upstream.exists(k)]

    def _commit_here(self, parsed: Referenced, release: str) -> list[str] | None:
        """(Thread) After a version's manifest is written, what its publisher would do next in a
        round trip of its own (Repository.commit, publish/commit.py), done here: point
        ``refs/latest`` at it unless a newer version is listed (the ref written first, then the
        listing, so a newer commit racing it gets the ref back), delete the publish's lease
        (``release``), and check again, after the write, that every pack and blob it names is
        there. Returns those that are not (a concurrent gc deleted one at that moment: the
        publisher fails naming it), or None when the check failed (the publisher checks them
        itself: the version is committed all the same). The ref and the lease are best effort, as at a publisher:
        the ref is a hint (readers list), and a lease left behind expires."""
        manifest, keys = parsed
        version = manifest.version
        with ThreadPoolExecutor(max_workers=max(1, min(COMMIT_CHECKS, len(keys))),
                                thread_name_prefix="deltasync-commit-check") as pool:
            present = pool.map(self.upstream.exists, keys)
            try:
                self._write(LATEST, f"{version}\n".encode(), False, None)
                newest = max((v for k in self.upstream.list("manifests/") if (v := version_from_key(k)) is not None),
                             default=version)
                if newest > version:
                    self._write(LATEST, f"{newest}\n".encode(), False, None)
            except Exception as e:  # committed: the ref is a hint
                log.warning("version %d is committed, but refs/latest was not updated (%s)", version, e)
            if release:
                try:
                    self.delete(release)
                except Exception as e:  # left behind, it expires
                    log.info("version %d: its lease %s was not deleted (%s)", version, release, e)
            try:
                return [k for k, ok in zip(keys, present, strict=True) if not ok]
            except Exception as e:
                log.warning("version %d is committed, but what it names could not be checked again here (%s): "
                            "its publisher checks", version, e)
                return None

    async def _another_landed(self, missing: list[str], until: float) -> bool:
        """A manifest whose check found ``missing``: whether to check it again, once
        another of the uploads this relay is receiving has ended (before ``until``). A pack it
        names may be queued behind that one on its upload session, its header not read yet
        (objects of a session are taken in order): it begins when the one before it ends, and
        :meth:`references_landed` then waits for it. False at once when no pack or blob is
        being received (the manifest is refused as before). Only such uploads are waited for:
        each holds its turn and ends by its own deadlines, and none of them waits for a
        manifest, so manifests waiting at once cannot wait for each other."""
        loop = asyncio.get_running_loop()
        others = [f for k, waits in self.receiving.items() if not _MANIFEST_KEY.match(k) for f in waits]
        if not others or loop.time() >= until:
            return False
        self.rechecked += 1
        await asyncio.wait(others, timeout=until - loop.time(), return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0)  # the session behind it takes its next header meanwhile
        await self.references_landed(missing)
        return True

    def _checked(self, key: str, data: bytes | bytearray | memoryview, announced: bytes) -> Referenced | None:
        """(Thread) Refused unless ``data`` is the object its header announced and its key names;
        for a manifest or squash, what it names (:func:`referenced`)."""
        if announced and digest(data) != announced:
            raise Refused(grpc.StatusCode.DATA_LOSS, f"upload of {key} does not match the digest its header announced")
        problem = content_problem(key, data)
        if problem is not None:
            raise Refused(grpc.StatusCode.DATA_LOSS, f"upload of {key} refused: {problem}")
        return referenced(key, data)

    def _write(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool, parsed: Referenced | None) -> None:
        """(Thread) Write a checked upload upstream in one atomic put, a manifest only if every
        object it names is there."""
        missing = missing_references(self.upstream, key, parsed)
        if missing:
            raise MissingReferences(key, missing)
        if self.quota is None:
            self.upstream.put(key, data, if_absent=if_absent)
        else:
            self.quota.put(key, data, if_absent)
        self._forget_cached(key)  # an overwrite (or a re-upload after a delete) is served fresh

    def _forget_cached(self, key: str) -> None:
        entry = self.cache.lookup(key, touch=False) if cacheable(key) else None
        if entry is not None:
            self.cache.forget(key, entry)

    def delete(self, key: str) -> None:
        """(Thread) Delete ``key`` upstream (through the quota's accounting) and from the cache."""
        if self.quota is None:
            self.upstream.delete(key)
        else:
            self.quota.delete(key)
        self._forget_cached(key)

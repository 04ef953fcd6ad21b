"""The relay's cache: immutable objects as files, indexed in LMDB, evicted least recently used.

Only objects that never change once written are cached: packs, blobs and manifests (a
manifest's presence is the commit, and it is never rewritten). ``refs/latest``, listings and
everything else always go to the upstream.

Layout of the cache directory::

    objects/<h[:2]>/<h>     one file per object, h = sha256 of its key (keys may nest)
    tmp/                    downloads in progress (cleared at start)
    index/                  LMDB environment: key → size, last access, file path
    lock                    one relay per cache directory
    deltasync-relay-cache   marker: only such (or empty) directories are used

An object is downloaded into ``tmp/``, checked against its size (and a pack against the
digest in its name), fsynced and renamed into place, and only then indexed; at start the index
and the files are reconciled, so a relay killed at any point leaves a consistent cache. Access
times live in memory and reach LMDB in batches (a read must not cost a write transaction); on
a crash only LRU order is lost.

A download in progress is readable: its :class:`Landing` says how many bytes of the
temporary file are written, whether the whole object arrived and passed its checks, or why it
failed, so the relay streams an object to its readers while it is still crossing the WAN.
Objects being served are *held* (:meth:`ObjectCache.hold`): eviction passes them by.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import struct
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import lmdb
import zstandard

from ..errors import CorruptObjectError, ObjectTooLargeError, StoreError, UsageError
from ..format.digest import StreamDigest
from ..format.manifest import BLOB_PART_SIZE, MAX_MANIFEST_BYTES, MAX_PACK_BYTES, parse_manifest, version_from_key
from ..repo.leases import MAX_LEASE_BYTES
from ..repo.repository import squash_from_key
from ..storage import Store
from .gauge import UpstreamGauge

if TYPE_CHECKING:
    from .shares import ClusterShares

log = logging.getLogger(__name__)

CACHEABLE_PREFIXES = ("packs/", "blobs/", "manifests/", "squashes/")
#: What a relay serves: the keys of a repository's layout (repo/repository.py), nothing else
#: of its upstream (no gc state, no stray files). Refs and the marker are mutable, never cached.
SERVED_PREFIXES = (*CACHEABLE_PREFIXES, "refs/", "leases/", "history/")  # leases: publishes in flight
# (repo/leases.py); history: gc's records of deleted versions, which followers check history with (repo/history.py)
SERVED_KEYS = ("deltasync.json",)
MARKER = "deltasync-relay-cache"  # marks a directory as a relay cache
_VALUE = struct.Struct("<Qd")  # size, last access (unix seconds); the relative path follows
_LOW_WATER = 0.9  # eviction frees down to this fraction of the limit, so it runs in bursts
_MAP_SIZE = 1 << 30  # LMDB address space for the index (~10M entries); the file grows as used
_PACK_KEY = re.compile(r"^packs/([0-9a-f]{32})\.pack$")  # named by the xxh3-128 of its bytes
_BLOB_KEY = re.compile(r"^blobs/([0-9a-f]{32})$")  # named by the xxh3-128 of its zstd frame's content
_MANIFEST_KEY = re.compile(r"^(manifests/\d{20}\.pb|squashes/\d{20}-\d{20}\.pb)$")
_ZSTD_HEADER_MAX = 18  # the longest zstd frame header: its content size is known once these are in
#: The share of the cache disk's free space (at start, plus what the cache already holds) that
#: a cache given no size limit takes: the disk never fills from the cache alone, and a version
#: up to a quarter of the free space is still warmed (feed.py warms none over half the limit).
DEFAULT_DISK_SHARE = 0.5
#: Bytes kept free on the cache's disk besides its objects (the LMDB index, downloads starting),
#: at most 1/16 of a small disk.
_DISK_RESERVE = 64 << 20
_RECHECK = 0.05  # seconds a download waits on its own pieces before it asks the gauge again


class CacheFullError(OSError):
    """The cache's disk cannot take an object even with everything evictable evicted: the relay
    passes the object through from the upstream instead of caching it."""

    def __init__(self, key: str, size: int) -> None:
        super().__init__(errno.ENOSPC, f"no room for {key} ({size:,} bytes) in the relay cache, nothing left to evict")
        self.key = key


class ContentCheck:
    """What a cacheable object's name promises, checked as its bytes arrive (``update``), in
    bounded memory: a pack's bytes hash to its name; a blob is exactly one zstd frame of at most
    a part's size whose content hashes to its name; a manifest or squash parses as every reader
    parses it (:func:`~deltasync.format.manifest.parse_manifest`: whole-manifest digest, layout).
    Other keys are not checked. :meth:`problem` says what is wrong once all bytes are in."""

    def __init__(self, key: str) -> None:
        self.key = key
        named = _PACK_KEY.match(key) or _BLOB_KEY.match(key)
        self._name = named.group(1) if named is not None else None
        self._blob = _BLOB_KEY.match(key) is not None
        self._manifest = _MANIFEST_KEY.match(key) is not None
        self._digest = StreamDigest() if named is not None else None
        self._parts: list[bytes] = []
        self._head = b""
        self._frame: Any = None  # the blob's zstd decompressor, once its header is in
        self._declared = 0
        self._raw = 0
        self._problem: str | None = None

    def update(self, data: bytes | memoryview) -> None:
        if self._problem is not None:
            return
        if self._manifest:
            self._parts.append(bytes(data))
        elif self._blob:
            self._blob_bytes(bytes(data), final=False)
        elif self._digest is not None:
            self._digest.update(data)

    def _blob_bytes(self, data: bytes, *, final: bool) -> None:
        if self._frame is None:
            self._head += data
            if len(self._head) < _ZSTD_HEADER_MAX and not final:
                return
            data, self._head = self._head, b""
            try:
                self._declared = zstandard.frame_content_size(data)
            except zstandard.ZstdError as e:
                self._problem = f"not a zstd frame ({e})"
                return
            if not 0 <= self._declared <= BLOB_PART_SIZE:
                self._problem = f"not a blob part (a zstd frame of at most {BLOB_PART_SIZE:,} bytes)"
                return
            self._frame = zstandard.ZstdDecompressor().decompressobj()
        if self._frame.eof:
            self._problem = "bytes follow the blob's zstd frame"
            return
        try:
            out = self._frame.decompress(data)  # at most the declared size: zstd holds a frame to it
        except zstandard.ZstdError as e:
            self._problem = f"not a zstd frame ({e})"
            return
        self._raw += len(out)
        assert self._digest is not None
        self._digest.update(out)
        if self._frame.eof and self._frame.unused_data:
            self._problem = "bytes follow the blob's zstd frame"

    def problem(self) -> str | None:
        """Why the bytes given are not the object named (None: they are, or it is not checked)."""
        if self._problem is not None:
            return self._problem
        if self._manifest:
            try:
                squash = squash_from_key(self.key)  # a squash to version C is a manifest of version C
                parse_manifest(b"".join(self._parts),
                               expect_version=squash[1] if squash is not None else version_from_key(self.key))
            except CorruptObjectError as e:
                return e.detail
            return None
        if self._blob:
            if self._frame is None:  # a whole object shorter than the longest frame header
                self._blob_bytes(b"", final=True)
                if self._problem is not None:
                    return self._problem
            if self._frame is None or not self._frame.eof or self._raw != self._declared:
                return "the blob's zstd frame is cut short"
        if self._digest is not None and self._digest.digest().hex() != self._name:
            return ("its content does not match the digest in its name" if self._blob
                    else "its bytes do not match the digest in its name")
        return None


def content_problem(key: str, data: bytes | bytearray | memoryview) -> str | None:
    """Why ``data`` cannot be the object named ``key`` (:class:`ContentCheck`); None if it can."""
    check = ContentCheck(key)
    check.update(memoryview(data))
    return check.problem()


def cacheable(key: str) -> bool:
    return key.startswith(CACHEABLE_PREFIXES)


def served(key: str) -> bool:
    """Whether ``key`` belongs to a repository's layout (what a relay serves)."""
    return key in SERVED_KEYS or key.startswith(SERVED_PREFIXES)


def size_limit(key: str) -> int | None:
    """The most bytes a valid object under ``key`` can have (None: no bound known), so a
    hostile upstream cannot fill the cache's disk with one object."""
    if key.startswith(("manifests/", "squashes/")):
        return MAX_MANIFEST_BYTES
    if key.startswith("leases/"):
        return MAX_LEASE_BYTES
    if key.startswith("blobs/"):
        return BLOB_PART_SIZE + (BLOB_PART_SIZE >> 7) + (64 << 10)  # zstd's bound for one part
    if key.startswith("packs/"):
        return MAX_PACK_BYTES
    return None


@dataclass
class Entry:
    size: int
    path: Path
    atime: float


class Landing:
    """An object on its way into the cache (:meth:`ObjectCache.fetch`), readable as it arrives.

    The download, in a thread, records the object's ``size`` once the upstream told it, then
    how many bytes of the temporary file are ``written`` (a prefix), then ``verified`` (all of
    them, of the right size, and for a pack the digest in its name), then the cache ``entry``;
    or the ``error`` that ended it. ``notify`` is called (from the download's thread) after
    each of these. A reader opens the file (:meth:`open`) and reads only what ``written``
    covers; it must not end a stream that reaches the object's end before ``verified``, and
    must report ``error`` rather than stop short.
    """

    def __init__(self, key: str, notify: Callable[[], None] | None = None) -> None:
        self.key = key
        self.size: int | None = None
        self.written = 0
        self.verified = False
        self.entry: Entry | None = None
        self.error: BaseException | None = None
        self._notify = notify or (lambda: None)
        self._fd = -1
        self._lock = threading.Lock()

    @property
    def finished(self) -> bool:
        return self.entry is not None or self.error is not None

    def open(self) -> int:
        """A file descriptor to read the object from: a duplicate of the download's own while it
        runs (it stays valid across the rename into place), the cached file's once landed.
        Only while ``size`` is known and ``error`` is None; FileNotFoundError when the landed
        file was evicted meanwhile."""
        with self._lock:
            if self.entry is not None:
                return os.open(self.entry.path, os.O_RDONLY)
            if self.error is not None or self._fd < 0:
                raise CorruptObjectError(self.key, "the relay's download of it is not readable")
            return os.dup(self._fd)

    # -- the download's side (ObjectCache.fetch) --

    def _update(self, **fields: object) -> None:
        with self._lock:
            for name, value in fields.items():
                setattr(self, name, value)
        self._notify()

    def _close(self) -> None:
        with self._lock:  # not while a reader duplicates it
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class ObjectCache:
    """Files under ``root`` indexed in LMDB; at most ``max_bytes`` (None: ``DEFAULT_DISK_SHARE``
    of the disk's free space at start, plus what the cache already holds: :attr:`limit_note`
    says which). Whatever the limit, a full disk evicts (ENOSPC), and an object that does not
    fit with everything evictable gone raises :class:`CacheFullError` (the relay passes it
    through). Objects are checked against their names as they land (:class:`ContentCheck`),
    and objects found in the cache at start once more when first read (:meth:`intact`).

    Thread-safe. Not single-flight by itself: the relay makes sure one key is fetched once.
    ``piece_bytes`` bounds the memory of a piece: larger objects are read in ranges, as many
    requested at once, all downloads together, as the upstream's measured round trip and rate
    ask for (:class:`~.gauge.UpstreamGauge`: about rate x round trip / ``piece_bytes`` + 1),
    at most ``pieces_in_flight`` (the memory bound), written and digested in order.
    """

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int | None = None, piece_bytes: int = 8 << 20,
                 pieces_in_flight: int = 32) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise UsageError(f"cache size limit must not be negative, got {max_bytes}")
        if piece_bytes < 1:
            raise UsageError(f"piece_bytes must be positive, got {piece_bytes}")
        self.root = Path(root)
        self.max_bytes: int | None = max_bytes
        self.limit_note = ""
        """How the limit was chosen, when not given ("": given)."""
        self.piece_bytes = piece_bytes
        self._checked: set[str] = set()  # keys whose file was checked (landed, or read once) in this process
        self._reserve = _DISK_RESERVE
        self.pieces_in_flight = max(1, pieces_in_flight)
        self.gauge = UpstreamGauge(piece_bytes, self.pieces_in_flight)
        """The upstream's measured round trip and rate, and the ranged reads in flight they ask for."""
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._touched: set[str] = set()
        self._held: Counter[str] = Counter()
        self._total = 0
        self.fetches = 0
        self.fetched_bytes = 0
        self.evictions = 0
        self.stopping = False
        """Set when the relay stops: downloads in pieces end at the next piece (StoreError),
        rather than carry on across the link for a relay that serves no one."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # Never take over (and clean up in) a directory that holds something else.
            if not (self.root / MARKER).exists():
                if any(self.root.iterdir()):
                    raise UsageError(f"{self.root} is not empty and not a relay cache; give an empty or new directory")
                (self.root / MARKER).write_bytes(b"")
            self._lockfile = _lock_dir(self.root)
        except OSError as e:
            raise UsageError(f"cannot use cache directory {self.root}: {e.strerror or e}") from None
        try:
            (self.root / "objects").mkdir(exist_ok=True)
            shutil.rmtree(self.root / "tmp", ignore_errors=True)
            (self.root / "tmp").mkdir()
            self._env = lmdb.open(str(self.root / "index"), map_size=_MAP_SIZE, max_dbs=0)
            self._reconcile()
            disk = shutil.disk_usage(self.root)
            self._reserve = min(_DISK_RESERVE, disk.total // 16)
            if self.max_bytes is None:
                free = disk.free
                self.max_bytes = max(0, int((free + self._total) * DEFAULT_DISK_SHARE))
                self.limit_note = f"{DEFAULT_DISK_SHARE:.0%} of the free disk space at start"
        except (OSError, lmdb.Error) as e:
            self._lockfile.close()
            detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise UsageError(f"cannot use cache directory {self.root}: {detail}") from None
        with self._lock:
            self._evict_locked(keep=None)

    # -- reads ---------------------------------------------------------------------------------

    def lookup(self, key: str, *, touch: bool = True) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and touch:
                entry.atime = time.time()
                self._touched.add(key)
            return entry

    def forget(self, key: str, entry: Entry) -> None:
        """Drop ``entry`` of ``key`` (its file went missing or is damaged; a newer entry is
        kept); the next read fetches the object again."""
        with self._lock:
            if self._entries.get(key) is not entry:
                return
            del self._entries[key]
            self._total -= entry.size
            self._touched.discard(key)
            self._checked.discard(key)
            with self._env.begin(write=True) as txn:
                txn.delete(key.encode())
            with contextlib.suppress(FileNotFoundError):
                entry.path.unlink()

    def intact(self, key: str, entry: Entry) -> bool:
        """(Thread) Whether the cached file of ``key`` still is that object; checked once per
        process (objects landed in it were checked as they arrived): one found damaged, or cached
        unchecked by an older relay, is dropped, and the next read fetches it again."""
        with self._lock:
            if key in self._checked:
                return True
        check = ContentCheck(key)
        try:
            with open(entry.path, "rb") as f:
                while piece := f.read(self.piece_bytes):
                    check.update(piece)
            problem = check.problem()
        except OSError as e:
            problem = f"unreadable ({e.strerror or e})"
        if problem is None:
            with self._lock:
                self._checked.add(key)
            return True
        log.warning("relay cache: %s is damaged (%s): dropped, fetched again", key, problem)
        self.forget(key, entry)
        return False

    @property
    def total_bytes(self) -> int:
        return self._total

    def __len__(self) -> int:
        return len(self._entries)

    # -- fetch ---------------------------------------------------------------------------------

    def fetch(self, key: str, upstream: Store, *, max_size: int | None = None, landing: Landing | None = None,
              size_hint: int | None = None, shares: ClusterShares | None = None) -> Entry:
        """Download ``key`` from ``upstream`` into the cache (one read for objects up to
        ``piece_bytes``, ranged reads beyond) and index it; an object larger than
        ``max_size`` is refused (ObjectTooLargeError) before anything is downloaded.
        ``landing`` (given by the caller to read along) follows the download's progress.
        ``size_hint``: a pack's size as a manifest names it (warming), so its ranges are
        requested at once, without asking the upstream its size first; only a hint: the bytes
        are checked against the key's digest as always, and a wrong size fails the fetch
        (CorruptObjectError, or the upstream's range error), the next reader's fetches again.
        ``shares``: the relays of this cluster, when it has several (:mod:`.shares`): an object
        over ``shares.min_share`` is fetched in pieces, those other relays own read from them."""
        landing = landing if landing is not None else Landing(key)
        tmp = self.root / "tmp" / uuid.uuid4().hex
        path = self._path(key)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            with landing._lock:
                landing._fd = fd
            # One read for an object up to a piece (a manifest, a blob): it says its own
            # size, so a far upstream is asked once, not for the size and then the bytes.
            # A larger one is refused unread, its size usually named in the refusal.
            small: bytes | None = None
            told: int | None = None
            limit = self.piece_bytes if max_size is None else min(self.piece_bytes, max_size)
            if not key.startswith("packs/"):  # (packs are mostly larger: their size first, as before)
                try:
                    small = upstream.get(key, max_bytes=limit)
                except ObjectTooLargeError as e:
                    told = e.size
            if small is not None:
                size = len(small)
            elif told is not None:
                size = told
            elif size_hint is not None and key.startswith("packs/"):
                size = size_hint
                if self.gauge.claim_round_trip():  # beside the download: the gauge still learns the link
                    threading.Thread(target=self._time_round_trip, args=(key, upstream), daemon=True,
                                     name="relay-round-trip").start()
            else:
                began = time.monotonic()
                size = upstream.size(key)
                self.gauge.timed_round_trip(time.monotonic() - began)  # one request, no payload
            if max_size is not None and size > max_size:
                raise ObjectTooLargeError(key, size, max_size)
            self._room_for(key, size)  # before readers learn the size and start streaming a prefix
            landing._update(size=size)
            self._download(key, size, upstream, fd, landing, small, shares)
            try:
                os.fsync(fd)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise CacheFullError(key, size) from e
                raise
            path.parent.mkdir(exist_ok=True)
            os.replace(tmp, path)
            entry = Entry(size, path, time.time())
            with self._lock:
                with self._env.begin(write=True) as txn:
                    txn.put(key.encode(), self._encode(entry))
                old = self._entries.get(key)
                if old is not None:
                    self._total -= old.size
                self._entries[key] = entry
                self._checked.add(key)
                self._total += size
                self.fetches += 1
                self.fetched_bytes += size
                self._evict_locked(keep=key)
        except BaseException as e:
            landing._update(error=e)
            landing._close()
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        landing._update(entry=entry)  # readers from now on open the cached file
        landing._close()
        return entry

    def _time_round_trip(self, key: str, upstream: Store) -> None:
        """(Thread) One size request of ``key``, timed for the gauge (a fetch that sent none)."""
        began = time.monotonic()
        try:
            upstream.size(key)
        except Exception as e:  # only a measurement: the fetch itself reports what is wrong
            log.debug("timing the upstream's round trip with %s failed: %s", key, e)
            self.gauge.untimed()
        else:
            self.gauge.timed_round_trip(time.monotonic() - began)

    def _download(self, key: str, size: int, upstream: Store, fd: int, landing: Landing, small: bytes | None,
                  shares: ClusterShares | None = None) -> None:
        # Checked before it lands (and before a reader streaming it gets its last piece): a
        # transiently corrupt manifest or blob from the upstream is never cached for good.
        check = ContentCheck(key)
        if shares is not None and not shares.splits(size):
            shares = None
        if small is None and shares is not None:  # in shares: pieces from the cluster's other relays too
            peered = self._download_pieces(key, size, upstream, fd, landing, check, shares)
            problem = check.problem()
            if problem is not None:
                if peered:
                    shares.distrust(key)  # its next fetch reads every piece from the upstream
                raise CorruptObjectError(key, f"upstream's bytes are not that object: {problem}")
            shares.trusted(key)
        elif small is not None or size <= self.piece_bytes:
            # (the object may have been replaced since its size was read)
            data = small if small is not None else upstream.get(key, max_bytes=size)
            if len(data) != size:
                raise CorruptObjectError(key, f"upstream sent {len(data)} bytes of a {size}-byte object")
            self._write(fd, data, 0, landing, check)
        else:  # in pieces, several requested at once, each written (and readable) in order
            self._download_pieces(key, size, upstream, fd, landing, check)
        problem = check.problem()
        if problem is not None:
            raise CorruptObjectError(key, f"upstream's bytes are not that object: {problem}")
        landing._update(verified=True)

    def _download_pieces(self, key: str, size: int, upstream: Store, fd: int, landing: Landing,
                         check: ContentCheck, shares: ClusterShares | None = None) -> bool:
        """Ranged reads of ``key``, as many in flight as the gauge grants (all downloads
        together), each written and checked in order as it arrives; with ``shares``, the
        pieces other relays of the cluster own read from them, each holding a memory slot but
        no request slot of this relay's link (:meth:`.gauge.UpstreamGauge.try_hold`: a piece
        waiting on the other relay's link must not keep this one's idle), as many asked at once
        as this link has slots (so the others are asked for what they fetch now, not minutes
        ahead). Whether any piece came from another relay."""
        gauge = self.gauge
        piece = shares.piece_size(size) if shares is not None else self.piece_bytes
        ranges = [(offset, min(piece, size - offset)) for offset in range(0, size, piece)]
        peered = False

        def read(offset: int, n: int, mine: bool) -> bytes:
            nonlocal peered
            got = 0
            try:
                if shares is not None:
                    data, from_peer = shares.read(key, offset, n, offset // piece, upstream)
                    peered = peered or from_peer
                else:
                    data = upstream.get(key, (offset, n))
                got = len(data)
                return data
            finally:
                if mine:
                    gauge.release(got)

        with ThreadPoolExecutor(max_workers=self.pieces_in_flight, thread_name_prefix="relay-piece") as pool:
            # In order of offset: read (a request slot until its read ends), then written (a
            # memory slot until then). Pieces after the next one to write are requested while
            # it is still coming, as far as the two bounds allow (gauge.py).
            pending: deque[tuple[int, int, Future[bytes], bool]] = deque()  # (.., whether over this link)
            submitted = 0
            try:
                while ranges and (pending or submitted < len(ranges)):
                    if self.stopping:
                        raise StoreError(f"the relay stopped while fetching {key}")
                    unfinished = sum(mine and not f.done() for _, _, f, mine in pending)
                    asked = sum(not mine and not f.done() for _, _, f, mine in pending)  # of other relays
                    while submitted < len(ranges):
                        mine = shares is None or shares.peer(key, submitted) is None
                        if mine:
                            took = gauge.try_acquire(unfinished, len(pending))
                        else:  # as many asked of the others as this link has in flight: they keep step
                            took = (not asked or asked < gauge.target) and gauge.try_hold(len(pending))
                        if not took:
                            break
                        offset, n = ranges[submitted]
                        pending.append((offset, n, pool.submit(read, offset, n, mine), mine))
                        submitted += 1
                        unfinished += mine
                        asked += not mine
                    offset, n, future, _ = pending[0]
                    if not future.done():
                        # Until a piece ends: the next to write, or one that frees a request slot.
                        wait([f for _, _, f, _ in pending if not f.done()], timeout=_RECHECK,
                             return_when=FIRST_COMPLETED)
                        continue
                    pending.popleft()
                    try:
                        data = future.result()
                    finally:
                        gauge.written()
                    if len(data) != n:
                        raise CorruptObjectError(key, f"upstream sent {len(data)} bytes for {n} at offset {offset}")
                    self._write(fd, data, offset, landing, check)
                    del data, future
            finally:
                for _, _, future, mine in pending:  # a failed piece ends the download: the rest are not waited for
                    if future.cancel() and mine:
                        gauge.release(0)  # never ran: its request slot back
                    gauge.written()
        return peered

    def _write(self, fd: int, data: bytes, offset: int, landing: Landing, check: ContentCheck) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):
            try:
                done += os.pwrite(fd, view[done:], offset + done)
            except OSError as e:
                # The disk filled (other files, a limit above the disk): evict and go on; with
                # nothing left to evict the relay passes the object through instead.
                if e.errno != errno.ENOSPC or not self._make_room(len(view) - done + self._reserve, landing.key):
                    raise CacheFullError(landing.key, landing.size or len(data)) from e
        check.update(data)
        landing._update(written=offset + len(data))

    # -- holds: objects being served are not evicted -------------------------------------------

    def hold(self, key: str) -> None:
        """Keep ``key`` from eviction until as many :meth:`release` calls (a reader serving it:
        the next reader would otherwise fetch it across the WAN again)."""
        with self._lock:
            self._held[key] += 1

    def release(self, key: str) -> None:
        with self._lock:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]

    # -- upkeep --------------------------------------------------------------------------------

    def flush(self) -> None:
        """Write access times gathered since the last flush to the index."""
        with self._lock:
            touched = [(k, self._entries[k]) for k in self._touched if k in self._entries]
            self._touched.clear()
            if touched:
                with self._env.begin(write=True) as txn:
                    for key, entry in touched:
                        txn.put(key.encode(), self._encode(entry))

    def close(self) -> None:
        self.flush()
        self._env.close()
        self._lockfile.close()

    def _room_for(self, key: str, size: int) -> None:
        """Before a download: make room on the disk (evicting), or raise CacheFullError at once,
        before any reader streams a prefix the cache could not finish."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError:
            return
        short = size + self._reserve - free
        if short > 0 and not self._make_room(short, key):
            raise CacheFullError(key, size)

    def _make_room(self, need: int, keep: str) -> bool:
        """Evict least recently used objects (not held, not ``keep``) until ``need`` bytes are
        freed; whether that many were."""
        with self._lock:
            freed = self._evict_lru(keep, lambda freed: freed >= need)
        if freed:
            log.warning("relay cache: the disk under %s is full: evicted %s bytes", self.root, f"{freed:,}")
        return freed >= need

    def _evict_locked(self, keep: str | None) -> None:
        if self.max_bytes is None or self._total <= self.max_bytes:
            return
        goal = int(self.max_bytes * _LOW_WATER)
        self._evict_lru(keep, lambda _freed: self._total <= goal)

    def _evict_lru(self, keep: str | None, enough: Callable[[int], bool]) -> int:
        """Under the lock: evict least recently used objects (not held, not ``keep``) until
        ``enough(bytes freed so far)``; the bytes freed."""
        freed = 0
        victims = sorted((e.atime, k) for k, e in self._entries.items() if k != keep and k not in self._held)
        with self._env.begin(write=True) as txn:
            for _, key in victims:
                if enough(freed):
                    break
                entry = self._entries.pop(key)
                self._total -= entry.size
                self._touched.discard(key)
                self._checked.discard(key)
                txn.delete(key.encode())
                # A reader holding the file open keeps reading it: unlink only drops the name.
                with contextlib.suppress(FileNotFoundError):
                    entry.path.unlink()
                self.evictions += 1
                freed += entry.size
        return freed

    def _reconcile(self) -> None:
        """Keep index entries whose file is intact; delete files nothing indexes."""
        stale: list[bytes] = []
        with self._env.begin() as txn:
            for raw_key, value in txn.cursor():
                key = bytes(raw_key).decode()
                size, atime = _VALUE.unpack_from(value)
                path = self.root / bytes(value[_VALUE.size :]).decode()
                try:
                    ok = path.stat().st_size == size and cacheable(key)
                except OSError:
                    ok = False
                if ok:
                    self._entries[key] = Entry(size, path, atime)
                    self._total += size
                else:
                    stale.append(bytes(raw_key))
        if stale:
            with self._env.begin(write=True) as txn:
                for raw_key in stale:
                    txn.delete(raw_key)
        indexed = {e.path for e in self._entries.values()}
        for path in (self.root / "objects").rglob("*"):
            if path.is_file() and path not in indexed:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _path(self, key: str) -> Path:
        h = hashlib.sha256(key.encode()).hexdigest()
        return self.root / "objects" / h[:2] / h

    def _encode(self, entry: Entry) -> bytes:
        return _VALUE.pack(entry.size, entry.atime) + entry.path.relative_to(self.root).as_posix().encode()


def _lock_dir(root: Path) -> IO[bytes]:
    """Hold an exclusive lock on ``root/lock`` for as long as the returned file is open."""
    f = open(root / "lock", "ab")  # noqa: SIM115 - held open for the cache's lifetime
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no protection against a second relay
        return f
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise UsageError(f"cache directory {root} is in use by another relay") from None
    return f

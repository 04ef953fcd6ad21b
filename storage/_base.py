"""The Store interface: a flat key → immutable bytes namespace.

Public methods own validation (keys, ranges); implementations override the small private
hooks ``_get``, ``_put``, ``_list``, ``_delete``, ``_size``. Every implementation runs the one
conformance suite in :mod:`deltasync.storage.testing`.
"""

from __future__ import annotations

import contextlib
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextvars import ContextVar

from ..errors import ObjectRangeError, ObjectTooLargeError, StoreError, UsageError

_KEY = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*$")

#: Offsets and lengths of ranged reads stay below 2**63: what pread, HTTP and protobuf can carry.
MAX_OFFSET = (1 << 63) - 1
#: Keys one listing may yield. A repository at this scale holds millions of versions or
#: packs; a store listing more is broken or hostile, and callers collect what they list.
MAX_LIST_KEYS = 2_000_000

#: The byte limit of the whole-object read in progress on this thread (see ``Store.get``).
#: A context variable rather than an argument of ``_get``: wrappers written against the
#: two-argument hook (caches, throttles, counters) pass it on to the store they wrap
#: without knowing of it, and the backend at the bottom enforces it before reading.
_READ_LIMIT: ContextVar[int | None] = ContextVar("deltasync_read_limit", default=None)


def read_limit() -> int | None:
    """For backends' ``_get``: the most bytes the whole-object read in progress may return
    (None: no limit). A backend refuses a larger object with :func:`too_large` before
    reading it, or at the latest once it has read one byte more than the limit."""
    return _READ_LIMIT.get()


def too_large(key: str, size: int | None, limit: int) -> ObjectTooLargeError:
    return ObjectTooLargeError(key, size, limit)


def read_held(key: str, data: bytes, byte_range: tuple[int, int] | None) -> bytes:
    """A read of an object held whole in memory (``data``): all of it, within
    :func:`read_limit`, or ``byte_range`` of it, which must lie inside it."""
    if byte_range is None:
        limit = read_limit()
        if limit is not None and len(data) > limit:
            raise too_large(key, len(data), limit)
        return data
    offset, length = byte_range
    if offset + length > len(data):
        raise ObjectRangeError(key, f"range {offset}+{length} past end of {len(data)}-byte object")
    return data[offset : offset + length]


def check_key(key: str) -> str:
    """Keys are '/'-separated segments of [A-Za-z0-9._-]; no '.' or '..' segments."""
    if not isinstance(key, str) or len(key) > 1024 or not _KEY.match(key):
        raise UsageError(f"invalid store key {key!r}")
    if any(seg in (".", "..") for seg in key.split("/")):
        raise UsageError(f"invalid store key {key!r}")
    return key


def valid_key(key: str) -> bool:
    """Whether :func:`check_key` accepts ``key`` (for keys a peer named: skipped, not raised)."""
    try:
        check_key(key)
    except UsageError:
        return False
    return True


class Store(ABC):
    """Immutable objects by key. ``put(if_absent=True)`` is the commit primitive."""

    #: URL this store was opened from (for messages).
    url: str = ""
    #: Requests worth keeping in flight at once (readers size their I/O threads by it).
    io_concurrency: int = 4
    #: Uploads worth keeping in flight at once (a publisher holds one pack in memory for each).
    upload_concurrency: int = 2
    #: Bytes of packs a publisher may hold waiting for or in upload (None: only the count
    #: above bounds them); at least two packs are always allowed.
    upload_bytes: int | None = None
    #: Whether a publisher should upload packs while it still encodes (early, smaller packs)
    #: rather than fill each one first: true where writes cross a network (S3, a writable
    #: relay), whose link is then busy while encoding goes on; false where a write is a local copy.
    overlap_uploads: bool = False
    #: How many places this store's uploads spread over, each behind a link of its own (the
    #: writable relays a ``grpc://`` URL names; 1 for any other store): a publisher splits the
    #: last bytes of a version into several packs for them, so every link ends together.
    upload_targets: int = 1

    @property
    def relays(self) -> int:
        """How many relays this store reads through, each fetching an object whole on its first
        read of any part of it (``grpc://``: the addresses its URL names); 0 for any other store."""
        return 0

    @property
    def checks_references(self) -> bool:
        """Whether a put of a manifest is refused (MissingReferencesError, nothing written) when
        a pack or blob it names, or a delta's parent manifest, is missing at that moment, as a
        writable relay checks beside the write: a publisher then needs no check of its own
        right before its commit (publish/commit.py)."""
        return False

    @property
    def orders_references(self) -> bool:
        """Whether, besides :attr:`checks_references`, the store waits before that check for
        its uploads in progress of what the manifest names (a writable relay that says so): a
        publisher may then put its manifest while its last packs are still on their way,
        without waiting a round trip for their answers first (publish/commit.py)."""
        return False

    @property
    def commits_refs(self) -> bool:
        """Whether :meth:`put_commit` may do a commit's last round where the repository is (a
        writable relay that says so): a publisher of an unsigned repository then sends no
        requests of its own after its manifest (Repository.commit). A :class:`WrappingStore`
        does not pass it on: its puts are its own, and the commit goes through them."""
        return False

    def put_commit(self, key: str, data: bytes | bytearray | memoryview, *, release: str | None = None) -> list[str] | None:
        """Put a version's manifest as ``put(key, data, if_absent=True)`` does. Where the store
        can (:attr:`commits_refs`), it then also points ``refs/latest`` at the version (plain:
        unsigned) unless a newer one is listed, deletes ``release`` (the publish's lease), and
        checks every pack and blob the manifest names again after the write: the keys of those
        missing are returned. None: none of that was done here (the caller does it)."""
        self.put(key, data, if_absent=True)
        return None

    def get(self, key: str, byte_range: tuple[int, int] | None = None, *, max_bytes: int | None = None) -> bytes:
        """Bytes of ``key``; ``byte_range=(offset, length)`` reads a slice.

        ``max_bytes`` bounds a whole-object read: a larger object raises ObjectTooLargeError
        (a CorruptObjectError naming the key) without being read, so what a hostile store
        holds cannot exhaust memory. A range is its own bound (``max_bytes`` caps its length).

        Raises ObjectNotFoundError if absent, CorruptObjectError if the range runs past the end.
        """
        check_key(key)
        if max_bytes is not None and max_bytes < 0:
            raise UsageError(f"max_bytes must not be negative, got {max_bytes}")
        if byte_range is not None:
            offset, length = byte_range
            if offset < 0 or length < 0 or offset > MAX_OFFSET or length > MAX_OFFSET:
                raise UsageError(f"invalid byte range {byte_range} for {key}")
            if max_bytes is not None and length > max_bytes:
                raise too_large(key, length, max_bytes)
            return self._get(key, byte_range)
        outer = _READ_LIMIT.get()
        limit = max_bytes if outer is None else outer if max_bytes is None else min(outer, max_bytes)
        if limit is None:
            return self._get(key, None)
        token = _READ_LIMIT.set(limit)
        try:
            data = self._get(key, None)
        finally:
            _READ_LIMIT.reset(token)
        if len(data) > limit:  # a backend that does not look at read_limit(): refuse all the same
            raise too_large(key, len(data), limit)
        return data

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        """Write ``key`` atomically: readers see the old object, nothing, or all of ``data``.

        With ``if_absent``, raises ObjectExistsError when ``key`` exists; of several racing
        writers exactly one succeeds.
        """
        check_key(key)
        self._put(key, data, if_absent)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with ``prefix``, in lexicographic order (at most :data:`MAX_LIST_KEYS`:
        past that the listing raises StoreError naming the prefix)."""
        if prefix:
            check_key(prefix.rstrip("/"))
        return _capped(self._list(prefix), prefix, self)

    def delete(self, key: str) -> None:
        """Remove ``key``; deleting an absent key is not an error."""
        check_key(key)
        self._delete(key)

    def size(self, key: str) -> int:
        """Size in bytes; raises ObjectNotFoundError if absent."""
        check_key(key)
        return self._size(key)

    def total_bytes(self, prefix: str = "") -> int:
        """Bytes held under ``prefix`` (every key :meth:`list` yields, at its :meth:`size`):
        what a write quota counts. One listing; backends whose listings carry sizes (S3)
        answer from it, the others ask each key's size."""
        if prefix:
            check_key(prefix.rstrip("/"))
        return self._total_bytes(prefix)

    def exists(self, key: str) -> bool:
        from ..errors import ObjectNotFoundError

        try:
            self.size(key)
        except ObjectNotFoundError:
            return False
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or handles."""

    def prefers_ranges(self, key: str) -> bool:
        """Whether a pull should read ``key`` by the ranges it needs even where it needs most of
        it (by default it then reads the object whole, in one request): True where the store
        holds just those ranges close by (a packcast node's cache, engines/_packcache.py)."""
        return False

    @abstractmethod
    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes: ...

    @abstractmethod
    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None: ...

    @abstractmethod
    def _list(self, prefix: str) -> Iterator[str]: ...

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def _size(self, key: str) -> int: ...

    def _total_bytes(self, prefix: str) -> int:
        from ..errors import ObjectNotFoundError

        total = 0
        for key in self.list(prefix):
            with contextlib.suppress(ObjectNotFoundError):  # deleted since it was listed: holds nothing now
                total += self.size(key)
        return total


class WrappingStore(Store):
    """Passes every operation to ``inner``; a wrapper (a counter, a throttle, a cache)
    overrides only the hooks it changes. Validation already happened in the public method."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.io_concurrency = inner.io_concurrency
        self.upload_concurrency = inner.upload_concurrency
        self.upload_bytes = inner.upload_bytes
        self.overlap_uploads = inner.overlap_uploads
        self.upload_targets = inner.upload_targets

    @property
    def relays(self) -> int:
        return self.inner.relays

    @property
    def checks_references(self) -> bool:
        return self.inner.checks_references

    @property
    def orders_references(self) -> bool:
        return self.inner.orders_references

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        return self.inner.get(key, byte_range)

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        self.inner.put(key, data, if_absent=if_absent)

    def _list(self, prefix: str) -> Iterator[str]:
        return self.inner.list(prefix)

    def _delete(self, key: str) -> None:
        self.inner.delete(key)

    def _size(self, key: str) -> int:
        return self.inner.size(key)

    def _total_bytes(self, prefix: str) -> int:
        return self.inner.total_bytes(prefix)

    def close(self) -> None:
        self.inner.close()

    def prefers_ranges(self, key: str) -> bool:
        return self.inner.prefers_ranges(key)


def listing_too_long(prefix: str, where: object) -> StoreError:
    """The error of a listing past :data:`MAX_LIST_KEYS`. Backends that collect a listing
    before sorting it check as they collect, so a hostile server cannot make them hold more."""
    return StoreError(f"listing {prefix or '(everything)'!r} of {where} passed {MAX_LIST_KEYS:,} keys: "
                      "refusing to go on (a broken or hostile store?)")


def _capped(keys: Iterator[str], prefix: str, store: Store) -> Iterator[str]:
    for n, key in enumerate(keys):
        if n >= MAX_LIST_KEYS:
            raise listing_too_long(prefix, getattr(store, "url", "") or type(store).__name__)
        yield key

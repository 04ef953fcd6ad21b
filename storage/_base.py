"""The Store interface: a flat key → immutable bytes namespace.

Public methods own validation (keys, ranges); implementations override the small private
hooks ``_get``, ``_put``, ``_list``, ``_delete``, ``_size``. Every implementation runs the one
conformance suite in :mod:`deltasync.storage.testing`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator

from deltasync.errors import UsageError

_KEY = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*$")


def check_key(key: str) -> str:
    """Keys are '/'-separated segments of [A-Za-z0-9._-]; no '.' or '..' segments."""
    if not isinstance(key, str) or len(key) > 1024 or not _KEY.match(key):
        raise UsageError(f"invalid store key {key!r}")
    if any(seg in (".", "..") for seg in key.split("/")):
        raise UsageError(f"invalid store key {key!r}")
    return key


class Store(ABC):
    """Immutable objects by key. ``put(if_absent=True)`` is the commit primitive."""

    #: URL this store was opened from (for messages).
    url: str = ""
    #: Requests worth keeping in flight at once (readers size their I/O threads by it).
    io_concurrency: int = 4

    def get(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """Bytes of ``key``; ``byte_range=(offset, length)`` reads a slice.

        Raises ObjectNotFoundError if absent, CorruptObjectError if the range runs past the end.
        """
        check_key(key)
        if byte_range is not None:
            offset, length = byte_range
            if offset < 0 or length < 0:
                raise UsageError(f"invalid byte range {byte_range} for {key}")
        return self._get(key, byte_range)

    def put(self, key: str, data: bytes | bytearray | memoryview, *, if_absent: bool = False) -> None:
        """Write ``key`` atomically: readers see the old object, nothing, or all of ``data``.

        With ``if_absent``, raises ObjectExistsError when ``key`` exists; of several racing
        writers exactly one succeeds.
        """
        check_key(key)
        self._put(key, data, if_absent)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with ``prefix``, in lexicographic order."""
        if prefix:
            check_key(prefix.rstrip("/"))
        return self._list(prefix)

    def delete(self, key: str) -> None:
        """Remove ``key``; deleting an absent key is not an error."""
        check_key(key)
        self._delete(key)

    def size(self, key: str) -> int:
        """Size in bytes; raises ObjectNotFoundError if absent."""
        check_key(key)
        return self._size(key)

    def exists(self, key: str) -> bool:
        from deltasync.errors import ObjectNotFoundError

        try:
            self.size(key)
        except ObjectNotFoundError:
            return False
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or handles."""

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


class WrappingStore(Store):
    """Passes every operation to ``inner``; a wrapper (a counter, a throttle, a cache)
    overrides only the hooks it changes. Validation already happened in the public method."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.url = inner.url
        self.io_concurrency = inner.io_concurrency

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

    def close(self) -> None:
        self.inner.close()

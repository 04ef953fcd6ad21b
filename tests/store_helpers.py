"""Stores for tests that watch what a component asks of its store."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from deltasync.storage import Store, WrappingStore


class RequestLog(WrappingStore):
    """Delegates to ``inner``; records every request, in order, as ``(op, key)`` (``op``: get,
    put, list, size or delete; ``key``: the key, or the prefix of a list)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _note(self, op: str, key: str) -> None:
        with self._lock:
            self.log.append((op, key))

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        self._note("get", key)
        return super()._get(key, byte_range)

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        self._note("put", key)
        super()._put(key, data, if_absent)

    def _list(self, prefix: str) -> Iterator[str]:
        self._note("list", prefix)
        return super()._list(prefix)

    def _size(self, key: str) -> int:
        self._note("size", key)
        return super()._size(key)

    def _delete(self, key: str) -> None:
        self._note("delete", key)
        super()._delete(key)

"""In-memory store: for tests and for embedding in one process (``memory://name``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from ..errors import ObjectExistsError, ObjectNotFoundError
from ._base import Store, read_held


class MemoryStore(Store):
    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        with self._lock:
            data = self._objects.get(key)
        if data is None:
            raise ObjectNotFoundError(key)
        return read_held(key, data, byte_range)

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        blob = bytes(data)
        with self._lock:
            if if_absent and key in self._objects:
                raise ObjectExistsError(key)
            self._objects[key] = blob

    def _list(self, prefix: str) -> Iterator[str]:
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix))
        return iter(keys)

    def _delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(key, None)

    def _size(self, key: str) -> int:
        with self._lock:
            data = self._objects.get(key)
        if data is None:
            raise ObjectNotFoundError(key)
        return len(data)

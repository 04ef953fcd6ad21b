"""Reading chunk payloads out of packs, with few requests and many in flight.

A pull knows up front which byte ranges of which packs it will read. A pack that the pull
reads mostly (by bytes) is fetched whole, once, and sliced (unless the store holds ranges of it
close by: ``Store.prefers_ranges``); scattered small reads stay ranged reads. Whole packs are
held only until their last expected reader took its slice, and never more than ``max_cached``
bytes of them at once. Every read stays within what the
verified manifest declares: chunk ranges inside their pack's declared size, whole packs no
larger than it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import ObjectTooLargeError
from ..storage import Store


@dataclass
class _Usage:
    size: int
    needed: int = 0
    readers: int = 0  # expected reads still to come
    expected: int = 0  # expected reads in all


class PackFetcher:
    """Thread-safe payload reads for one pull."""

    def __init__(self, store: Store, *, whole_fraction: float = 0.5, max_cached: int = 256 << 20) -> None:
        self.store = store
        self.whole_fraction = whole_fraction
        self.max_cached = max_cached
        self._usage: dict[str, _Usage] = {}
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cached_bytes = 0
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_read = 0

    def expect(self, key: str, pack_size: int, length: int) -> None:
        """Announce (before reading) that a chunk of ``length`` bytes will be read from ``key``."""
        u = self._usage.get(key)
        if u is None:
            u = self._usage[key] = _Usage(pack_size)
        u.needed += length
        u.readers += 1
        u.expected += 1

    def _whole(self, key: str) -> bool:
        u = self._usage.get(key)
        return (u is not None and u.expected > 1 and u.needed >= self.whole_fraction * u.size and u.size <= self.max_cached
                and not self.store.prefers_ranges(key))

    def get(self, key: str, offset: int, length: int) -> bytes:
        if not self._whole(key):
            return self._read(key, (offset, length))
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # single flight: one reader fetches the pack, the rest wait for it
            if not self._whole(key):  # an earlier reader found it larger than declared
                return self._read(key, (offset, length))
            with self._lock:
                data = self._cache.get(key)
                if data is not None:
                    self._cache.move_to_end(key)
            if data is None:
                # Whole, but never beyond the size the verified manifest declares. A pack
                # larger than that is not read whole: its chunks are read by their ranges,
                # which the manifest declares and their digests check.
                try:
                    data = self._read(key, None, max_bytes=self._usage[key].size)
                except ObjectTooLargeError:
                    with self._lock:
                        self._usage[key].expected = 0  # ranged reads from now on
                    return self._read(key, (offset, length))
                with self._lock:
                    self._cache[key] = data
                    self._cached_bytes += len(data)
                    while self._cached_bytes > self.max_cached and len(self._cache) > 1:
                        _, dropped = self._cache.popitem(last=False)
                        self._cached_bytes -= len(dropped)
        with self._lock:
            u = self._usage[key]
            u.readers -= 1
            if u.readers <= 0 and key in self._cache:
                self._cached_bytes -= len(self._cache.pop(key))
        if offset + length > len(data):
            # Let the store raise its own error for a range past the end of the object.
            return self._read(key, (offset, length))
        return data[offset : offset + length]

    def _read(self, key: str, byte_range: tuple[int, int] | None, *, max_bytes: int | None = None) -> bytes:
        data = self.store.get(key, byte_range, max_bytes=max_bytes)
        with self._lock:
            self.requests += 1
            self.bytes_read += len(data)
        return data

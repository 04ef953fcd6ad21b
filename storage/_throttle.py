"""A store wrapper that limits read bandwidth: a WAN link of fixed speed, for benchmarks and tests."""

from __future__ import annotations

import threading
import time

from ..errors import UsageError
from ._base import Store, WrappingStore


class ThrottledStore(WrappingStore):
    """Reads from ``inner`` at no more than ``bytes_per_second`` in total (all threads together).

    Bytes are paid for as they are returned, as a link would deliver them; counters record
    what crossed the link (``bytes_read``, ``requests``). Writes pass through unthrottled.
    """

    def __init__(self, inner: Store, bytes_per_second: float) -> None:
        if not bytes_per_second > 0:
            raise UsageError(f"bytes_per_second must be positive, got {bytes_per_second}")
        super().__init__(inner)
        self.rate = float(bytes_per_second)
        self.bytes_read = 0
        self.requests = 0
        self._free_at = time.monotonic()
        self._lock = threading.Lock()

    def _pay(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + n / self.rate
            done = self._free_at
            self.bytes_read += n
            self.requests += 1
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        data = self.inner.get(key, byte_range)
        self._pay(len(data))
        return data

"""Progress lines for long operations: bytes and rate on a terminal, silent otherwise."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Counts bytes done out of a total; redraws at most a few times a second on a TTY."""

    def __init__(self, label: str, total: int, *, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.label = label
        self.total = total
        self.done = 0
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._lock = threading.Lock()

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.enabled and now - self._last_draw >= 0.2:
                self._last_draw = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        pct = f"{100 * self.done / self.total:5.1f}% " if self.total else ""
        line = (
            f"\r{self.label}: {pct}{human_bytes(self.done)} / {human_bytes(self.total)}"
            f"  {human_bytes(self.done / elapsed)}/s"
        )
        self.stream.write(line.ljust(78))
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()

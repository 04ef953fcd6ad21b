"""The store a packcast node's engine reads through: objects received from the group first.

See :mod:`deltasync.engines.packcast`. Received packs are checked against their content
address on arrival; what did not arrive, or arrived corrupt, is read from the store behind.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..format.digest import digest
from ..storage import Store, WrappingStore, open_store, read_held, read_limit

log = logging.getLogger("deltasync.engines")

PACK_PREFIX = "packs/"
_RETAIN = ("manifests/", "squashes/")


class PackCache(WrappingStore):
    """A store that serves objects received from a packcast first and reads the rest from ``inner``.

    A read of an object announced by :meth:`expect` waits until it arrives (or the round
    gives up on it, then it is read from ``inner``). Packs are checked against their content
    address on arrival; a whole-object read of a pack hands it over and forgets it (a pull
    reads a pack whole once). Objects arriving faster than the engine decodes them pile up:
    with ``spill_dir``, those beyond ``memory_bytes`` are written there (a few times a version's
    stored bytes of disk at most, never the model) and read back from the page cache, so memory
    stays bounded whatever the size of a version. Counters: ``received_bytes`` (offered and
    accepted), ``upstream_bytes`` (read from ``inner``), ``spilled_bytes``, ``rejected`` (keys
    dropped as corrupt on arrival).

    A node holding only some chunks (a shard) is offered only the byte ranges of a pack that
    its pull reads (:meth:`offer_parts`): ranged reads inside them are served from memory, any
    other read of that pack from ``inner``. Parts cannot be checked against the pack's content
    address; every chunk read from them is checked against its digest when decoded, and a
    round whose staging fails verification is staged again from ``inner`` (packcast.py).
    """

    def __init__(
        self,
        inner: Store | str,
        *,
        wait_timeout: float = 120.0,
        memory_bytes: int = 256 << 20,
        spill_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(open_store(inner) if isinstance(inner, str) else inner)
        if memory_bytes < 0:
            raise UsageError(f"memory_bytes must not be negative, got {memory_bytes}")
        self.wait_timeout = wait_timeout
        self.memory_bytes = memory_bytes
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.spilled_bytes = 0
        self._held = 0  # bytes of received objects in memory
        self.received_bytes = 0
        self.upstream_bytes = 0
        self.rejected: list[str] = []
        self._objects: dict[str, bytes | Path] = {}
        self._parts: dict[str, list[tuple[int, bytes]]] = {}  # key -> (offset, bytes) sorted, of a pack held in part
        self._in_part: set[str] = set()  # announced to come in part (until forget)
        self._coming: set[str] = set()
        self._retained: OrderedDict[str, bytes] = OrderedDict()  # manifests read from inner (node 0 sends them)
        self._cond = threading.Condition()

    def expect(self, keys: Iterable[str], *, in_part: Iterable[str] = ()) -> None:
        """Announce objects on their way: reads of them wait. ``in_part``: those of which only
        some ranges come (:meth:`offer_parts`); a pull reads them by their ranges."""
        with self._cond:
            self._coming.update(k for k in keys if k not in self._objects)
            self._in_part.update(in_part)

    def prefers_ranges(self, key: str) -> bool:
        with self._cond:
            return key in self._in_part or key in self._parts

    def offer(self, key: str, data: bytes) -> bool:
        """Hand over an object received; False when it is refused (a pack not matching its key)."""
        ok = not key.startswith(PACK_PREFIX) or key == f"{PACK_PREFIX}{digest(memoryview(data)).hex()}.pack"
        with self._cond:
            spill = ok and self.spill_dir is not None and self._held + len(data) > self.memory_bytes
        held: bytes | Path = data
        if spill:
            assert self.spill_dir is not None
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            held = self.spill_dir / key.replace("/", "__")
            held.write_bytes(data)
        with self._cond:
            self._coming.discard(key)
            if ok:
                self._drop(key)
                self._objects[key] = held
                self.received_bytes += len(data)
                if spill:
                    self.spilled_bytes += len(data)
                else:
                    self._held += len(data)
            else:
                self.rejected.append(key)
            self._cond.notify_all()
        if not ok:
            log.warning("packcast: %s arrived corrupt; reading it from %s", key, self.inner.url or "upstream")
        return ok

    def offer_parts(self, key: str, parts: list[tuple[int, bytes]]) -> None:
        """Hand over byte ranges ``(offset, bytes)`` of an object received (a shard's share of a pack)."""
        merged: list[tuple[int, bytes]] = []
        for off, data in sorted(parts, key=lambda p: p[0]):
            if merged and merged[-1][0] + len(merged[-1][1]) == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + data)
            else:
                merged.append((off, data))
        n = sum(len(d) for _, d in merged)
        with self._cond:
            self._coming.discard(key)
            self._drop(key)
            self._parts[key] = merged
            self._held += n
            self.received_bytes += n
            self._cond.notify_all()

    @property
    def watch(self) -> Any:
        """The store's push stream (a relay's Watch), when it has one: an agent reading through
        the cache is woken by it as it would be by the relay (None: it polls)."""
        return getattr(self.inner, "watch", None)

    def give_up(self) -> None:
        """Stop waiting for what was announced: it is read from ``inner`` instead."""
        with self._cond:
            self._coming.clear()
            self._cond.notify_all()

    def forget(self) -> None:
        """Drop every object received (the end of a round, or a retry from ``inner``)."""
        with self._cond:
            for key in [*self._objects, *self._parts]:
                self._drop(key)
            self._coming.clear()
            self._in_part.clear()
            self._cond.notify_all()

    def _drop(self, key: str) -> None:
        for _, data in self._parts.pop(key, ()):
            self._held -= len(data)
        held = self._objects.pop(key, None)
        if isinstance(held, Path):
            held.unlink(missing_ok=True)
        elif held is not None:
            self._held -= len(held)

    def add_upstream(self, n: int) -> None:
        """Count bytes read from ``inner`` for the cache by its node (node 0's fetch)."""
        with self._cond:
            self.upstream_bytes += n

    def retained(self, key: str) -> bytes | None:
        """A manifest or squash this cache read whole from ``inner`` lately."""
        with self._cond:
            return self._retained.get(key)

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        deadline = time.monotonic() + self.wait_timeout
        with self._cond:
            while (key in self._coming and key not in self._objects and key not in self._parts
                   and time.monotonic() < deadline):
                self._cond.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            held = self._objects.get(key)
            part = _within(self._parts.get(key, ()), byte_range) if held is None else None
        if part is not None:
            return part
        data = _read_held(held) if isinstance(held, Path) else held  # a spilled one, outside the lock
        with self._cond:
            if held is not None and self._objects.get(key) is held:
                if data is None:
                    self._objects.pop(key, None)  # a spilled file gone: read it from inner
                elif byte_range is None and key.startswith(PACK_PREFIX):
                    self._drop(key)  # a pull reads a pack whole once
        if data is None:
            data = self.inner.get(key, byte_range, max_bytes=read_limit() if byte_range is None else None)
            with self._cond:
                self.upstream_bytes += len(data)
                if byte_range is None and key.startswith(_RETAIN):
                    self._retained[key] = data
                    while len(self._retained) > 64:
                        self._retained.popitem(last=False)
            return data
        return read_held(key, data, byte_range)

    def _size(self, key: str) -> int:
        with self._cond:
            held = self._objects.get(key)
        if isinstance(held, Path):
            return held.stat().st_size
        return len(held) if held is not None else self.inner.size(key)


def _within(parts: Iterable[tuple[int, bytes]], byte_range: tuple[int, int] | None) -> bytes | None:
    """The bytes of ``byte_range`` when one of ``parts`` holds them all (None: read them upstream)."""
    if byte_range is None:
        return None
    start, length = byte_range
    for off, data in parts:
        if off <= start and start + length <= off + len(data):
            return data[start - off : start - off + length]
    return None


def _read_held(path: Path) -> bytes | None:
    try:
        return path.read_bytes()  # from the page cache: it was written a moment ago
    except OSError:
        return None

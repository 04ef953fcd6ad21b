"""Packs an upstream relay pushes on its Watch stream (issue 30 item 2).

A relay behind a long link learns of a version from its upstream relay's event, which carries
the version's manifest when small (feed.py); asking for the packs then costs one round trip
across the link before their first byte. So a relay following a relay asks for pushes
(``WatchRequest.push_bytes``, ``RelayConfig.push_bytes``): the upstream names the packs of a
new version right in its event (``VersionEvent.pushed``, when they total at most what the
watcher asked for) and sends their bytes on the stream right after it, from its cache.

:class:`PushedPacks` is the upstream as this relay's fetches of those packs see it: a read of a
pushed pack waits until all of it has come and matches the digest its key names, then is
answered from it; a read of any other object, or of a pushed pack the upstream dropped, that
stopped coming for :data:`STALL_SECONDS`, whose stream ended, or whose bytes are not that
pack, goes to the upstream as any fetch does. So a push is only a faster way to the same
bytes: the cache checks them again as it checks everything it fetches, and nothing a push
does wrong reaches a reader. Relays of a cluster (``cluster_relays``) ask for none: each
fetches only its share of a version over its own link.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..storage import Store, WrappingStore, valid_key
from ..v1 import relay_pb2 as pb
from .cache import content_problem

log = logging.getLogger("deltasync.relay")

__all__ = ["STALL_SECONDS", "PushedPacks"]

#: Seconds without a byte of a pushed pack after which its fetch reads it from the upstream.
STALL_SECONDS = 5.0


@dataclass
class _Pushed:
    size: int
    data: bytearray = field(default_factory=bytearray)
    state: str = "coming"  # "whole" (all of it came, intact) or "missed" (read it from the upstream)
    since: float = field(default_factory=time.monotonic)  # when its last byte came (or it was named)


class PushedPacks(WrappingStore):
    """The upstream, with the packs its Watch stream pushes held in front of it (module doc).
    Fed by the thread that follows the stream (:meth:`expect`, :meth:`piece`, :meth:`end`); read
    by this relay's fetches; thread-safe."""

    def __init__(self, upstream: Store, limit: int) -> None:
        super().__init__(upstream)
        self.limit = limit
        """The most bytes of packs one event may name (what this relay asks for)."""
        self._objects: dict[str, _Pushed] = {}
        self._changed = threading.Condition()
        self.landed = 0
        """Packs that came whole and intact."""
        self.missed = 0
        """Packs named that were read from the upstream after all (dropped, stalled, cut, bad)."""

    def expect(self, objects: Iterable[pb.PushedObject]) -> list[pb.PushedObject]:
        """(Follower thread) A new event names ``objects`` as following on the stream: the
        pushes of earlier events still coming are given up (the stream is past them). The
        objects now expected (none where the event names anything odd or too many bytes)."""
        named = list(objects)
        with self._changed:
            for pushed in self._objects.values():
                self._miss(pushed, "a newer version's event came first")
            keys = {o.key for o in named}
            if (sum(o.size for o in named) > self.limit or len(keys) != len(named)
                    or not all(o.key.startswith("packs/") and valid_key(o.key) for o in named)):
                if named:
                    log.warning("the upstream relay's push names %d objects, %d bytes, not the packs asked for "
                                "(at most %d bytes): reading them as before", len(named), sum(o.size for o in named),
                                self.limit)
                return []
            for o in named:
                self._objects.setdefault(o.key, _Pushed(o.size))
            return named

    def piece(self, piece: pb.PushedPiece) -> None:
        """(Follower thread) Bytes of a pushed pack, in order; a gap or an overrun gives it up."""
        with self._changed:
            pushed = self._objects.get(piece.key)
            if pushed is None or pushed.state != "coming":
                return
            if piece.dropped:
                self._miss(pushed, "the upstream relay could not send it")
            elif piece.offset != len(pushed.data) or len(pushed.data) + len(piece.data) > pushed.size:
                self._miss(pushed, f"a piece at {piece.offset} after {len(pushed.data)} of {pushed.size} bytes")
            else:
                pushed.data += piece.data
                pushed.since = time.monotonic()
                if len(pushed.data) == pushed.size:
                    problem = content_problem(piece.key, pushed.data)
                    if problem is None:
                        pushed.state = "whole"
                        self.landed += 1
                    else:
                        self._miss(pushed, problem)
            self._changed.notify_all()

    def end(self) -> None:
        """(Follower thread) The stream ended: what has not come whole is read from the upstream."""
        with self._changed:
            for pushed in self._objects.values():
                self._miss(pushed, "the upstream relay's stream ended")
            self._changed.notify_all()

    def discard(self, key: str) -> None:
        """Its fetch is over (or not needed): let go of its bytes."""
        with self._changed:
            self._objects.pop(key, None)

    def _miss(self, pushed: _Pushed, why: str) -> None:
        if pushed.state == "coming":
            log.info("a pushed pack is read from the upstream instead: %s", why)
            pushed.state = "missed"
            pushed.data = bytearray()
            self.missed += 1

    def _whole(self, key: str, byte_range: tuple[int, int] | None) -> bytes | None:
        """The pushed bytes of ``key`` (or of a range within it) once all came intact; None:
        read it from the upstream."""
        with self._changed:
            while True:
                pushed = self._objects.get(key)
                if pushed is None or pushed.state == "missed":
                    return None
                if pushed.state == "whole":
                    if byte_range is None:
                        return bytes(pushed.data)
                    offset, length = byte_range
                    if offset + length > len(pushed.data):  # the upstream answers a range past the end
                        return None
                    return bytes(pushed.data[offset : offset + length])
                left = STALL_SECONDS - (time.monotonic() - pushed.since)
                if left <= 0:
                    self._miss(pushed, f"no byte of it for {STALL_SECONDS:.0f} s")
                    return None
                self._changed.wait(left)

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        data = self._whole(key, byte_range)
        return super()._get(key, byte_range) if data is None else data

"""How far away a relay's upstream is, measured (:class:`UpstreamGauge`): its round trip and
the rate its pieces arrive at, from which the relay sizes how many ranged reads it keeps in
flight, all its fetches together: rate x round trip / piece size, a quarter more, plus one, between
four (the fixed number before: an S3 upstream, whose requests are each slower than its link,
keeps it) and a memory bound (``fetch_pieces_in_flight`` x ``fetch_piece_bytes``).

The round trip is sampled by the size request that opens each large fetch (one request, no
payload: its whole time is a round trip and the upstream's service time), and, where fetches
know their sizes already (packs warmed by the sizes their manifest names), by a size request
sent beside them, on a thread of its own, when none was timed for :data:`ROUND_TRIP_EVERY`
seconds (:meth:`UpstreamGauge.claim_round_trip`), so a warming relay sizes its reads from the
measured link too; the rate, over the
time at least one piece is in flight, by the bytes of the pieces that complete. While the
reads in flight are what limits a transfer, the rate measured is about their bytes per round
trip, so the number asked for is a quarter more than what is in flight: it grows by a
quarter a sample (from 4 to 30 pieces in some ten) until the link, not the pieces, is the
bound, and stays there with that headroom (a window that opens as a congestion window does,
without a loss to close it: the link's rate, and the memory bound, stop it)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

_SAMPLE_SECONDS = 0.25  # the rate is sampled over at least this much busy time
_WEIGHT = 0.75  # of a new sample in the moving averages
_HEADROOM = 1.25  # pieces asked for over the measured rate x round trip
#: Seconds after which fetches that need no size request time one anyway (claim_round_trip).
ROUND_TRIP_EVERY = 30.0


class UpstreamGauge:
    """(Threads) The upstream's measured round trip and rate, and the slots of ranged reads
    in flight that follow from them (:meth:`acquire`, :meth:`release`)."""

    def __init__(self, piece_bytes: int, most: int, least: int = 4, start: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.piece_bytes = piece_bytes
        self.most = max(1, most)
        self.least = max(1, min(least, self.most))
        self.round_trip: float | None = None
        self.rate: float | None = None  # bytes per second, all pieces together
        self._target = max(self.least, min(start, self.most))
        self._clock = clock
        self._lock = threading.Condition()
        self._in_flight = 0
        self._held = 0  # pieces requested and not yet written, all downloads (the memory bound)
        self._busy_since: float | None = None  # start of the current sample's busy time
        self._busy = 0.0  # busy seconds in the current sample
        self._bytes = 0  # bytes completed in the current sample
        self.peak_in_flight = 0
        self._timed_at: float | None = None  # when the last round trip was timed
        self._timing = False  # a round trip claimed (claim_round_trip) and not yet timed

    @property
    def target(self) -> int:
        """Ranged reads to keep in flight, all fetches together."""
        return self._target

    def timed_round_trip(self, seconds: float) -> None:
        with self._lock:
            self.round_trip = seconds if self.round_trip is None else (
                _WEIGHT * seconds + (1 - _WEIGHT) * self.round_trip)
            self._timed_at, self._timing = self._clock(), False
            self._retarget()

    def claim_round_trip(self) -> bool:
        """Whether the caller, a fetch that sends no size request, should time one now (none
        timed for :data:`ROUND_TRIP_EVERY` seconds, or ever, and no other caller is timing one):
        it then reports with :meth:`timed_round_trip`, or :meth:`untimed` when the request failed."""
        with self._lock:
            if self._timing or (self._timed_at is not None and self._clock() - self._timed_at < ROUND_TRIP_EVERY):
                return False
            self._timing = True
            return True

    def untimed(self) -> None:
        """A claimed round trip could not be timed (the request failed): the next fetch may try."""
        with self._lock:
            self._timing = False

    def acquire(self, holding: int) -> None:
        """Wait for a slot for one more ranged read. ``holding``: slots the caller holds
        already; one holding none is never kept waiting (each fetch makes progress)."""
        with self._lock:
            while holding and self._in_flight >= self._target:
                self._lock.wait()
            if self._in_flight == 0:
                self._busy_since = self._clock()
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)

    def try_acquire(self, requesting: int, holding: int) -> bool:
        """Take a request slot and a memory slot for one more piece, if both are free; a
        caller ``requesting`` none always gets the request slot and one ``holding`` none the
        memory slot (each download makes progress). Release with :meth:`release` when its read
        ends and :meth:`written` when it is written (or dropped)."""
        with self._lock:
            if (requesting and self._in_flight >= self._target) or (holding and self._held >= self.most):
                return False
            if self._in_flight == 0:
                self._busy_since = self._clock()
            self._in_flight += 1
            self._held += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            return True

    def try_hold(self, holding: int) -> bool:
        """Take a memory slot only, for a piece read from elsewhere than the upstream (another
        relay of the cluster, which reads it over its own link): its read holds no request
        slot of this link and its bytes are not this link's rate. One ``holding`` none always
        gets it. Give it back with :meth:`written`."""
        with self._lock:
            if holding and self._held >= self.most:
                return False
            self._held += 1
            return True

    def written(self) -> None:
        """A piece taken with :meth:`try_acquire` was written (or dropped): its memory slot back."""
        with self._lock:
            self._held -= 1
            self._lock.notify_all()

    def release(self, n_bytes: int) -> None:
        """A ranged read ended, ``n_bytes`` received (0: it failed or was cancelled)."""
        with self._lock:
            self._in_flight -= 1
            self._bytes += n_bytes
            now = self._clock()
            if self._busy_since is not None:
                self._busy += now - self._busy_since
                self._busy_since = now if self._in_flight else None
            if self._busy >= _SAMPLE_SECONDS and self._bytes:
                sample = self._bytes / self._busy
                self.rate = sample if self.rate is None else _WEIGHT * sample + (1 - _WEIGHT) * self.rate
                self._bytes, self._busy = 0, 0.0
                self._retarget()
            self._lock.notify_all()

    def _retarget(self) -> None:
        if self.rate is None or self.round_trip is None:
            return
        wanted = math.ceil(_HEADROOM * self.rate * self.round_trip / self.piece_bytes) + 1
        self._target = max(self.least, min(self.most, wanted))
        self._lock.notify_all()

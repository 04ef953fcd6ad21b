"""The relays of one cluster sharing its ingress (issue 30 item 3): :class:`ClusterShares`.

Relays serving one cluster side by side (``--cluster-relays A,B,…``, the same list on each,
as the cluster's agents name them) split every large object they fetch into shares: piece
``i`` of an object is *owned* by relay ``(h(key) + i) mod n`` of the list (``h``: the first
8 bytes of the key's xxh3-128, the same in every process). A relay fetching an object reads
the pieces it owns from its own upstream, across its own long link, and every other piece
from the relay that owns it, inside the cluster (a ranged Get, answered from that relay's
own fetch of the object as it lands: a relay asked for a piece of an object it is not yet
fetching starts fetching it, and so fills the asker while the asker fills it). Each relay
ends with the whole object, checked against its name as always (a piece from a peer is no
more trusted than one from the upstream: the whole object's digest covers it), so any of
them serves any reader; each long link carries about ``1/n`` of the cluster's bytes, and
the cluster's ingress is the sum of its links.

A peer that cannot give its piece (down, its link cut, any error) is not waited for: that
piece is read from this relay's own upstream instead, and the peer is passed over for
:data:`PEER_DOWN_SECONDS` (its pieces all come from the upstream meanwhile). An object whose
bytes did not match its name after some pieces came from peers is fetched again with every
piece from the upstream (:meth:`ClusterShares.distrust`), so a broken peer costs one retry,
never a version.

Objects up to ``min_share`` (1 MiB) are not split (a manifest, a small blob); larger ones are
cut into at least ``n`` pieces (at most ``piece_bytes`` each), so a small delta's one pack
still crosses every link in shares.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Sequence

from ..format.digest import digest
from ..storage import Store
from .config import check_members

log = logging.getLogger("deltasync.relay")

#: Seconds a peer that failed to give a piece is passed over (its pieces read upstream).
PEER_DOWN_SECONDS = 5.0
#: Objects up to this many bytes are fetched whole by each relay, not in shares.
MIN_SHARE_BYTES = 1 << 20


class ClusterShares:
    """(Threads) Which relay of the cluster fetches each piece of an object over its own link,
    and the reads of the other relays' pieces from them (see the module doc).

    Args:
        members: the cluster's relays, ``host:port`` each, this one included, in the same order
            on every relay of the cluster.
        me: this relay's entry in ``members``.
        token: the read token the peers require (the cluster's relays share it).
        tls: whether the peers serve TLS (``grpcs://``; the CA from ``$DELTASYNC_RELAY_CA``).
        piece_bytes: the largest piece (``fetch_piece_bytes``).
    """

    def __init__(self, members: Sequence[str], me: str, *, token: str | None = None, tls: bool = False,
                 piece_bytes: int = 8 << 20, min_share: int = MIN_SHARE_BYTES) -> None:
        from ..storage import GrpcStore  # grpcio: the relay has it loaded already

        self.members = check_members(members, me)
        self.index = self.members.index(me)
        self.piece_bytes = piece_bytes
        self.min_share = min_share
        scheme = "grpcs" if tls else "grpc"
        self._peers: dict[int, Store] = {
            i: GrpcStore(f"{scheme}://{m}", token=token) for i, m in enumerate(self.members) if i != self.index
        }
        self._down_until: dict[int, float] = {}
        self._distrusted: set[str] = set()  # keys whose last fetch with peer pieces did not verify
        self._lock = threading.Lock()
        self.counters = {"peer_pieces": 0, "peer_bytes": 0, "peer_fallbacks": 0, "own_pieces": 0, "own_bytes": 0}

    @property
    def size(self) -> int:
        return len(self.members)

    def splits(self, size: int) -> bool:
        """Whether an object of ``size`` bytes is fetched in shares."""
        return size > self.min_share

    def piece_size(self, size: int) -> int:
        """The size of the pieces an object of ``size`` bytes is cut into: a multiple of ``n``
        pieces (each relay owns as many), as few as keep them within ``piece_bytes``."""
        count = self.size * math.ceil(size / (self.size * self.piece_bytes))
        return max(1, math.ceil(size / count))

    def owner(self, key: str, piece: int) -> int:
        """The index (in ``members``) of the relay whose link carries piece ``piece`` of ``key``."""
        return (int.from_bytes(digest(key.encode())[:8], "big") + piece) % self.size

    def peer(self, key: str, piece: int) -> tuple[int, Store] | None:
        """The peer to read piece ``piece`` of ``key`` from; None: this relay's own upstream
        (its own share, a peer passed over, or an object whose peer pieces failed its check)."""
        owner = self.owner(key, piece)
        if owner == self.index:
            return None
        with self._lock:
            if key in self._distrusted or self._down_until.get(owner, 0.0) > time.monotonic():
                return None
        return owner, self._peers[owner]

    def read(self, key: str, offset: int, length: int, piece: int, upstream: Store) -> tuple[bytes, bool]:
        """Piece ``piece`` (``offset``, ``length``) of ``key``: from the relay that owns it,
        else (its own, or the peer failed) from ``upstream``. Also whether a peer gave it."""
        got = self.peer(key, piece)
        if got is not None:
            owner, store = got
            try:
                data = store.get(key, (offset, length))
            except Exception as e:  # any failure of a peer: the upstream instead, the peer passed over
                with self._lock:
                    self._down_until[owner] = time.monotonic() + PEER_DOWN_SECONDS
                    self.counters["peer_fallbacks"] += 1
                log.info("cluster relay %s did not give %s %d+%d (%s): read from the upstream",
                         self.members[owner], key, offset, length, e)
            else:
                if len(data) == length:
                    with self._lock:
                        self.counters["peer_pieces"] += 1
                        self.counters["peer_bytes"] += length
                    return data, True
                with self._lock:
                    self.counters["peer_fallbacks"] += 1
        data = upstream.get(key, (offset, length))
        with self._lock:
            self.counters["own_pieces"] += 1
            self.counters["own_bytes"] += len(data)
        return data, False

    def distrust(self, key: str) -> None:
        """``key``'s bytes did not match its name after pieces came from peers: its next fetch
        reads every piece from the upstream."""
        with self._lock:
            self._distrusted.add(key)
            if len(self._distrusted) > 4096:
                self._distrusted.clear()

    def trusted(self, key: str) -> None:
        """``key`` landed and verified: forget a distrust of it."""
        with self._lock:
            self._distrusted.discard(key)

    def close(self) -> None:
        for store in self._peers.values():
            with contextlib.suppress(Exception):
                store.close()

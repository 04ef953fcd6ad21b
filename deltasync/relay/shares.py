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

A peer that cannot give its piece (down, its link cut, any error, or silent for
:data:`PEER_IDLE_SECONDS`: no message of the piece's stream in that time) is not waited for:
that piece is read from this relay's own upstream instead, and the peer is passed over for
:data:`PEER_DOWN_SECONDS` (its pieces all come from the upstream meanwhile). A read of a
peer's piece says so (:data:`PEER_METADATA`): the peer starts its own download of that object
at once, from threads kept for such downloads, even when its ordinary downloads are all
taken (relay/fetch.py), so two relays each downloading objects the other has not started yet
never wait on each other. Peers are read with the read token alone, never a write token. An object whose
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
import os
import queue
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from ..errors import StoreError, UsageError
from ..format.digest import digest
from ..storage import Download, Store
from ..storage.wire import CA_ENV, CHUNK_BYTES, method_path, read_token
from ..v1 import relay_pb2 as pb
from .config import check_members

log = logging.getLogger("deltasync.relay")

#: Seconds a peer that failed to give a piece is passed over (its pieces read upstream).
PEER_DOWN_SECONDS = 5.0
#: Seconds a peer's piece may go without a message (its first one included) before it is
#: read from the upstream instead. Short: the peer answers from its own download of the
#: object, which its read of a piece starts at once (see the module doc), so a peer this slow
#: is stuck or overloaded, and the piece costs little more than its own read upstream.
PEER_IDLE_SECONDS = 5.0
#: Seconds one read of a peer's piece may take in all, however steadily its bytes come.
PEER_LIMIT_SECONDS = 60.0
#: Objects up to this many bytes are fetched whole by each relay, not in shares.
MIN_SHARE_BYTES = 1 << 20
#: Metadata key of a Get from another relay of the cluster for one of its pieces: the relay
#: asked starts that object's download without waiting for a free ordinary download slot.
PEER_METADATA = "deltasync-cluster-peer"


class ClusterShares:
    """(Threads) Which relay of the cluster fetches each piece of an object over its own link,
    and the reads of the other relays' pieces from them (see the module doc).

    Args:
        members: the cluster's relays, ``host:port`` each, this one included, in the same order
            on every relay of the cluster.
        me: this relay's entry in ``members``.
        token: the read token the peers require (the cluster's relays share it; None: the
            one in ``$DELTASYNC_RELAY_TOKEN(_FILE)``, if any). Never a write token.
        tls: whether the peers serve TLS (``grpcs://``; the CA from ``$DELTASYNC_RELAY_CA``).
        piece_bytes: the largest piece (``fetch_piece_bytes``).
        idle: seconds a peer's piece may go without a message (:data:`PEER_IDLE_SECONDS`).
    """

    def __init__(self, members: Sequence[str], me: str, *, token: str | None = None, tls: bool = False,
                 piece_bytes: int = 8 << 20, min_share: int = MIN_SHARE_BYTES,
                 idle: float = PEER_IDLE_SECONDS) -> None:
        self.members = check_members(members, me)
        self.index = self.members.index(me)
        self.piece_bytes = piece_bytes
        self.min_share = min_share
        self.idle = idle
        ca: bytes | None = None
        ca_path = os.environ.get(CA_ENV)
        if tls and ca_path:
            try:
                ca = Path(ca_path).read_bytes()
            except OSError as e:
                raise UsageError(f"cannot read CA certificate {ca_path}: {e.strerror}") from None
        read = read_token(token)  # (never $DELTASYNC_RELAY_WRITE_TOKEN: peers are only read)
        self._peers: dict[int, Peer] = {
            i: Peer(m, tls=tls, ca=ca, token=read) for i, m in enumerate(self.members) if i != self.index
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

    def peer(self, key: str, piece: int) -> tuple[int, Peer] | None:
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
            owner, peer = got
            try:
                data = peer.read(key, offset, length, self.idle)
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
        for peer in self._peers.values():
            with contextlib.suppress(Exception):
                peer.close()


_END = object()


class Peer:
    """(Threads) Another relay of the cluster, read a piece at a time: ranged Gets marked as a
    peer's (:data:`PEER_METADATA`), with the read token only, each given up after ``idle``
    seconds without a message (so a stalled peer costs seconds, not a whole call's deadline)."""

    def __init__(self, address: str, *, tls: bool = False, ca: bytes | None = None, token: str | None = None) -> None:
        self.address = address
        options = [
            ("grpc.max_receive_message_length", 4 * CHUNK_BYTES),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 5_000),
        ]
        if tls:
            creds = grpc.ssl_channel_credentials(root_certificates=ca)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self._get = self.channel.unary_stream(
            method_path("Get"), request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=pb.GetChunk.FromString)
        metadata = [(PEER_METADATA, "1")]
        if token:
            metadata.append(("authorization", f"Bearer {token}"))
        self._metadata = tuple(metadata)

    def read(self, key: str, offset: int, length: int, idle: float) -> bytes:
        """``length`` bytes of ``key`` at ``offset``; StoreError when the peer sends nothing for
        ``idle`` seconds, grpc.RpcError when it refuses, CorruptObjectError when it sends
        other than exactly that range."""
        call = self._get(pb.GetRequest(key=key, offset=offset, length=length, has_range=True),
                         metadata=self._metadata, timeout=PEER_LIMIT_SECONDS)
        # The messages are read on a helper thread and waited for here with a timeout: a
        # blocked grpc read does not always end when its call does (storage/_grpc.py _Stream).
        inbox: queue.SimpleQueue[object] = queue.SimpleQueue()

        def pump() -> None:
            try:
                for message in call:
                    inbox.put(message)
                inbox.put(_END)
            except BaseException as e:  # handed to the reader
                inbox.put(e)

        threading.Thread(target=pump, name="deltasync-relay-peer", daemon=True).start()
        download = Download(key, (offset, length))  # the size announced, no byte more, no byte less
        try:
            while True:
                try:
                    item = inbox.get(timeout=idle)
                except queue.Empty:
                    raise StoreError(f"cluster relay {self.address} sent nothing of {key} for {idle:g} s") from None
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, pb.GetChunk)
                download.feed(item)
        finally:
            call.cancel()  # a no-op once the call is over
        return download.result()

    def close(self) -> None:
        self.channel.close()

"""A repository through relays: ``grpc://host:port[,host2:port2…][?timeout=SECONDS][&write_token_file=PATH]``.

Without a write token the store is read-only. Several relays may be named: a read of an
immutable object (a pack, blob, manifest or squash) goes to the relay its key hashes to, so a
version is read through all of them at once (a cluster's ingress is the sum of its relays'
links); other calls go to the one that answered last. When a relay is unreachable
(UNAVAILABLE, a deadline, a relay shutting down) the call goes to the next, so subscribers
ride through the loss of a relay. A read cut off mid-stream resumes at the byte where it
stopped on the next relay.

With a write token (``?write_token_file=``, ``$DELTASYNC_RELAY_WRITE_TOKEN(_FILE)``) and relays
serving with ``--accept-writes``, the store writes: each object is streamed to one relay in
1 MiB pieces with its xxh3-128 digest (the relay checks it before the object becomes
visible) under the credit the relay grants (on an upload session, where objects pipeline;
Upload, then Put, for relays before it: :mod:`._grpc_upload`), starting at the relay with the
fewest of this store's upload bytes in flight, so a publisher's concurrent pack uploads
(``upload_concurrency``, ``upload_bytes``) spread evenly over every relay named, and failing
over like reads. A manifest a relay refuses because what it names is missing raises
MissingReferencesError (``checks_references``: every relay named has said it checks).

The wire definition it shares with the server is :mod:`deltasync.storage.wire`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlparse

import grpc

from ..errors import (
    CorruptObjectError,
    DeltasyncError,
    MissingReferencesError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    UsageError,
)
from ..format.digest import digest
from ..v1 import relay_pb2 as pb
from . import _base
from ._base import Store, check_key, listing_too_long, read_limit, too_large
from ._grpc_upload import SESSION_TRIES, Stored, UploadSession, upload
from .wire import (
    BIDI_STREAM,
    CA_ENV as CA_ENV,
    CHUNK_BYTES,
    CLIENT_STREAM,
    METHODS,
    SERVER_STREAM,
    TOKEN_ENV as TOKEN_ENV,
    TOKEN_FILE_ENV as TOKEN_FILE_ENV,
    UNCREDITED_BYTES,
    WRITE_METHODS,
    WRITE_TOKEN_ENV,
    WRITE_TOKEN_FILE_ENV,
    method_path,
    read_token,
    read_write_token,
    status_error,
)

T = TypeVar("T")

DEFAULT_TIMEOUT = 120.0
_ROUNDS = 2  # passes over the relay list before a call gives up
_ROUND_PAUSE = 0.25

#: Codes after which the next relay is tried: this one is unreachable, overloaded or stopping.
#: Everything else (NOT_FOUND, OUT_OF_RANGE, INVALID_ARGUMENT, …) is an answer about the object.
FAILOVER_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)
#: For writes, RESOURCE_EXHAUSTED is the relay's answer (over its size cap or quota), not a
#: reason to push the same bytes at the next relay of the same repository.
WRITE_FAILOVER_CODES = FAILOVER_CODES - {grpc.StatusCode.RESOURCE_EXHAUSTED}
#: Keys whose reads are spread over the relays named by their hash (immutable objects).
_SHARDED_READS = ("packs/", "blobs/", "manifests/", "squashes/")
#: Keys of objects that name others, which a relay checks are there (``references_pending``).
_REFERRING = ("manifests/", "squashes/")
#: Uploads a writable store keeps in flight per relay named (threads; they pipeline on its
#: upload sessions, so the bytes they hold, not their count, is what fills a long link).
UPLOADS_PER_RELAY = 8
#: Bytes of packs a publisher holds waiting for or in upload, per relay named: about a long
#: link's bandwidth x round trip (800 Mbit/s x 200 ms is 20 MB) with room for the pack whose
#: answer is on its way, and within the memory four 64 MiB packs a relay took before.
UPLOAD_BYTES_PER_RELAY = 96 << 20
#: Upload sessions a writable store opens per relay named; uploads beyond them pipeline on
#: them (each call is granted at most the relay's ``--upload-window``, 32 MiB by default,
#: ahead of its disk: four cover about a 5 Gbit/s link at 200 ms).
SESSIONS_PER_RELAY = 4

#: Client keepalive: a dead TCP connection under an idle Watch stream is noticed in ~40 s.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_receive_message_length", 4 * CHUNK_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


def window_options(window: int) -> list[tuple[str, Any]]:
    """Channel options for a fixed receive window of ``window`` bytes from the first byte,
    with no BDP probing. grpc's own window starts at 64 KiB and grows with its BDP probes,
    about doubling per round trip: at 200 ms a link of 800 Mbit/s is full only after some
    seconds (the first 64 MiB took 1.5 s for 0.9 s of link, benchmarks/bench_wan.py). For a
    reader whose streams each carry a bounded amount it takes as it comes (a relay's pieces)."""
    return [("grpc.http2.lookahead_bytes", int(window)), ("grpc.http2.bdp_probe", 0)]


def parse_grpc_url(url: str) -> tuple[list[str], float]:
    """``grpc://h1:p1,h2:p2?timeout=30`` → (["h1:p1", "h2:p2"], 30.0). ``grpcs://`` is the same over TLS."""
    parsed = urlparse(url)
    if parsed.scheme.lower() not in ("grpc", "grpcs") or not parsed.netloc or parsed.path.strip("/"):
        raise UsageError(f"invalid relay URL {url!r} (expected grpc://host:port[,host:port…])")
    targets = [t.strip() for t in parsed.netloc.split(",") if t.strip()]
    for target in targets:
        host, sep, port = target.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"invalid relay address {target!r} in {url!r} (expected host:port)")
    options = dict(parse_qsl(parsed.query, keep_blank_values=True))
    unknown = sorted(set(options) - {"timeout", "write_token_file"})
    if unknown:
        raise UsageError(
            f"unknown relay URL option(s) {', '.join(unknown)} in {url!r} (known: timeout, write_token_file)"
        )
    timeout = DEFAULT_TIMEOUT
    if "timeout" in options:
        try:
            timeout = float(options["timeout"])
        except ValueError:
            timeout = -1.0
        if not timeout > 0:
            raise UsageError(f"relay URL option timeout={options['timeout']!r} is not a positive number of seconds")
    if not targets:
        raise UsageError(f"invalid relay URL {url!r} (expected grpc://host:port[,host:port…])")
    return targets, timeout


def describe(e: grpc.RpcError) -> str:
    """``code: details`` on one line."""
    code = e.code()
    details = " ".join(str(e.details() or "").split())
    name = code.name.lower() if code is not None else "error"
    return f"{name}: {details}" if details else name


_Interceptors: tuple[Any, ...] = (
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
)


class _BearerToken(*_Interceptors):  # type: ignore[misc]
    """Adds ``authorization: Bearer <token>`` to every call: the write token to writes, the
    read token to reads (the write token where there is none: it reads too), so a publisher's
    environment does not break its reads from relays that know only the read token."""

    def __init__(self, token: str | None, write_token: str | None = None) -> None:
        read = token or write_token
        self._read = ("authorization", f"Bearer {read}") if read else None
        self._write = ("authorization", f"Bearer {write_token}") if write_token else self._read
        self._writes = {method_path(name) for name in WRITE_METHODS}

    def _with_token(self, details: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        header = self._write if method in self._writes else self._read
        if header is None:
            return details
        metadata = [*(details.metadata or ()), header]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._with_token(details), request_iterator)


class _Details(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: Any, metadata: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _Relay:
    """One relay address: its channel and the methods bound to it."""

    def __init__(
        self,
        address: str,
        *,
        tls: bool = False,
        ca: bytes | None = None,
        token: str | None = None,
        write_token: str | None = None,
        window: int | None = None,
    ) -> None:
        self.address = address
        options = CHANNEL_OPTIONS if window is None else [*CHANNEL_OPTIONS, *window_options(window)]
        # Transport security and credentials: one place for every call.
        if tls:
            creds = grpc.ssl_channel_credentials(root_certificates=ca)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        if token or write_token:
            self.channel = grpc.intercept_channel(self.channel, _BearerToken(token, write_token))
        calls: dict[str, Any] = {}
        for name, (request, response, kind) in METHODS.items():
            factory = {
                SERVER_STREAM: self.channel.unary_stream, CLIENT_STREAM: self.channel.stream_unary,
                BIDI_STREAM: self.channel.stream_stream,
            }.get(kind, self.channel.unary_unary)
            calls[name] = factory(
                method_path(name), request_serializer=request.SerializeToString, response_deserializer=response.FromString
            )
        self.get, self.stat, self.list, self.watch = calls["Get"], calls["Stat"], calls["List"], calls["Watch"]
        self.put, self.upload, self.delete = calls["Put"], calls["Upload"], calls["Delete"]
        self.upload_session = calls["UploadSession"]
        self.legacy_put = False  # the relay predates Upload (answered UNIMPLEMENTED): Put is used
        self.legacy_upload = False  # the relay predates UploadSession: Upload is used
        # The relay refuses a manifest whose packs, blobs or parent are missing (learnt from
        # its upload sessions; a relay before that check never says so).
        self.checks_references = False
        self.orders_references = False
        self.commits_refs = False  # and commits a manifest sent with commit_latest (wire.UPLOAD_COMMITS)
        self._sessions: list[UploadSession] = []  # open upload sessions, shared by this store's uploads
        self._committing: list[UploadSession] = []  # open upload sessions that carry only manifests
        self._sessions_lock = threading.Lock()

    def take_session(self, referring: bool = False) -> UploadSession:
        """The upload session an object goes on: an open one with nothing waiting for an answer,
        else a new one, up to :data:`SESSIONS_PER_RELAY` (the relay stores a session's objects
        one after another: several calls store in parallel), else the open one with the fewest
        bytes waiting, the object pipelined behind them.

        ``referring``: a manifest whose packs are still on their way, which the relay may hold
        until they land: it goes on a session of manifests only, with nothing waiting for an
        answer (else a new one), so no pack it names can be queued behind it."""
        with self._sessions_lock:
            if referring:
                self._committing = [s for s in self._committing if s.alive]
                # taken first: a put raises pending_bytes before it clears taken
                idle = next((s for s in self._committing if not s.taken and s.pending_bytes == 0), None)
                if idle is None:
                    idle = UploadSession(self.upload_session, _Stream, self._checks)
                    self._committing.append(idle)
                idle.taken = True  # until its put counts its bytes (UploadSession.put)
                return idle
            self._sessions = [s for s in self._sessions if s.alive]
            least = min(self._sessions, key=lambda s: s.pending_bytes, default=None)
            if least is not None and (least.pending_bytes == 0 or len(self._sessions) >= SESSIONS_PER_RELAY):
                return least
            session = UploadSession(self.upload_session, _Stream, self._checks)
            self._sessions.append(session)
            return session

    def _checks(self, waits: bool, commits: bool) -> None:
        self.checks_references = True
        self.orders_references = waits
        self.commits_refs = commits

    def close_sessions(self) -> None:
        with self._sessions_lock:
            sessions, self._sessions, self._committing = self._sessions + self._committing, [], []
        for session in sessions:
            session.close()


class GrpcStore(Store):
    """A repository read through one or more relays (``deltasync serve``).

    Args:
        url: ``grpc://host:port``, several comma-separated for failover (and write sharding),
            ``?timeout=SECONDS``, ``&write_token_file=PATH``.
        timeout: deadline of one call (a whole Get stream included); overrides the URL's.
        write_token, write_token_file: the relays' write token (else the URL's
            ``write_token_file``, else ``$DELTASYNC_RELAY_WRITE_TOKEN(_FILE)``); without one the
            store is read-only. It is sent instead of the read token (it also reads).
        window: a fixed receive window per stream, bytes, with no BDP probing
            (:func:`window_options`): a long link is full from the first round trip. For
            readers that bound what they ask for themselves (a relay's upstream: its pieces
            in flight); None: grpc's growing window.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float | None = None,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        ca_file: str | os.PathLike[str] | None = None,
        write_token: str | None = None,
        write_token_file: str | os.PathLike[str] | None = None,
        window: int | None = None,
    ) -> None:
        targets, url_timeout = parse_grpc_url(url)
        if window is not None and not 64 << 10 <= window < 1 << 31:
            raise UsageError(f"window must be between 64 KiB and 2 GiB, got {window}")
        self.timeout = url_timeout if timeout is None else timeout
        if not self.timeout > 0:
            raise UsageError(f"timeout must be positive, got {self.timeout}")
        tls = urlparse(url).scheme.lower() == "grpcs"
        self.url = ("grpcs://" if tls else "grpc://") + ",".join(targets)
        ca: bytes | None = None
        ca_path = ca_file or os.environ.get(CA_ENV)
        if tls and ca_path:
            try:
                ca = Path(ca_path).read_bytes()
            except OSError as e:
                raise UsageError(f"cannot read CA certificate {ca_path}: {e.strerror}") from None
        tok = read_token(token, token_file)
        url_write_file = dict(parse_qsl(urlparse(url).query)).get("write_token_file") or None
        self._write_token = read_write_token(write_token, write_token_file or url_write_file)
        self._relays = [_Relay(t, tls=tls, ca=ca, token=tok, write_token=self._write_token, window=window)
                        for t in targets]
        self._preferred = 0  # the relay that answered last
        self._sending = [0] * len(self._relays)  # bytes of uploads in flight to each relay
        self._sending_lock = threading.Lock()
        if self._write_token is not None:
            self.upload_concurrency = UPLOADS_PER_RELAY * len(self._relays)
            self.upload_bytes = UPLOAD_BYTES_PER_RELAY * len(self._relays)
            self.overlap_uploads = True
            self.upload_targets = len(self._relays)

    @property
    def writable(self) -> bool:
        """Whether this store has a write token (the relays decide whether it is good)."""
        return self._write_token is not None

    @property
    def checks_references(self) -> bool:
        """Whether every relay named has said it refuses a manifest whose packs, blobs or delta
        parent are missing (a relay says so on each upload session: a publisher learns it from
        its pack uploads, before its commit)."""
        return self._write_token is not None and all(r.checks_references for r in self._relays)

    @property
    def commits_refs(self) -> bool:
        """Every relay named has said that it commits a manifest sent with ``commit_latest``
        on an upload session (:meth:`put_commit`, :data:`~.wire.UPLOAD_COMMITS`)."""
        return self.checks_references and all(r.commits_refs for r in self._relays)

    @property
    def orders_references(self) -> bool:
        """Whether every relay named has also said it waits, before checking a manifest, for
        its uploads in progress of what the manifest names (:data:`~.wire.UPLOAD_WAITS`)."""
        return self.checks_references and all(r.orders_references for r in self._relays)

    @property
    def addresses(self) -> list[str]:
        return [r.address for r in self._relays]

    @property
    def relays(self) -> int:
        return len(self._relays)

    def __repr__(self) -> str:
        return f"GrpcStore({self.url!r})"

    def close(self) -> None:
        for relay in self._relays:
            relay.close_sessions()
            relay.channel.close()

    # -- reads ---------------------------------------------------------------------------------

    #: Whether a pull reads a pack by the ranges it needs (:meth:`prefers_ranges`); False: whole,
    #: where it needs most of it (one Get, decoded only once all of it has arrived).
    ranged_packs = True

    def prefers_ranges(self, key: str) -> bool:
        """Packs are read by the ranges a pull needs, even where it needs most of a pack: a
        relay serves each range as soon as its bytes have reached it (it streams an object while
        still fetching it: relay/fetch.py), so the chunks at the front of a pack still crossing
        a long link are decoded while the rest arrives, rather than after the whole pack; the
        requests are within a cluster (the relay's own reads across the link are pieces of
        its own size, all in flight together)."""
        return self.ranged_packs and key.startswith("packs/")

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        download = Download(key, byte_range, read_limit())

        def attempt(relay: _Relay) -> bytes:
            call = relay.get(download.request(), timeout=self.timeout)
            try:
                for chunk in _Stream(call):
                    download.feed(chunk)
            finally:
                call.cancel()  # a refused stream (too large, too long) is not read to its end
            return download.result()

        return self._failover("read", key, attempt, start=self._read_shard(key))

    def _size(self, key: str) -> int:
        def attempt(relay: _Relay) -> int:
            return int(relay.stat(pb.StatRequest(key=key), timeout=self.timeout).size)

        return self._failover("stat", key, attempt, start=self._read_shard(key))

    def _read_shard(self, key: str) -> int | None:
        """Where a read starts: an immutable object (pack, blob, manifest, squash) at the relay
        its key hashes to, like uploads, so a version's objects are read through every relay
        named at once (each relay fetching its share over its own link); anything else (refs)
        at the relay that answered last. Either fails over to the next."""
        if len(self._relays) > 1 and key.startswith(_SHARDED_READS):
            return self._shard(key)
        return None

    def _list(self, prefix: str) -> Iterator[str]:
        def attempt(relay: _Relay) -> list[str]:
            keys: list[str] = []
            for batch in _Stream(relay.list(pb.ListRequest(prefix=prefix), timeout=self.timeout)):
                keys.extend(batch.keys)
                if len(keys) > _base.MAX_LIST_KEYS:  # a relay that never stops listing stops here
                    raise listing_too_long(prefix, relay.address)
            return keys

        return iter(self._failover("list", prefix or None, attempt))

    def watch(self, after_version: int = 0, *, push_bytes: int = 0,
              on_piece: Callable[[pb.PushedPiece], None] | None = None,
              on_end: Callable[[], None] | None = None) -> VersionWatch:
        """Committed versions newer than ``after_version`` as relays announce them: first the
        newest one, then each new one in order. Blocks between versions; ``close()`` ends it
        (from any thread). Fails over like every call; raises StoreError once no relay answers.

        ``push_bytes`` (a relay following a relay, relay/push.py): ask for the packs of a new
        version totalling at most this to be pushed after its event; the watch's ``pushed``
        names them, ``on_piece`` is handed their bytes as they come and ``on_end`` is called
        when a stream ends (what was not whole by then will not come)."""
        return VersionWatch(self, after_version, push_bytes=push_bytes, on_piece=on_piece, on_end=on_end)

    # -- writes --------------------------------------------------------------------------------

    def _read_only(self, action: str, key: str) -> UsageError:
        return UsageError(
            f"grpc:// repositories are read-only without a write token: cannot {action} {key} at {self.url} "
            f"(set ${WRITE_TOKEN_ENV} or ${WRITE_TOKEN_FILE_ENV} for a relay serving --accept-writes, "
            "or publish to its upstream)"
        )

    def put_commit(self, key: str, data: bytes | bytearray | memoryview, *, release: str | None = None) -> list[str] | None:
        """A version's manifest, committed at the relay when every relay named commits
        (:attr:`commits_refs`) and it goes on an upload session; None when it went otherwise
        (Upload or Put, or answered only on a retry: then the caller does what remains)."""
        if not self.commits_refs:
            return super().put_commit(key, data, release=release)
        check_key(key)
        return self._write(key, data, True, release or "")

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        self._write(key, data, if_absent)

    def _write(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool,
               release: str | None = None) -> list[str] | None:
        """Write ``key``; with ``release`` (a manifest committed at the relay: the lease to
        delete, or ""), the objects the relay's answer names gone, or None when it was not
        committed there (:meth:`put_commit`)."""
        if self._write_token is None:
            raise self._read_only("write", key)
        view = memoryview(data).cast("B")
        size = len(view)
        announced = digest(view)

        def pieces() -> Iterator[pb.PutChunk]:  # for a relay before Upload
            yield pb.PutChunk(
                key=key, total_bytes=size, if_absent=if_absent, digest=announced, data=bytes(view[:CHUNK_BYTES])
            )
            for offset in range(CHUNK_BYTES, size, CHUNK_BYTES):
                yield pb.PutChunk(data=bytes(view[offset : offset + CHUNK_BYTES]))

        # A small object goes whole in the header, before any credit: one round trip. A manifest
        # put while this store's other uploads are on their way (a publisher sends it beside its
        # last packs, Store.orders_references) says so: a relay then waits for what it names to
        # land, here or through another relay, rather than refusing it at once.
        with self._sending_lock:
            pending = key.startswith(_REFERRING) and any(self._sending)
        header = pb.PutChunk(key=key, total_bytes=size, if_absent=if_absent, digest=announced,
                             data=bytes(view) if size <= UNCREDITED_BYTES else b"", references_pending=pending,
                             commit_latest=release is not None, release=release or "")
        tries = 0
        gone: list[list[str]] = []  # the relay's answer to a commit on a session, on the first try

        def attempt(relay: _Relay) -> None:
            nonlocal tries
            tries += 1
            try:
                answer = self._in_session(relay, header, view) if not relay.legacy_put and not relay.legacy_upload else None
                if answer is not None:
                    if tries == 1 and answer.checked:
                        gone.append(answer.gone)
                    return
                if not relay.legacy_put:
                    try:
                        self._upload(relay, header, view)
                        return
                    except grpc.RpcError as e:
                        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                            raise
                        relay.legacy_put = True
                relay.put(pieces(), timeout=self.timeout)
            except grpc.RpcError as e:
                # A conditional put retried after a failure that may have come after the relay
                # wrote it (the answer was lost): our own bytes there are our success.
                if e.code() == grpc.StatusCode.ALREADY_EXISTS and tries > 1 and self._holds(key, view):
                    return
                raise

        start = self._upload_start(key, size)
        try:
            self._failover("write", key, attempt, start=start, codes=WRITE_FAILOVER_CODES)
        finally:
            with self._sending_lock:
                self._sending[start] -= size
        return gone[0] if release is not None and gone else None

    def _upload_start(self, key: str, size: int) -> int:
        """The relay an upload starts at: the one with the fewest bytes of this store's uploads
        in flight (the key's hash among equals), so a few large packs spread evenly over the
        relays named; every writable relay of a repository writes the same repository."""
        with self._sending_lock:
            n = len(self._relays)
            first = self._shard(key)
            start = min(((first + i) % n for i in range(n)), key=lambda i: self._sending[i])
            self._sending[start] += size
            return start

    def _in_session(self, relay: _Relay, header: pb.PutChunk, view: memoryview) -> Stored | None:
        """Write one object on an upload session of ``relay``: once stored, the objects its
        answer names gone (:meth:`.UploadSession.answered`); None when the relay predates
        UploadSession, or ended the sessions it was sent on before answering (idle, or its
        credit wanted): it was not written, and goes by Upload."""
        for _ in range(SESSION_TRIES):
            session = relay.take_session(header.references_pending or header.commit_latest)
            try:
                answer = session.answered(header, view, self.timeout)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                relay.legacy_upload = True
                return None
            if answer is not None:
                return answer
        return None

    def _upload(self, relay: _Relay, header: pb.PutChunk, view: memoryview) -> None:
        """One Upload call (:func:`._grpc_upload.upload`); returns once it is stored."""
        upload(lambda requests: relay.upload(requests, timeout=self.timeout), _Stream, header, view)

    def _holds(self, key: str, view: memoryview) -> bool:
        try:
            return self._get(key, None) == view
        except DeltasyncError:
            return False

    def _delete(self, key: str) -> None:
        if self._write_token is None:
            raise self._read_only("delete", key)

        def attempt(relay: _Relay) -> None:
            relay.delete(pb.DeleteRequest(key=key), timeout=self.timeout)

        self._failover("delete", key, attempt, start=self._shard(key), codes=WRITE_FAILOVER_CODES)

    def _shard(self, key: str) -> int:
        """The relay an object's upload starts at: spread by the key's hash (stable across
        processes), so uploads in flight together go over every relay named."""
        return int.from_bytes(digest(key.encode())[:8], "big") % len(self._relays)

    # -- failover ------------------------------------------------------------------------------

    def _failover(
        self,
        action: str,
        key: str | None,
        attempt: Callable[[_Relay], T],
        *,
        start: int | None = None,
        codes: frozenset[grpc.StatusCode] = FAILOVER_CODES,
    ) -> T:
        """Run ``attempt`` on the preferred relay (or ``start``), then on the others while they
        are unreachable."""
        errors: dict[str, str] = {}
        n = len(self._relays)
        for round_ in range(_ROUNDS):
            if round_:
                time.sleep(_ROUND_PAUSE)
            first = self._preferred if start is None else start
            for i in range(n):
                index = (first + i) % n
                relay = self._relays[index]
                try:
                    result = attempt(relay)
                except grpc.RpcError as e:
                    if e.code() not in codes:
                        raise translate(e, action, key, relay.address) from None
                    errors[relay.address] = describe(e)
                    continue
                if start is None:
                    self._preferred = index
                return result
        what = f" {key}" if key else ""
        tried = "; ".join(f"{address}: {error}" for address, error in errors.items())
        raise StoreError(f"cannot {action}{what} through {self.url}: no relay answered ({tried})")


def translate(e: grpc.RpcError, action: str, key: str | None, address: str) -> DeltasyncError:
    """A relay's definitive answer as the deltasync error a local store would raise (the codes:
    :data:`~deltasync.storage.wire.STATUS_CODES`)."""
    code = e.code()
    details = " ".join(str(e.details() or "").split())
    error = status_error(code.name) if code is not None else None
    if error is not None and issubclass(error, (ObjectNotFoundError, ObjectExistsError)):
        return error(key or details)
    if action in ("write", "delete"):
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return StoreError(
                f"relay {address} refused to {action} {key}: {details or 'not authorised'} "
                f"(the write token: ${WRITE_TOKEN_ENV}, ${WRITE_TOKEN_FILE_ENV} or ?write_token_file=)"
            )
        if code == grpc.StatusCode.FAILED_PRECONDITION:  # the one refusal a relay gives it: what a manifest names is missing
            return MissingReferencesError(f"relay {address} refused to {action} {key}: {details or 'failed precondition'}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return StoreError(f"relay {address} refused to {action} {key}: {details or code.name.lower()}")
        if error is CorruptObjectError:
            return CorruptObjectError(key or "object", f"relay {address} refused the upload: {details}")
    if error is not None and issubclass(error, CorruptObjectError):
        return error(key or "object", details or code.name.lower())
    if error is UsageError:
        return UsageError(details or f"relay {address} rejected the request to {action} {key}")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return StoreError(
            f"relay {address} refused to {action}: {details or 'not authorised'} "
            f"(set ${TOKEN_ENV} or ${TOKEN_FILE_ENV})"
        )
    what = f" {key}" if key else ""
    return StoreError(f"cannot {action}{what} through relay {address}: {describe(e)}")


class Download:
    """One Get, possibly spread over several relays: each resumes where the last one stopped."""

    def __init__(self, key: str, byte_range: tuple[int, int] | None, limit: int | None = None) -> None:
        self.key = key
        self.limit = limit  # most bytes a whole-object read may take (see Store.get)
        self.offset = byte_range[0] if byte_range is not None else 0
        self.length: int | None = byte_range[1] if byte_range is not None else None
        self.parts: list[bytes] = []
        self.received = 0
        self.started = False  # this stream sent its first chunk

    def request(self) -> pb.GetRequest:
        self.started = False
        if self.length is None:  # a whole object whose size is not known yet
            return pb.GetRequest(key=self.key)
        return pb.GetRequest(key=self.key, offset=self.offset + self.received, length=self.length - self.received, has_range=True)

    def feed(self, chunk: pb.GetChunk) -> None:
        if not self.started:
            self.started = True
            if self.length is None:
                # The relay announces the size first: a larger object is refused unread.
                if self.limit is not None and chunk.total_bytes > self.limit:
                    raise too_large(self.key, chunk.total_bytes, self.limit)
                self.length = chunk.total_bytes  # from here on a resumable range
            elif chunk.total_bytes != self.length - self.received:
                expected = self.length - self.received
                raise CorruptObjectError(self.key, f"relay announced {chunk.total_bytes} bytes, asked for {expected}")
        data = chunk.data
        if self.length is None or self.received + len(data) > self.length:
            raise CorruptObjectError(self.key, "relay sent more bytes than asked for")
        self.parts.append(data)
        self.received += len(data)

    def result(self) -> bytes:
        if not self.started or self.received != self.length:
            raise CorruptObjectError(self.key, f"relay stream ended after {self.received} of {self.length} bytes")
        out = b"".join(self.parts)
        self.parts = [out]
        return out


class VersionWatch(Iterator[int]):
    """Iterator over newly committed versions (see :meth:`GrpcStore.watch`).

    Each Watch stream is read through a :class:`_Stream`, so ``close()`` ends the watch at once
    whatever state it is in: opening a stream, reading one, pausing between relays, or left on
    a call that grpcio will never finish reading.
    """

    def __init__(self, store: GrpcStore, after_version: int, *, push_bytes: int = 0,
                 on_piece: Callable[[pb.PushedPiece], None] | None = None,
                 on_end: Callable[[], None] | None = None) -> None:
        self.store = store
        self.last = after_version  # newest version yielded (or known to the caller)
        self.latest = after_version  # newest version a relay reported, keepalives included
        # What the relay sent with the version last yielded (VersionEvent.copies): hints for a
        # relay following this one, which serves them for a short while (relay/feed.py).
        self.copies: list[pb.UpstreamCopy] = []
        # The packs the relay pushes after that event (asked for with push_bytes: relay/push.py).
        self.pushed: list[pb.PushedObject] = []
        self.push_bytes = push_bytes
        self._on_piece = on_piece
        self._on_end = on_end
        self._lock = threading.Lock()  # orders close() against opening the next stream
        self._stream: _Stream | None = None
        self._closed = threading.Event()
        self._events = self._run()

    def __iter__(self) -> VersionWatch:
        return self

    def __next__(self) -> int:
        return next(self._events)

    def close(self) -> None:
        """End the watch; a thread blocked in ``next()`` gets StopIteration."""
        with self._lock:
            self._closed.set()
            stream = self._stream
        if stream is not None:
            stream.interrupt()

    def _pause(self, seconds: float) -> bool:
        """Wait between rounds over the relays; True when ``close()`` came first."""
        return self._closed.wait(seconds)

    def _run(self) -> Iterator[int]:
        relays = self.store._relays
        index = self.store._preferred
        failures = 0  # consecutive streams that ended without one message
        while True:
            relay = relays[index]
            with self._lock:
                if self._closed.is_set():
                    return
                self._stream = stream = _Stream(
                    relay.watch(pb.WatchRequest(after_version=self.last, push_bytes=self.push_bytes))
                )
            try:
                for event in stream:
                    failures = 0
                    self.store._preferred = index
                    self.latest = max(self.latest, event.latest)
                    if event.HasField("piece"):
                        if self._on_piece is not None:
                            self._on_piece(event.piece)
                    elif event.version > self.last and not self._closed.is_set():
                        self.last = event.version
                        self.copies = list(event.copies)
                        self.pushed = list(event.pushed)
                        yield event.version
                error = "the relay ended the stream"
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                if e.code() not in FAILOVER_CODES:
                    raise translate(e, "watch", None, relay.address) from None
                error = describe(e)
            finally:
                stream.cancel()  # ends the call when the consumer stops early
                if self._on_end is not None:
                    self._on_end()
            if self._closed.is_set():
                return
            failures += 1
            if failures >= _ROUNDS * len(relays):
                raise StoreError(f"cannot watch {self.store.url}: no relay answered (last error, from {relay.address}: {error})")
            index = (index + 1) % len(relays)
            if (index == self.store._preferred or len(relays) == 1) and self._pause(_ROUND_PAUSE):
                return


_END = object()  # from the reader: the stream ended with status OK
_DONE = object()  # from the call's done callback: the call has its status
_STOP = object()  # from interrupt()
_READ_AHEAD = 8  # messages (1 MiB each for Get) a stream's reader takes ahead of its consumer
_READ_GRACE = 1.0  # seconds the reader of a failed call gets to hand over what it read


class _Stream:
    """The messages of one server-streaming call, read on a helper thread.

    grpcio (1.85) can leave a read blocked for good when a call fails as its relay stops: the
    call gets its status (UNAVAILABLE, connection refused) but its receive operations never
    complete, so the read outlives ``cancel()`` (a no-op once there is a status) and any
    deadline. Here the consumer waits on a queue instead, fed by the reader (messages, the end,
    the error), by the call's done callback (the status is in) and by ``interrupt()``. A call
    that failed and whose reader then hands over nothing for ``_READ_GRACE`` seconds is over:
    its error is raised, and the stuck reader is left behind on its daemon thread (closing the
    store's channels ends it).
    """

    def __init__(self, call: Any) -> None:
        self.call = call
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Messages read ahead of the consumer, at most: beyond them the reader waits, so gRPC's
        # flow control holds a relay that sends faster than the consumer takes (a flood of
        # Watch events while the agent pulls) instead of this process's memory.
        self._room = threading.Semaphore(_READ_AHEAD)
        self._stopped = threading.Event()
        threading.Thread(target=self._read, name="deltasync-grpc-read", daemon=True).start()
        call.add_done_callback(self._on_done)

    def _read(self) -> None:
        try:
            for message in self.call:
                while not self._room.acquire(timeout=0.5):
                    if self._stopped.is_set():
                        return  # the consumer is gone
                self._inbox.put(message)
            self._inbox.put(_END)
        except BaseException as e:  # handed to the consumer, which decides
            self._inbox.put(e)

    def _on_done(self, call: Any) -> None:
        self._inbox.put(_DONE)

    def cancel(self) -> None:
        self.call.cancel()  # a no-op once the call is over

    def interrupt(self) -> None:
        """End the iteration now, from any thread."""
        self._stopped.set()
        self._inbox.put(_STOP)
        self.call.cancel()

    def __iter__(self) -> Iterator[Any]:
        failed = False  # the call has a status other than OK
        try:
            while True:
                try:
                    item = self._inbox.get(timeout=_READ_GRACE if failed else None)
                except queue.Empty:
                    raise self.call from None  # a finished call is itself the grpc.RpcError
                if item is _DONE:
                    failed = self.call.code() != grpc.StatusCode.OK
                elif item is _END or item is _STOP:
                    return
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self._room.release()
                    yield item
        finally:
            self._stopped.set()
            self.call.cancel()  # ends the call when the consumer stops early

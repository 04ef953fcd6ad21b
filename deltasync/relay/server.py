"""The relay: a caching gRPC server in front of a repository (``deltasync serve``).

Subscribers in one cluster read the repository through the relay (``grpc://host:port``)
instead of from its origin, so every byte crosses the WAN once per cluster:

- **Get** streams an object (or a byte range of it) in 1 MiB chunks under gRPC flow control.
  Immutable objects (packs, blobs, manifests, squashes) are fetched from the upstream once, whole, into
  the cache (:mod:`deltasync.relay.cache`), however many subscribers ask at the same moment
  (single flight per key), and every range of them is then served from the file. While the
  fetch runs, readers are served from its temporary file as the pieces land (a range once it
  is covered; the last piece of an object only once the whole passed its checks), so a pack
  behind a slow link reaches agents, and relays below, piece by piece rather than after the
  whole pack; a fetch that fails ends its readers' streams with DATA_LOSS (corrupt, wrong
  size) or UNAVAILABLE (upstream unreachable), never a short stream, and leaves no entry.
  ``refs/latest``, listings and other keys always go to the upstream.
- **Watch** pushes newly committed versions. One feed per relay follows the upstream, shared
  by all watchers: it polls ``refs/latest`` every ``poll_interval`` (listing ``manifests/``
  when the ref moves, and every ``rescan_interval`` in case a publisher died between manifest
  and ref), or, when the upstream is itself a relay, follows that relay's Watch stream.
  Idle streams get a keepalive event; watchers are ended with UNAVAILABLE when the upstream
  stays unreachable, so they move on to another relay. With ``warm`` (the default) each new
  version the feed learns of is fetched into the cache at once, manifest then packs and
  blobs (``warm_concurrency`` objects at a time), so the WAN transfer overlaps the agents'
  reaction to the event rather than following their first request.
- The upstream is any repository URL: a path, ``s3://…``, or ``grpc://`` of another relay,
  so relays form trees across clusters.
- **Put**/**Delete** (only with ``accept_writes``, only from clients carrying the write
  token, only of the repository layout's names: ``repo.repository.is_layout_key``): a
  publisher in another cluster writes the repository through the relay. An upload
  streams in 1 MiB pieces, into memory up to :data:`SPOOL_BYTES` (4 MiB) and, when larger, into
  a file under the cache's ``tmp/`` as it arrives (mapped read-only for the checks and the
  upstream put, removed after): at most ``max_uploads`` at once, so the relay's memory for
  uploads stays under ``max_uploads`` times 4 MiB (and 1 MiB pieces); an upload waiting for
  its turn is not read, and holds no more than its stream's 64 KiB flow-control window
  (:data:`UPLOAD_WINDOW_BYTES`: no BDP probing grows it), its disk in flight
  under ``max_uploads`` times ``max_object_bytes``. It is checked (its size, the digest its
  header announces, for ``packs/<xxh3>.pack`` and ``blobs/<xxh3>`` the digest in the
  key, a manifest or squash as every reader validates it) and only then written with the upstream store's own
  atomic put, so nothing partial or corrupt is ever visible; ``if_absent`` passes through, so
  the conditional manifest put keeps exactly one winner. A manifest or squash is refused while
  a pack or blob it names is missing upstream.

The server runs on grpc's asyncio stack, in one event loop thread shared by every relay in
the process: an idle watcher costs no thread. Upstream reads, file reads and index writes
run on a thread pool.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import hmac
import logging
import mmap
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio
import zstandard

from ..errors import (
    CorruptObjectError,
    DeltasyncError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreError,
    UsageError,
)
from ..format.digest import digest
from ..format.manifest import BLOB_PART_SIZE, manifest_key, parse_manifest, version_from_key
from ..repo.repository import (
    LATEST,
    LAYOUT_NAMES,
    MAX_REF_BYTES,
    Repository,
    blob_key,
    is_layout_key,
    ref_hint,
    squash_from_key,
)
from ..storage import GrpcStore, LocalStore, Store, VersionWatch, check_key, open_store
from ..storage._base import MAX_OFFSET
from ..storage._wire import CHUNK_BYTES, CLIENT_STREAM, LIST_BATCH, METHODS, SERVER_STREAM, SERVICE, UNARY, WRITE_METHODS
from ..v1 import manifest_pb2 as manifest_pb, relay_pb2 as pb
from .cache import SERVED_KEYS, SERVED_PREFIXES, Entry, Landing, ObjectCache, cacheable, served, size_limit

log = logging.getLogger("deltasync.relay")

T = TypeVar("T")

_RECENT = 4096  # versions a feed remembers, to send each new one to watchers in order
_IDLE_STOP = 30.0  # seconds without watchers after which a feed stops polling the upstream
_FLUSH_EVERY = 30.0  # seconds between writes of access times to the cache index
_WARM_BACKLOG = 8  # newest versions of one feed update that are warmed (older ones: on demand)
UPLOAD_WINDOW_BYTES = 64 << 10
"""Bytes a client may send on a stream the relay is not reading yet (an upload waiting for a slot)."""

SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.so_reuseport", 0),  # a second relay on a busy port must fail, not share it
    ("grpc.keepalive_time_ms", 60_000),  # find dead subscribers under idle Watch streams
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # allow clients' keepalive
    # Requests are small but for Put's pieces: 1 MiB of data plus its header.
    ("grpc.max_receive_message_length", CHUNK_BYTES + (64 << 10)),
    # What a client may send on a stream before the relay reads from it. A Put waiting for an
    # upload slot reads nothing, yet with BDP probing grpc grows every stream's window to
    # megabytes, so each waiting uploader parked that much in the relay's memory (24 waiting:
    # +150 MiB). A fixed 64 KiB window bounds a waiting stream; a stream being read still gets
    # the window of the 1 MiB piece it asks for.
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", UPLOAD_WINDOW_BYTES),
]


@dataclass(kw_only=True)
class RelayConfig:
    """How a relay serves. Built by :func:`build_server`."""

    listen: str
    """``HOST:PORT`` to serve on; port 0 picks a free port (see ``RelayServer.port``)."""
    cache_dir: Path | None = None
    """Cache directory, kept across restarts. None: a temporary one, removed at stop."""
    cache_max_bytes: int | None = None
    """Evict least recently used objects beyond this many bytes. None: no limit."""
    poll_interval: float = 0.5
    """Seconds between checks of the upstream for a new version."""
    rescan_interval: float = 10.0
    """Seconds between full listings of the upstream's manifests (the ref is only a hint)."""
    keepalive_interval: float = 10.0
    """Seconds of silence after which a watcher gets a keepalive event."""
    upstream_grace: float = 10.0
    """Seconds the upstream may stay unreachable before watchers are sent elsewhere."""
    fetch_piece_bytes: int = 8 << 20
    """Objects larger than this are fetched from the upstream in ranges of this size."""
    workers: int = 32
    """Threads for upstream reads, cache file reads and index writes."""
    tls_cert: Path | None = None
    """PEM certificate (chain) to serve TLS with; needs ``tls_key``. None: plaintext."""
    tls_key: Path | None = None
    """PEM private key of ``tls_cert``."""
    token: str | None = None
    """Bearer token every client must send (``authorization: Bearer …``). None: no check."""
    accept_writes: bool = False
    """Serve Put and Delete (publishing through the relay); needs ``write_token``."""
    write_token: str | None = None
    """Bearer token a client must send to write (it also reads); distinct from ``token``."""
    max_object_bytes: int = 256 << 20
    """Largest object a client may upload (a pack is 64 MiB by default)."""
    max_uploads: int = 8
    """Uploads received at once (each is held in memory until written); more wait their turn."""
    write_quota: int | None = None
    """Most bytes the upstream repository may hold (counted when the relay starts, then through
    its own writes); uploads past it are refused."""
    stream: bool = True
    """Serve an object while it is still being fetched from the upstream. False: only once it
    is whole in the cache (the path before streaming, kept to measure against)."""
    warm: bool = True
    """Fetch each new version's manifest, packs and blobs into the cache as soon as the
    version feed (which follows the upstream while anyone watches) learns of it."""
    warm_concurrency: int = 4
    """Objects warmed at once."""

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise UsageError(f"invalid listen address {self.listen!r} (expected HOST:PORT)")
        for name in ("poll_interval", "rescan_interval", "keepalive_interval", "upstream_grace"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name} must be positive, got {getattr(self, name)}")
        if self.cache_max_bytes is not None and self.cache_max_bytes < 0:
            raise UsageError(f"cache_max_bytes must not be negative, got {self.cache_max_bytes}")
        if self.fetch_piece_bytes < 1 or self.workers < 2:
            raise UsageError("fetch_piece_bytes must be positive and workers at least 2")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise UsageError("TLS needs both a certificate and its key")
        if self.token is not None and not self.token.strip():
            raise UsageError("the bearer token is empty")
        if self.accept_writes and not (self.write_token and self.write_token.strip()):
            raise UsageError("a relay accepting writes needs a write token (--write-token-file)")
        if self.write_token is not None and not self.accept_writes:
            raise UsageError("a write token is given but the relay does not accept writes (--accept-writes)")
        if self.write_token is not None and self.write_token == self.token:
            raise UsageError("the write token must differ from the read token")
        if self.max_object_bytes < 1 or self.max_uploads < 1:
            raise UsageError("max_object_bytes and max_uploads must be positive")
        if self.warm_concurrency < 1:
            raise UsageError(f"warm_concurrency must be positive, got {self.warm_concurrency}")
        if self.write_quota is not None and (self.write_quota < 0 or not self.accept_writes):
            raise UsageError("a write quota must not be negative, and needs --accept-writes")


def build_server(
    upstream: str | Store, listen: str, cache_dir: str | os.PathLike[str] | None = None, **options: Any
) -> RelayServer:
    """A relay serving ``upstream`` (a repository URL or Store) on ``listen``; call ``start()``.

    ``options`` are the other fields of :class:`RelayConfig`.
    """
    config = RelayConfig(listen=listen, cache_dir=Path(cache_dir) if cache_dir is not None else None, **options)
    return RelayServer(upstream, config)


class RelayServer:
    """One relay. ``start()`` binds and serves; ``stop()`` ends watchers, drains, and closes."""

    def __init__(self, upstream: str | Store, config: RelayConfig) -> None:
        self.config = config
        self._own_upstream = isinstance(upstream, str)
        self.upstream = open_store(upstream) if isinstance(upstream, str) else upstream
        self.upstream_url = self.upstream.url or repr(self.upstream)
        self.port = 0
        self.cache_dir: Path | None = None
        self._temp_dir: str | None = None
        self._service: _RelayService | None = None
        self._server: Any = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def address(self) -> str:
        """``host:port`` the relay serves on (the bound port when listening on port 0)."""
        return f"{self.config.listen.rpartition(':')[0]}:{self.port}"

    @property
    def url(self) -> str:
        host = self.config.listen.rpartition(":")[0]
        if host in ("0.0.0.0", "[::]", "::"):
            host = "127.0.0.1"
        return f"grpc://{host}:{self.port}"

    def start(self) -> RelayServer:
        if self._server is not None:
            raise UsageError("relay already started")
        if self.config.cache_dir is None:
            self._temp_dir = tempfile.mkdtemp(prefix="deltasync-relay-")
        self.cache_dir = self.config.cache_dir or Path(self._temp_dir or "")
        try:
            cache = ObjectCache(
                self.cache_dir, max_bytes=self.config.cache_max_bytes, piece_bytes=self.config.fetch_piece_bytes
            )
        except BaseException:
            self._remove_temp_dir()
            raise
        self._executor = ThreadPoolExecutor(self.config.workers, thread_name_prefix="deltasync-relay")
        self._service = _RelayService(self.upstream, self.upstream_url, cache, self._executor, self.config)
        try:
            self.port = _on_loop(self._start(self._service))
        except BaseException:
            self._close_resources()
            raise
        log.debug("serving %s on %s (cache %s)", self.upstream_url, self.address, self.cache_dir)
        return self

    async def _start(self, service: _RelayService) -> int:
        _check_bindable(self.config.listen)
        config = self.config
        needs_check = config.token or config.write_token
        interceptors = [_RequireToken(config.token, config.write_token)] if needs_check else []
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        server.add_generic_rpc_handlers((service.handler(),))
        try:
            if self.config.tls_cert is not None and self.config.tls_key is not None:
                creds = grpc.ssl_server_credentials(
                    [(_read_pem(self.config.tls_key), _read_pem(self.config.tls_cert))]
                )
                port = int(server.add_secure_port(self.config.listen, creds))
            else:
                port = int(server.add_insecure_port(self.config.listen))
        except RuntimeError:
            port = 0
        if port == 0:
            await server.stop(None)
            raise UsageError(f"cannot listen on {self.config.listen} (address in use or not local)")
        await server.start()
        service.start()
        self._server = server
        return port

    def stop(self, grace: float = 1.0) -> None:
        """End Watch streams, let Gets in flight finish for up to ``grace`` seconds, close."""
        if self._server is None:
            return
        server, self._server = self._server, None
        service = self._service
        assert service is not None
        _on_loop(self._stop(server, service, grace))
        self._close_resources()
        log.debug("stopped relay on %s", self.address)

    @staticmethod
    async def _stop(server: Any, service: _RelayService, grace: float) -> None:
        service.begin_stop()
        # Watchers end with UNAVAILABLE (and move to another relay) rather than be cut off.
        deadline = time.monotonic() + max(grace, 0.2)
        while service.counters["watchers"] and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await server.stop(grace)
        await service.close()

    def _close_resources(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self._service is not None:
            self._service.cache.close()
        if self._own_upstream:
            self.upstream.close()
        self._remove_temp_dir()

    def _remove_temp_dir(self) -> None:
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def metrics(self) -> dict[str, int]:
        """Counters since start: requests, bytes served, cache hits, upstream fetches, …"""
        if self._service is None:
            return {}
        return self._service.metrics()

    def __enter__(self) -> RelayServer:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_until_signalled(server: RelayServer, on_ready: Callable[[], None] | None = None, grace: float = 2.0) -> None:
    """Start ``server``, serve until SIGTERM or SIGINT, then stop it (the ``serve`` command)."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        if on_ready is not None:
            on_ready()
        while not stop.wait(1.0):
            pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        server.stop(grace)


def _check_bindable(listen: str) -> None:
    """Fail with the operating system's reason (grpc only logs it) when ``listen`` cannot be bound."""
    host, _, port = listen.rpartition(":")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does: TIME_WAIT is no obstacle
            probe.bind(address)
    except (OSError, IndexError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageError(f"cannot listen on {listen}: {reason}") from None


def _check_served(key: str) -> None:
    """UsageError (INVALID_ARGUMENT) for a malformed key or one outside the repository layout."""
    check_key(key)
    if not served(key):
        layout = ", ".join((*SERVED_KEYS, *SERVED_PREFIXES))
        raise UsageError(f"{key} is not a repository key; a relay serves only {layout}")


def _check_writable(key: str) -> None:
    """UsageError (INVALID_ARGUMENT) unless ``key`` is exactly a name of the repository layout
    that the relay serves: a client writes or deletes nothing else through a relay (no store
    temp files, no keys beside the layout, no gc state, which it does not serve either)."""
    _check_served(key)
    if not is_layout_key(key):
        raise UsageError(f"{key} is not a name of the repository layout; a relay writes only {_WRITABLE_NAMES}")


_WRITABLE_NAMES = LAYOUT_NAMES.replace(", gc/pending.json", "")


def _layout_keys(upstream: Store, prefix: str) -> list[str]:
    """(Thread) Keys under ``prefix`` within the repository layout only: the upstream is
    listed under the layout's prefixes, so nothing else of it is shown (or walked)."""
    keys: list[str] = []
    for top in sorted((*SERVED_PREFIXES, *SERVED_KEYS)):
        if top.startswith(prefix):
            listed = upstream.list(top)
        elif top.endswith("/") and prefix.startswith(top):
            listed = upstream.list(prefix)
        else:
            continue
        keys.extend(k for k in listed if served(k) and k.startswith(prefix))
    return sorted(keys)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"500G"``, ``"1.5TiB"``, ``"1048576"`` → bytes (binary multiples)."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"invalid size {text!r} (e.g. 500G, 1.5T, 1048576)")
    power = " kmgtp".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * 1024**power)


# -- the service --------------------------------------------------------------------------------


class _FetchFailed(Exception):
    """The upstream fetch a Get waited for failed (``cause``: why)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Flight:
    """(Loop) One object being fetched into the cache, shared by every reader of it."""

    def __init__(self, key: str, loop: asyncio.AbstractEventLoop) -> None:
        self.key = key
        self.landing = Landing(key, notify=self._notify)
        self.task: asyncio.Task[Entry]  # set by _RelayService._fetch
        self._changed = asyncio.Event()
        self._loop = loop

    def _notify(self) -> None:  # (the download's thread)
        # A relay stopped mid-download has closed its loop: no reader is left to wake, and the
        # download must still close its file and clear its temporary one.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.wake)

    def wake(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    async def covering(self, end: int) -> Landing:
        """The landing once its size is known and ``end`` bytes are written (the whole object
        verified when ``end`` reaches its size), or once it failed."""
        landing = self.landing
        while True:
            changed = self._changed  # taken before looking, so no progress slips between
            size = landing.size
            if landing.finished or (size is not None and (landing.verified or (end < size and landing.written >= end))):
                return landing
            await changed.wait()


@dataclass
class _Source:
    """An open cached object (or one still arriving: ``flight``), held against eviction."""

    key: str
    fd: int
    size: int
    entry: Entry | None
    flight: _Flight | None

    def close(self, cache: ObjectCache) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            cache.release(self.key)



class _RelayService:
    """The four RPCs. Lives on the relay event loop; blocking work goes to ``executor``."""

    def __init__(
        self, upstream: Store, upstream_url: str, cache: ObjectCache, executor: ThreadPoolExecutor, config: RelayConfig
    ) -> None:
        self.upstream = upstream
        self.upstream_url = upstream_url
        self.cache = cache
        self.executor = executor
        self.config = config
        self.feed = _VersionFeed(upstream, self._in_thread, lambda: self.counters["watchers"], config, self._warm_new)
        self.quota = _Quota(upstream, config.write_quota) if config.write_quota is not None else None
        self._upload_slots: asyncio.Semaphore | None = None  # made on the loop, in start()
        self.stopping = False
        self._inflight: dict[str, _Flight] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._warm_slots: asyncio.Semaphore | None = None  # made on the loop, in start()
        self._warming: set[asyncio.Task[None]] = set()
        self.counters = {
            "requests": 0, "served_bytes": 0, "cache_hits": 0, "coalesced": 0, "watchers": 0,
            "uploads": 0, "uploaded_bytes": 0, "uploads_refused": 0, "deletes": 0,
            "streamed": 0, "fetch_errors": 0,
            "warmed_versions": 0, "warm_fetches": 0, "warm_skipped": 0, "warm_errors": 0,
        }

    def handler(self) -> Any:
        behaviors: dict[str, Callable[..., Any]] = {
            "Get": self.get, "Stat": self.stat, "List": self.list, "Watch": self.watch,
            "Put": self.put, "Delete": self.delete,
        }
        handlers: dict[str, Any] = {}
        for name, (request, response, kind) in METHODS.items():
            factory = _HANDLER_FACTORIES[kind]
            handlers[name] = factory(
                behaviors[name], request_deserializer=request.FromString, response_serializer=response.SerializeToString
            )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def start(self) -> None:
        self._upload_slots = asyncio.Semaphore(self.config.max_uploads)
        self._warm_slots = asyncio.Semaphore(self.config.warm_concurrency)
        self._flusher = asyncio.get_running_loop().create_task(self._flush_periodically())

    def begin_stop(self) -> None:
        self.stopping = True
        self.feed.wake()

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        await self.feed.close()
        for task in list(self._warming):
            task.cancel()
        await asyncio.gather(*self._warming, return_exceptions=True)

    def metrics(self) -> dict[str, int]:
        out = dict(self.counters)
        out.update(
            upstream_fetches=self.cache.fetches,
            upstream_bytes=self.cache.fetched_bytes,
            evictions=self.cache.evictions,
            cached_objects=len(self.cache),
            cached_bytes=self.cache.total_bytes,
            fetching=len(self._inflight),
            following_upstream=int(self.feed.running),
        )
        return out

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    async def _flush_periodically(self) -> None:
        while True:
            await asyncio.sleep(_FLUSH_EVERY)
            try:
                await self._in_thread(self.cache.flush)
            except Exception as e:  # a full disk must not stop the relay serving
                log.warning("cannot write the cache index: %s", e)

    async def _abort(self, context: Any, e: Exception, key: str | None) -> NoReturn:
        """End the call with the status code that tells the client what happened."""
        if isinstance(e, ObjectNotFoundError):
            code, message = grpc.StatusCode.NOT_FOUND, f"object not found: {key}"
        elif isinstance(e, ObjectTooLargeError):  # damage upstream, not a bad request
            code, message = grpc.StatusCode.DATA_LOSS, e.detail
        elif isinstance(e, CorruptObjectError):
            code, message = grpc.StatusCode.OUT_OF_RANGE, e.detail
        elif isinstance(e, UsageError):
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        elif isinstance(e, DeltasyncError):
            log.warning("upstream %s: %s", self.upstream_url, e)
            code, message = grpc.StatusCode.UNAVAILABLE, f"relay upstream {self.upstream_url}: {e}"
        elif isinstance(e, OSError):
            log.error("cache %s: %s", self.cache.root, e)
            code, message = grpc.StatusCode.UNAVAILABLE, f"relay cache error: {e.strerror or e}"
        else:
            log.exception("relay error serving %s", key)
            code, message = grpc.StatusCode.INTERNAL, f"relay error: {type(e).__name__}: {e}"
        await context.abort(code, message)
        raise AssertionError("unreachable: abort raises")

    # -- Get -----------------------------------------------------------------------------------

    async def get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[pb.GetChunk]:
        self.counters["requests"] += 1
        key = request.key
        byte_range = (request.offset, request.length) if request.has_range else None
        source: _Source | None = None
        try:
            _check_served(key)
            if byte_range is not None and (byte_range[0] > MAX_OFFSET or byte_range[1] > MAX_OFFSET):
                raise CorruptObjectError(key, f"range {byte_range[0]}+{byte_range[1]} is past the end of any object")
            if cacheable(key):
                source = await self._open_cached(key)
                offset, length = byte_range if byte_range is not None else (0, source.size)
                if offset + length > source.size:
                    raise CorruptObjectError(key, f"range {offset}+{length} past end of {source.size}-byte object")
        except _FetchFailed as e:
            await self._abort_fetch(context, e.cause, key, sent=0)
        except Exception as e:
            if source is not None:
                source.close(self.cache)
            await self._abort(context, e, key)
        if source is None:
            # Refs and the marker: never cached, never held whole (a hostile upstream's 2 GiB
            # refs/latest passes through in 1 MiB pieces).
            try:
                async for chunk in self._from_upstream(key, byte_range):
                    self.counters["served_bytes"] += len(chunk.data)
                    yield chunk
            except Exception as e:
                await self._abort(context, e, key)
            return
        try:
            position, end = offset, offset + length
            while True:
                n = min(CHUNK_BYTES, end - position)
                if source.flight is not None:  # still arriving: wait until these bytes are in
                    landing = await source.flight.covering(position + n)
                    if landing.error is not None:
                        await self._abort_fetch(context, landing.error, key, sent=position - offset)
                    if landing.verified:
                        source.flight = None
                piece = await self._in_thread(os.pread, source.fd, n, position) if n else b""
                if len(piece) != n:  # the file was damaged under us: refetch next time
                    if source.entry is not None:
                        self.cache.forget(key, source.entry)
                    await context.abort(grpc.StatusCode.DATA_LOSS, f"relay cache file of {key} is truncated")
                self.counters["served_bytes"] += n
                yield pb.GetChunk(data=piece, total_bytes=length if position == offset else 0)
                position += n
                if position >= end:
                    break
        finally:
            source.close(self.cache)

    async def _from_upstream(self, key: str, byte_range: tuple[int, int] | None) -> AsyncIterator[pb.GetChunk]:
        """An uncached object (or a range of it) read from the upstream a piece at a time."""
        if byte_range is None:
            try:  # small, as refs are: one read, so the object cannot change between pieces
                data = await self._in_thread(functools.partial(self.upstream.get, key, max_bytes=CHUNK_BYTES))
            except ObjectTooLargeError:
                byte_range = (0, await self._in_thread(self.upstream.size, key))
            else:
                yield pb.GetChunk(data=data, total_bytes=len(data))
                return
        offset, length = byte_range
        position, end = offset, offset + length
        while True:
            n = min(CHUNK_BYTES, end - position)
            piece = await self._in_thread(self.upstream.get, key, (position, n))
            yield pb.GetChunk(data=piece, total_bytes=length if position == offset else 0)
            position += n
            if position >= end:
                return

    async def _open_cached(self, key: str) -> _Source:
        """The cached object, open for reading (held against eviction until closed), fetching
        it first if needed; with ``stream``, the object while it is still being fetched, as
        soon as its size is known. _FetchFailed when the fetch fails."""
        for _ in range(3):
            entry = self.cache.lookup(key)
            if entry is None:
                flight = self._fetch(key)
                if self.config.stream:
                    landing = await flight.covering(0)
                    if landing.error is not None:
                        raise _FetchFailed(landing.error)
                    self.cache.hold(key)
                    try:
                        fd = landing.open()
                    except FileNotFoundError:  # landed, then evicted before we opened it
                        self.cache.release(key)
                        await asyncio.sleep(0)  # the finished flight leaves _inflight first
                        continue
                    except BaseException:
                        self.cache.release(key)
                        if landing.error is not None:  # it failed between the wait and the open
                            raise _FetchFailed(landing.error) from None
                        raise
                    assert landing.size is not None
                    streaming = landing.entry is None
                    self.counters["streamed" if streaming else "cache_hits"] += 1
                    return _Source(key, fd, landing.size, landing.entry, flight if streaming else None)
                try:
                    entry = await asyncio.shield(flight.task)
                except Exception as e:
                    raise _FetchFailed(e) from None
            else:
                self.counters["cache_hits"] += 1
            self.cache.hold(key)
            try:
                return _Source(key, os.open(entry.path, os.O_RDONLY), entry.size, entry, None)
            except FileNotFoundError:  # evicted (or removed) between lookup and open
                self.cache.release(key)
                self.cache.forget(key, entry)
            except BaseException:
                self.cache.release(key)
                raise
        # Not damage and not a bad request: the cache is churning (evicting faster than it is read).
        raise OSError(f"the relay cache keeps losing {key} between finding and opening it; try again")

    def _fetch(self, key: str, *, warm: bool = False) -> _Flight:
        """Single flight: concurrent requests for one key share one upstream fetch, which
        carries on into the cache even if the client that started it goes away."""
        flight = self._inflight.get(key)
        if flight is not None:
            if not (warm or flight.landing.entry is not None):
                self.counters["coalesced"] += 1
            return flight
        loop = asyncio.get_running_loop()
        flight = _Flight(key, loop)
        fetch = functools.partial(self.cache.fetch, key, self.upstream, max_size=size_limit(key), landing=flight.landing)
        flight.task = loop.create_task(self._in_thread(fetch))
        self._inflight[key] = flight
        flight.task.add_done_callback(functools.partial(self._landed, flight))
        self.counters["warm_fetches"] += int(warm)
        return flight

    def _landed(self, flight: _Flight, task: asyncio.Task[Entry]) -> None:
        if self._inflight.get(flight.key) is flight:
            del self._inflight[flight.key]
        error: BaseException | None = StoreError("the relay stopped") if task.cancelled() else task.exception()
        if error is not None:  # retrieved: no "never retrieved" noise
            self.counters["fetch_errors"] += 1
            log.debug("fetching %s failed: %s", flight.key, error)
            if not flight.landing.finished:  # cancelled before the fetch ran: tell its readers
                flight.landing.error = error
        flight.wake()

    async def _abort_fetch(self, context: Any, e: BaseException, key: str, *, sent: int) -> NoReturn:
        """End a Get whose object's fetch from the upstream failed: DATA_LOSS for an object
        that is damaged upstream (wrong size, wrong digest, too large), NOT_FOUND for one that
        is gone, UNAVAILABLE when the upstream did not answer (the client retries, here or at
        another relay, resuming where it stopped)."""
        after = f" after {sent:,} bytes were sent" if sent else ""
        if isinstance(e, ObjectNotFoundError):
            code, message = grpc.StatusCode.NOT_FOUND, f"object not found: {key}"
        elif isinstance(e, CorruptObjectError):
            code, message = grpc.StatusCode.DATA_LOSS, f"{e.detail} (fetching {key} from the upstream{after})"
        elif isinstance(e, DeltasyncError):
            log.warning("upstream %s: %s", self.upstream_url, e)
            code, message = grpc.StatusCode.UNAVAILABLE, f"relay upstream {self.upstream_url}: {e}{after}"
        elif isinstance(e, OSError):
            log.error("cache %s: %s", self.cache.root, e)
            code, message = grpc.StatusCode.UNAVAILABLE, f"relay cache error: {e.strerror or e}"
        else:
            log.error("relay error fetching %s: %s: %s", key, type(e).__name__, e)
            code, message = grpc.StatusCode.UNAVAILABLE, f"relay error fetching {key}: {type(e).__name__}: {e}"
        await context.abort(code, message)
        raise AssertionError("unreachable: abort raises")

    # -- warming ---------------------------------------------------------------------------------

    def _warm_new(self, versions: list[int], fresh: bool) -> None:
        """(Loop) The feed learned of ``versions``: fetch them into the cache before anyone asks
        (when the feed has just started, only the newest: older ones are fetched on demand)."""
        if not self.config.warm or self.stopping or not versions:
            return
        for version in versions[-1:] if fresh else versions[-_WARM_BACKLOG:]:
            task = asyncio.get_running_loop().create_task(self._warm(version))
            self._warming.add(task)
            task.add_done_callback(self._warming.discard)

    async def _warm(self, version: int) -> None:
        key = manifest_key(version)
        try:
            await self._warm_object(key)
            keys, total = await self._in_thread(self._version_objects, key, version)
            limit = self.cache.max_bytes
            if limit is not None and total > limit // 2:
                # Warming it would evict what agents behind it still read: leave it to demand.
                self.counters["warm_skipped"] += 1
                log.info("not warming version %d: %s bytes to fetch, over half the cache limit", version, f"{total:,}")
                return
            await asyncio.gather(*(self._warm_object(k) for k in keys))
            self.counters["warmed_versions"] += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.counters["warm_errors"] += 1
            log.warning("cannot warm version %d from %s: %s", version, self.upstream_url, e)

    async def _warm_object(self, key: str) -> None:
        assert self._warm_slots is not None
        async with self._warm_slots:
            if self.stopping or self.cache.lookup(key, touch=False) is not None:
                return
            await asyncio.shield(self._fetch(key, warm=True).task)

    def _version_objects(self, key: str, version: int) -> tuple[list[str], int]:
        """(Thread) The packs and blobs the cached manifest ``key`` names that the cache lacks,
        and their bytes (blobs counted at their bound)."""
        entry = self.cache.lookup(key, touch=False)
        if entry is None:
            raise CorruptObjectError(key, "evicted before it could be read")
        info = parse_manifest(entry.path.read_bytes(), expect_version=version)
        sizes = {p.key: p.size for p in info.pb.packs}
        for f in info.pb.files:
            if f.kind == manifest_pb.File.BLOB:
                sizes.update(dict.fromkeys((blob_key(d) for d in f.blob_parts), BLOB_PART_SIZE))
        missing = sorted(k for k in sizes if self.cache.lookup(k, touch=False) is None)
        for k in missing:
            check_key(k)
        return missing, sum(sizes[k] for k in missing)

    # -- Stat, List ----------------------------------------------------------------------------

    async def stat(self, request: pb.StatRequest, context: Any) -> pb.StatResponse:
        self.counters["requests"] += 1
        key = request.key
        try:
            _check_served(key)
            entry = self.cache.lookup(key, touch=False) if cacheable(key) else None
            flight = self._inflight.get(key) if entry is None else None
            known = entry.size if entry is not None else flight.landing.size if flight is not None else None
            size = known if known is not None else await self._in_thread(self.upstream.size, key)
        except Exception as e:
            await self._abort(context, e, key)
        return pb.StatResponse(size=size)

    async def list(self, request: pb.ListRequest, context: Any) -> AsyncIterator[pb.ListResponse]:
        self.counters["requests"] += 1
        prefix = request.prefix
        try:
            if prefix:
                check_key(prefix.rstrip("/"))
            keys = await self._in_thread(_layout_keys, self.upstream, prefix)
        except Exception as e:
            await self._abort(context, e, prefix or None)
        for start in range(0, len(keys), LIST_BATCH):
            yield pb.ListResponse(keys=keys[start : start + LIST_BATCH])

    # -- Put, Delete ---------------------------------------------------------------------------

    async def put(self, requests: AsyncIterator[pb.PutChunk], context: Any) -> pb.PutResponse:
        self.counters["requests"] += 1
        if not self.config.accept_writes:  # the interceptor refuses first; kept for library use
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this relay does not accept writes")
        assert self._upload_slots is not None
        key = ""
        async with self._upload_slots:  # bounds memory and spool: max_uploads objects received at once
            try:
                first = await anext(aiter(requests), None)
                if first is None:
                    raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, "empty upload (no header)")
                key, size = first.key, first.total_bytes
                _check_writable(key)
                kind_cap = size_limit(key)  # what a valid object of this kind can be (manifests: 64 MiB)
                cap = self.config.max_object_bytes if kind_cap is None else min(kind_cap, self.config.max_object_bytes)
                if size > cap:
                    raise _Refused(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{key} is {size:,} bytes, over the relay's object size cap of {cap:,} bytes "
                        "(serve --max-object-bytes)",
                    )
                if self.quota is not None:
                    self.quota.check(key, size)  # before receiving: a refused upload costs no memory
                # Created and removed on the event loop itself (a file open and an unlink): an
                # executor job can be cancelled before it runs when the client cancels the
                # upload, which would leave the spool file behind.
                spool = _Spool(self.cache.root / "tmp") if size > SPOOL_BYTES else None
                try:
                    await self._receive(key, size, first, requests, spool)
                finally:
                    if spool is not None:
                        spool.close()
            except _Refused as e:
                self.counters["uploads_refused"] += 1
                log.warning("refused upload of %s: %s", key or "?", e.message)
                await context.abort(e.code, e.message)
            except ObjectExistsError:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"object already exists: {key}")
            except Exception as e:
                await self._abort(context, e, key or None)
        self.counters["uploads"] += 1
        self.counters["uploaded_bytes"] += size
        return pb.PutResponse()

    async def _receive(self, key: str, size: int, first: pb.PutChunk, requests: AsyncIterator[pb.PutChunk],
                       spool: _Spool | None) -> None:
        """Take an upload's pieces (into memory, or into ``spool``), then check and store it."""
        data = bytearray(first.data) if spool is None else None
        if spool is not None:
            await self._in_thread(spool.write, first.data)
        received = len(first.data)
        async for piece in requests:
            if received + len(piece.data) > size:
                raise _Refused(grpc.StatusCode.DATA_LOSS, f"upload of {key} sent more than its {size:,} bytes")
            received += len(piece.data)
            if data is not None:
                data += piece.data
            else:
                assert spool is not None
                await self._in_thread(spool.write, piece.data)
        if received != size:
            raise _Refused(grpc.StatusCode.DATA_LOSS, f"upload of {key} ended after {received:,} of {size:,} bytes")
        if data is not None:  # the bytearray itself: a copy would double the memory an upload holds
            await self._in_thread(self._store_upload, key, data, first.if_absent, bytes(first.digest))
        else:
            assert spool is not None
            await self._in_thread(self._store_spooled, key, spool, first.if_absent, bytes(first.digest))

    def _store_spooled(self, key: str, spool: _Spool, if_absent: bool, announced: bytes) -> None:
        view = spool.view()
        try:
            self._store_upload(key, view, if_absent, announced)
        finally:
            with contextlib.suppress(BufferError):
                view.release()

    def _store_upload(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool, announced: bytes) -> None:
        """(Thread) Check a complete upload, then write it upstream in one atomic put."""
        if announced and digest(data) != announced:
            raise _Refused(grpc.StatusCode.DATA_LOSS, f"upload of {key} does not match the digest its header announced")
        problem = content_problem(key, data)
        if problem is not None:
            raise _Refused(grpc.StatusCode.DATA_LOSS, f"upload of {key} refused: {problem}")
        missing = missing_references(self.upstream, key, data)
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{key} names objects the repository lacks ({missing[0]}{more}): upload them before the manifest",
            )
        if self.quota is None:
            self.upstream.put(key, data, if_absent=if_absent)
        else:
            self.quota.put(key, data, if_absent)
        self._forget_cached(key)  # an overwrite (or a re-upload after a delete) is served fresh

    def _forget_cached(self, key: str) -> None:
        entry = self.cache.lookup(key, touch=False) if cacheable(key) else None
        if entry is not None:
            self.cache.forget(key, entry)

    async def delete(self, request: pb.DeleteRequest, context: Any) -> pb.DeleteResponse:
        self.counters["requests"] += 1
        if not self.config.accept_writes:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this relay does not accept writes")
        key = request.key
        try:
            _check_writable(key)
            await self._in_thread(self._delete, key)
        except Exception as e:
            await self._abort(context, e, key)
        self.counters["deletes"] += 1
        return pb.DeleteResponse()

    def _delete(self, key: str) -> None:
        if self.quota is None:
            self.upstream.delete(key)
        else:
            self.quota.delete(key)
        self._forget_cached(key)

    # -- Watch ---------------------------------------------------------------------------------

    async def watch(self, request: pb.WatchRequest, context: Any) -> AsyncIterator[pb.VersionEvent]:
        self.counters["requests"] += 1
        self.counters["watchers"] += 1
        feed = self.feed
        feed.start()
        last = request.after_version
        caught_up = False  # the first event carries only the newest version
        sent_at = time.monotonic()
        try:
            while True:
                changed = feed.changed  # taken before looking, so no change slips between
                if self.stopping:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "relay is shutting down")
                reason = feed.unavailable()
                if reason is not None:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, f"relay cannot reach its upstream {self.upstream_url}: {reason}"
                    )
                new = feed.after(last) if feed.succeeded else []
                if new and not caught_up:
                    new = new[-1:]
                caught_up = caught_up or feed.succeeded
                for version in new:
                    yield pb.VersionEvent(version=version, latest=feed.latest)
                    last = version
                    sent_at = time.monotonic()
                wait = self.config.keepalive_interval - (time.monotonic() - sent_at)
                if wait <= 0:
                    yield pb.VersionEvent(version=0, latest=feed.latest)
                    sent_at = time.monotonic()
                    continue
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), wait)
        finally:
            self.counters["watchers"] -= 1


class _VersionFeed:
    """The relay's view of the upstream's committed versions, shared by every watcher."""

    def __init__(
        self,
        upstream: Store,
        in_thread: Callable[..., Coroutine[Any, Any, Any]],
        watchers: Callable[[], int],
        config: RelayConfig,
        on_new: Callable[[list[int], bool], None] | None = None,
    ) -> None:
        self.upstream = upstream
        self.in_thread = in_thread
        self.watchers = watchers
        self.config = config
        self.on_new = on_new  # (versions, fresh): new versions, and whether the feed just (re)started
        self._fresh = True
        self.latest = 0
        self.recent: list[int] = []  # newest committed versions, ascending
        self.succeeded = False  # the upstream answered at least once
        self.error: str | None = None
        self.failing_since = 0.0
        self.changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watch: VersionWatch | None = None
        self._closed = False
        self._next_scan = 0.0  # poller thread state
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        if self._task is None and not self._closed:
            self._fresh = True
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run())

    @property
    def running(self) -> bool:
        return self._task is not None

    def after(self, version: int) -> list[int]:
        return self.recent[bisect.bisect_right(self.recent, version) :]

    def unavailable(self) -> str | None:
        """Why watchers should move to another relay: the upstream has not answered yet, or
        has not for ``upstream_grace`` seconds. None while all is well."""
        if self.error is None:
            return None
        if not self.succeeded or time.monotonic() - self.failing_since >= self.config.upstream_grace:
            return self.error
        return None

    def wake(self) -> None:
        old, self.changed = self.changed, asyncio.Event()
        old.set()

    def publish(self, versions: list[int]) -> None:
        new = sorted({v for v in versions if v > self.latest})
        if new:
            self.recent.extend(new)
            del self.recent[:-_RECENT]
            self.latest = new[-1]
            self.wake()
            fresh, self._fresh = self._fresh, False
            if self.on_new is not None:
                self.on_new(new, fresh)

    async def close(self) -> None:
        self._closed = True
        if self._watch is not None:
            self._watch.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        repo = Repository(self.upstream)
        follow = isinstance(self.upstream, GrpcStore)
        idle_since = time.monotonic()
        while not self._closed:
            if self.watchers():
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > _IDLE_STOP:
                # Nobody is watching: stop polling. The next watcher restarts the feed and
                # hears nothing until it has fresh news.
                self._task, self.succeeded, self.error = None, False, None
                return
            try:
                self.publish(await self.in_thread(self._poll, repo))
                self._ok()
                if follow:  # push from the upstream relay until its stream fails
                    await self.in_thread(self._follow)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._failed(e)
            await asyncio.sleep(self.config.poll_interval)

    def _ok(self) -> None:
        if self.error is not None:
            log.info("upstream %s answers again", self.upstream.url)
        self.error = None
        if not self.succeeded:
            self.succeeded = True
            self.wake()

    def _failed(self, e: Exception) -> None:
        message = str(e) if isinstance(e, DeltasyncError) else f"{type(e).__name__}: {e}"
        if self.error is None:
            self.failing_since = time.monotonic()
        if message != self.error:
            log.warning("cannot follow upstream %s: %s", self.upstream.url, message)
        self.error = message
        self.wake()  # watchers re-check whether to give up on this relay

    def _poll(self, repo: Repository) -> list[int]:
        """(Thread) Versions newer than the newest known: read the ref each time, list the
        manifests when it moved and every ``rescan_interval``."""
        try:
            # Either form of the ref (plain or signed); only a hint to list sooner: the relay
            # holds no keys, its subscribers check signed refs themselves.
            hint: int | None = ref_hint(self.upstream.get(LATEST, max_bytes=MAX_REF_BYTES))
        except (ObjectNotFoundError, ObjectTooLargeError):  # no hint, or none readable
            hint = None
        now = time.monotonic()
        if (hint is None or hint <= self.latest) and now < self._next_scan:
            return []
        self._next_scan = now + self.config.rescan_interval
        return [v for v in repo.versions() if v > self.latest]

    def _follow(self) -> None:
        """(Thread) Relay the upstream relay's Watch stream until it fails or the feed closes."""
        assert isinstance(self.upstream, GrpcStore) and self._loop is not None
        watch = self.upstream.watch(self.latest)
        self._watch = watch
        if self._closed:
            watch.close()
        for version in watch:
            self._loop.call_soon_threadsafe(self.publish, [version])


# -- writes ---------------------------------------------------------------------------------------

_HANDLER_FACTORIES: dict[str, Callable[..., Any]] = {
    UNARY: grpc.unary_unary_rpc_method_handler,
    SERVER_STREAM: grpc.unary_stream_rpc_method_handler,
    CLIENT_STREAM: grpc.stream_unary_rpc_method_handler,
}

_PACK_KEY = re.compile(r"^packs/([0-9a-f]{32})\.pack$")
_BLOB_KEY = re.compile(r"^blobs/([0-9a-f]{32})$")
_MANIFEST_KEY = re.compile(r"^(manifests/\d{20}\.pb|squashes/\d{20}-\d{20}\.pb)$")


#: Uploads larger than this are spooled to a file as they arrive rather than held in memory.
SPOOL_BYTES = 4 << 20


class _Spool:
    """(Threads) One upload written to a new file under ``directory`` as its pieces arrive,
    then mapped read-only (:meth:`view`) for the checks and the upstream put; :meth:`close`
    removes it. The directory is the cache's ``tmp/``, cleared when a relay starts, so a
    relay killed mid-upload leaves nothing behind for long."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"upload-{uuid.uuid4().hex}"
        self._file = open(self.path, "x+b")  # noqa: SIM115 - closed by close(); readable, for mmap
        self._map: mmap.mmap | None = None

    def write(self, data: bytes) -> None:
        self._file.write(data)

    def view(self) -> memoryview:
        self._file.flush()
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        return memoryview(self._map)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: the mapping goes with it
                self._map.close()
        self._file.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class _Refused(Exception):
    """An upload the relay will not write, with the status code that says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def content_problem(key: str, data: bytes | bytearray | memoryview) -> str | None:
    """Why ``data`` cannot be the object named ``key``, for content-addressed keys (a pack's
    name is the xxh3-128 of its bytes; a blob's that of the zstd frame's content) and for
    manifests and squashes (what every reader refuses: no or a wrong whole-manifest digest, a
    bad layout; :func:`~deltasync.format.manifest.parse_manifest`); None if it can."""
    if _MANIFEST_KEY.match(key):
        try:
            squash = squash_from_key(key)  # a squash to version C is a manifest of version C
            parse_manifest(bytes(data), expect_version=squash[1] if squash is not None else version_from_key(key))
        except CorruptObjectError as e:
            return e.detail
        return None
    m = _PACK_KEY.match(key)
    if m is not None:
        return None if digest(data).hex() == m.group(1) else "its bytes do not match the digest in its name"
    m = _BLOB_KEY.match(key)
    if m is None:
        return None
    try:
        size = zstandard.frame_content_size(data)
        if size < 0 or size > BLOB_PART_SIZE:
            return f"not a blob part (a zstd frame of at most {BLOB_PART_SIZE:,} bytes)"
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=BLOB_PART_SIZE)
    except zstandard.ZstdError as e:
        return f"not a zstd frame ({e})"
    return None if digest(raw).hex() == m.group(1) else "its content does not match the digest in its name"


def missing_references(upstream: Store, key: str, data: bytes | bytearray | memoryview) -> list[str]:
    """(Thread) For a manifest or squash: the packs and blobs it names that ``upstream``
    lacks, so a broken or hostile publisher cannot commit a version that cannot be pulled."""
    if not _MANIFEST_KEY.match(key):
        return []
    try:
        manifest = manifest_pb.Manifest.FromString(bytes(data))  # small: capped by size_limit on arrival
    except Exception:
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{key} is not a manifest") from None
    keys = sorted({p.key for p in manifest.packs}
                  | {blob_key(part) for f in manifest.files if f.kind == manifest_pb.File.BLOB for part in f.blob_parts})
    missing = []
    for k in keys:
        try:
            check_key(k)
        except UsageError:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{key} names an invalid key {k!r}") from None
        if not upstream.exists(k):
            missing.append(k)
    return missing


class _Quota:
    """Bytes the upstream repository holds, kept under a limit: counted once at start (a walk
    of a local directory, temporary files included; else one listing with sizes, which S3
    answers 1,000 keys a request), then tracked through this relay's puts and deletes. Writes
    are serialised with the accounting, so racing uploads cannot both pass the last free
    bytes. Other writers to the same repository are not seen until the relay restarts."""

    def __init__(self, upstream: Store, limit: int) -> None:
        self.upstream = upstream
        self.limit = limit
        self.used = _tree_bytes(upstream.root) if isinstance(upstream, LocalStore) else upstream.total_bytes()
        self._lock = threading.Lock()

    def _refusal(self, key: str, size: int) -> _Refused:
        return _Refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"write quota exceeded: {key} ({size:,} bytes) would bring the repository to "
            f"{self.used + size:,} of {self.limit:,} bytes (serve --write-quota)",
        )

    def check(self, key: str, size: int) -> None:
        if self.used + size > self.limit:
            raise self._refusal(key, size)

    def put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        with self._lock:
            try:
                old = self.upstream.size(key)
            except ObjectNotFoundError:
                old = 0
            if not (if_absent and old) and self.used - old + len(data) > self.limit:
                raise self._refusal(key, len(data))
            self.upstream.put(key, data, if_absent=if_absent)
            self.used += len(data) - old

    def delete(self, key: str) -> None:
        with self._lock:
            try:
                old = self.upstream.size(key)
            except ObjectNotFoundError:
                return
            self.upstream.delete(key)
            self.used = max(0, self.used - old)


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


# -- the event loop every relay in the process runs on -------------------------------------------

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """One loop thread for all relays: grpc's asyncio stack wants a single loop per process."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="deltasync-relay-loop", daemon=True).start()
            _loop = loop
        return _loop


def _on_loop(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run_coroutine_threadsafe(coro, _event_loop()).result()


def _read_pem(path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None


class _RequireToken(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Checks ``authorization: Bearer <token>`` (constant-time compares): reads need the read
    token (when one is set) or the write token; writes need the write token (a read token
    gets PERMISSION_DENIED, none or a wrong one UNAUTHENTICATED)."""

    def __init__(self, token: str | None, write_token: str | None = None) -> None:
        self._read = f"Bearer {token}".encode() if token else None
        self._write = f"Bearer {write_token}".encode() if write_token else None

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        name = details.method.rsplit("/", 1)[-1]
        got: bytes | None = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else bytes(value)
        is_reader = got is not None and self._read is not None and hmac.compare_digest(got, self._read)
        is_writer = got is not None and self._write is not None and hmac.compare_digest(got, self._write)
        if name in WRITE_METHODS:
            if is_writer:
                return await continuation(details)
            if self._write is None:
                code, message = grpc.StatusCode.PERMISSION_DENIED, "this relay does not accept writes"
            elif is_reader:
                code, message = grpc.StatusCode.PERMISSION_DENIED, "a read token cannot write: writes need the write token"
            else:
                code, message = grpc.StatusCode.UNAUTHENTICATED, "missing or wrong write token"
        elif self._read is None or is_reader or is_writer:
            return await continuation(details)
        else:
            code, message = grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token"
        kind = METHODS[name][2] if name in METHODS else UNARY

        async def deny(request: Any, context: Any) -> Any:
            await context.abort(code, message)

        return _HANDLER_FACTORIES[kind](deny)

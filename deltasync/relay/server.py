"""A relay's lifecycle: :class:`RelayServer` binds, serves and stops; :func:`build_server` makes
one from options, :func:`run_until_signalled` serves until SIGTERM (``deltasync serve``).

The server runs on grpc's asyncio stack, in one event loop thread shared by every relay in
the process: an idle watcher costs no thread. Upstream reads, file reads and index writes
run on a thread pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio

from ..errors import UsageError
from ..storage import Store, open_store
from ..storage.wire import CHUNK_BYTES
from .auth import RequireToken
from .cache import ObjectCache
from .config import RelayConfig as RelayConfig, parse_size as parse_size  # deltasync.relay.server.* keeps working
from .fleet import Forwarder, fleet_service, start_forwarding
from .service import RelayService
from .shares import ClusterShares

log = logging.getLogger("deltasync.relay")

T = TypeVar("T")

SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.so_reuseport", 0),  # a second relay on a busy port must fail, not share it
    ("grpc.keepalive_time_ms", 60_000),  # find dead subscribers under idle Watch streams
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # allow clients' keepalive
    # Requests are small but for Put's pieces: 1 MiB of data plus its header.
    ("grpc.max_receive_message_length", CHUNK_BYTES + (64 << 10)),
    # What a client may send on a stream before the relay reads it. With BDP probing grpc
    # grows every stream's window to megabytes, whatever the relay's memory (24 uploaders:
    # +150 MiB); a fixed window (RelayConfig.upload_window, added in start()) is chosen, and an
    # Upload sends only within the credit the relay grants from its one budget (relay/uploads.py).
    ("grpc.http2.bdp_probe", 0),
]



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
        self.upstream = open_upstream(upstream, config) if isinstance(upstream, str) else upstream
        self.upstream_url = self.upstream.url or repr(self.upstream)
        self.port = 0
        self.cache_dir: Path | None = None
        self._temp_dir: str | None = None
        self._service: RelayService | None = None
        self._server: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self.fleet = fleet_service(self.upstream, config)
        """The fleet reports this relay keeps (:mod:`deltasync.relay.fleet`)."""
        self._forwarder: Forwarder | None = None

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

    @property
    def cache(self) -> ObjectCache | None:
        """The object cache while the relay runs (its size limit, how it was chosen)."""
        return self._service.cache if self._service is not None else None

    def start(self) -> RelayServer:
        if self._server is not None:
            raise UsageError("relay already started")
        if self.config.cache_dir is None:
            self._temp_dir = tempfile.mkdtemp(prefix="deltasync-relay-")
        self.cache_dir = self.config.cache_dir or Path(self._temp_dir or "")
        try:
            cache = ObjectCache(
                self.cache_dir, max_bytes=self.config.cache_max_bytes, piece_bytes=self.config.fetch_piece_bytes,
                pieces_in_flight=self.config.fetch_pieces_in_flight,
            )
        except BaseException:
            self._remove_temp_dir()
            raise
        self._executor = ThreadPoolExecutor(self.config.workers, thread_name_prefix="deltasync-relay")
        self._service = RelayService(self.upstream, self.upstream_url, cache, self._executor, self.config)
        try:
            self.port = _on_loop(self._start(self._service))
        except BaseException:
            self._close_resources()
            raise
        self.fleet.bind(self.address, self.config.cluster)
        self._forwarder = start_forwarding(self.fleet, self.upstream, self.config)
        log.debug("serving %s on %s (cache %s)", self.upstream_url, self.address, self.cache_dir)
        return self

    async def _start(self, service: RelayService) -> int:
        _check_bindable(self.config.listen)
        config = self.config
        needs_check = config.token or config.write_token
        interceptors = [RequireToken(config.token, config.write_token)] if needs_check else []
        options = [*SERVER_OPTIONS, ("grpc.http2.lookahead_bytes", self.config.upload_window)]
        server = grpc.aio.server(options=options, interceptors=interceptors)
        server.add_generic_rpc_handlers((service.handler(), self.fleet.handlers()))
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
        if config.cluster_relays is not None:  # before the first request: every fetch is in shares
            me = config.advertise or f"{config.listen.rpartition(':')[0]}:{port}"
            try:
                service.fetches.shares = ClusterShares(
                    config.cluster_relays, me, token=config.token, tls=config.tls_cert is not None,
                    piece_bytes=config.fetch_piece_bytes)
            except UsageError:
                await server.stop(None)
                raise
        await server.start()
        service.start()
        if config.cluster_relays is not None:  # every relay of a cluster hears of each version (feed.py)
            service.feed.always = True
            service.feed.start()
        self._server = server
        return port

    def stop(self, grace: float = 1.0) -> None:
        """End Watch streams, let Gets in flight finish for up to ``grace`` seconds, close."""
        if self._server is None:
            return
        server, self._server = self._server, None
        if self._forwarder is not None:
            self._forwarder.stop()
            self._forwarder = None
        service = self._service
        assert service is not None
        _on_loop(self._stop(server, service, grace))
        self._close_resources()
        log.debug("stopped relay on %s", self.address)

    @staticmethod
    async def _stop(server: Any, service: RelayService, grace: float) -> None:
        service.begin_stop()
        # Watchers end with UNAVAILABLE (and move to another relay) rather than be cut off.
        deadline = time.monotonic() + max(grace, 0.2)
        while service.counters["watchers"] and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await server.stop(grace)
        await service.close()

    def _close_resources(self) -> None:
        if self._service is not None:
            self._service.cache.stopping = True  # downloads in pieces end at their next piece
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        if self._service is not None:
            self._service.fetches.close()  # the downloads' own threads (relay/fetch.py)
        if self._service is not None and self._service.fetches.shares is not None:
            self._service.fetches.shares.close()
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
        """Counters since start: requests, bytes served, cache hits, upstream fetches, …; with
        ``cluster_relays``, the pieces read from the other relays (``peer_pieces``,
        ``peer_bytes``), over the relay's own link (``own_pieces``, ``own_bytes``) and the peer
        reads that fell back to it (``peer_fallbacks``)."""
        if self._service is None:
            return {}
        out = self._service.metrics()
        shares = self._service.fetches.shares
        if shares is not None:  # pieces read from the cluster's other relays, and their failures
            out.update(shares.counters)
        return out

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


def open_upstream(url: str, config: RelayConfig) -> Store:
    """The store a relay reads ``url`` through: an upstream relay (``grpc://``) with a fixed
    receive window of the relay's whole piece budget (``fetch_piece_bytes`` x
    ``fetch_pieces_in_flight``), so a long link is full from the first round trip rather than
    after grpc's window has grown to it (storage/_grpc.py ``window_options``); its memory is
    what the pieces in flight hold anyway."""
    if url.lower().startswith(("grpc://", "grpcs://")):
        from ..storage import GrpcStore

        window = min(config.fetch_piece_bytes * config.fetch_pieces_in_flight, (1 << 31) - 1)
        return GrpcStore(url, window=max(64 << 10, window))
    return open_store(url)


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


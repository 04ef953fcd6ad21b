"""A modelled long-haul link between loopback ports: a userspace TCP proxy that delays and paces.

    link = Link("127.0.0.1:7070", rtt=0.2, mbps=800).start()   # connect to link.address instead
    ...; link.counts() -> (bytes up, bytes down); link.cut(); link.stop()

Every connection accepted on ``address`` is joined to ``target``. Each direction is one shared
link of ``mbps`` megabits per second for all connections together: a byte read from one side
leaves after the bytes queued before it (pacing), and arrives half a round trip later. The
proxy reads as fast as the sender writes and buffers without limit, as a deep network queue
would: loopback TCP acknowledges at once, so what limits a transfer through it is exactly
what is under test, the application's own flow-control windows and serial round trips, not
TCP's. ``cut()`` drops every open connection at once (a link failure mid-transfer: both
sides see a reset); new connections are accepted afterwards.

:class:`Link` runs in the calling process on threads (tests); :func:`spawn_link` runs one in
its own process (benchmarks: the proxy's Python then does not share a GIL with a relay or a
publisher under test).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

_READ = 256 << 10


class _Direction:
    """One way of the link: a pacing clock shared by every connection, and a byte count."""

    def __init__(self, rate: float, one_way: float) -> None:
        self.rate = rate
        self.one_way = one_way
        self.bytes = 0
        self._free_at = 0.0
        self._lock = threading.Lock()

    def schedule(self, n: int) -> float:
        """When ``n`` bytes read now arrive at the other end."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = done = start + n / self.rate if self.rate > 0 else start
            self.bytes += n
        return done + self.one_way


class _Pipe:
    """Bytes from ``src`` to ``dst`` through one direction of the link (a reader and a writer thread)."""

    def __init__(self, src: socket.socket, dst: socket.socket, way: _Direction, on_end: Any) -> None:
        self.src, self.dst, self.way, self.on_end = src, dst, way, on_end
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self._cond = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True, name="link-read").start()
        threading.Thread(target=self._write, daemon=True, name="link-write").start()

    def _read(self) -> None:
        try:
            while True:
                data = self.src.recv(_READ)
                if not data:
                    break
                at = self.way.schedule(len(data))
                with self._cond:
                    self._queue.append((at, data))
                    self._cond.notify()
        except OSError:
            pass
        with self._cond:
            self._eof = True
            self._cond.notify()

    def _write(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._eof:
                        self._cond.wait()
                    if not self._queue:
                        break
                    at, data = self._queue.popleft()
                delay = at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                self.dst.sendall(data)
            self.dst.shutdown(socket.SHUT_WR)  # the sender's end of stream, after its last byte
        except OSError:
            pass
        self.on_end()


class Link:
    """A proxy from ``address`` (picked at start) to ``target``: ``rtt`` seconds, ``mbps`` each way."""

    def __init__(self, target: str, *, rtt: float, mbps: float, listen: str = "127.0.0.1:0") -> None:
        self.target = target
        self.rtt = rtt
        self.mbps = mbps
        rate = mbps * 1e6 / 8
        self.up = _Direction(rate, rtt / 2)  # client -> target
        self.down = _Direction(rate, rtt / 2)  # target -> client
        host, _, port = listen.rpartition(":")
        self._listener = socket.create_server((host, int(port)))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> Link:
        threading.Thread(target=self._accept, daemon=True, name="link-accept").start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            host, _, port = self.target.rpartition(":")
            try:
                server = socket.create_connection((host, int(port)))
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._stopped:
                    client.close()
                    server.close()
                    return
                self._conns.update((client, server))
            self._join(client, server)

    def _join(self, client: socket.socket, server: socket.socket) -> None:
        ends = [0]

        def ended() -> None:
            with self._lock:
                ends[0] += 1
                if ends[0] < 2:
                    return
                self._conns.difference_update((client, server))
            client.close()
            server.close()

        _Pipe(client, server, self.up, ended)
        _Pipe(server, client, self.down, ended)

    def counts(self) -> tuple[int, int]:
        """Bytes that crossed so far: (client -> target, target -> client)."""
        return self.up.bytes, self.down.bytes

    def cut(self) -> None:
        """Drop every open connection now (both ends see a reset)."""
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()
        for s in conns:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._listener.close()
        self.cut()


def _serve(target: str, rtt: float, mbps: float, conn: Connection) -> None:
    link = Link(target, rtt=rtt, mbps=mbps).start()
    conn.send(link.address)
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            break
        if cmd == "counts":
            conn.send(link.counts())
        elif cmd == "cut":
            link.cut()
            conn.send(None)
        else:
            break
    link.stop()


class LinkProcess:
    """A :class:`Link` in a process of its own, with the same ``address``/``counts``/``cut``/``stop``."""

    def __init__(self, target: str, *, rtt: float, mbps: float) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(target, rtt, mbps, child), daemon=True)
        self._proc.start()
        self.address: str = self._conn.recv()
        self.rtt, self.mbps = rtt, mbps

    def counts(self) -> tuple[int, int]:
        self._conn.send("counts")
        up, down = self._conn.recv()
        return int(up), int(down)

    def cut(self) -> None:
        self._conn.send("cut")
        self._conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send("stop")
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()


def spawn_link(target: str, *, rtt: float, mbps: float) -> LinkProcess:
    return LinkProcess(target, rtt=rtt, mbps=mbps)

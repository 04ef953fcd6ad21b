"""A pipelined chain over a ``torch.distributed`` process group: one root's bytes to every rank,
each link carrying them once, whatever the group's size.

Group rank 0 sends its pieces to rank 1, rank ``i`` forwards each piece it receives to
``i + 1`` while the next ones are on their way (``window`` pieces in flight on every link), so
the root's link carries the payload once (a binomial-tree broadcast, gloo's, sends it
``ceil(log2 N)`` times from the root) and the time to the last rank is the payload's time on
one link plus ``N - 2`` pieces' time. Point-to-point ``send``/``recv`` of the group (gloo on
CPU, nccl on GPU) carry the bytes; every rank counts what it sent and received
(:class:`LinkBytes`), and ``pace`` (a link model, in benchmarks) is charged with them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

#: ``pace(direction, nbytes)``: ``"send"`` before a piece leaves, ``"recv"`` once one arrived.
Pace = Callable[[str, int], None]
TAG = 7


class LinkBytes:
    """Bytes this node sent to and received from its group's links (thread-safe counters)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.sent, self.received


class _Buffers:
    """``window`` piece buffers (on ``device`` for nccl), each with its pending send."""

    def __init__(self, piece_bytes: int, window: int, device: Any) -> None:
        import torch

        self.bufs = [torch.empty(piece_bytes, dtype=torch.uint8, device=device) for _ in range(window)]
        self.host = None if device is None else torch.empty(piece_bytes, dtype=torch.uint8).pin_memory()
        self.sends: list[tuple[Any, int] | None] = [None] * window


class ChainOut:
    """The root's end: fill :meth:`view`, then :meth:`send` its first bytes; :meth:`close` waits."""

    def __init__(self, pg: Any, piece_bytes: int, *, window: int = 4, timeout: float = 30.0,
                 device: Any = None, counter: LinkBytes | None = None, pace: Pace | None = None) -> None:
        self.pg, self.timeout = pg, timedelta(seconds=timeout)
        self.b = _Buffers(piece_bytes, window, device)
        self.counter, self.pace = counter or LinkBytes(), pace
        self.slot = 0
        self._host = [b.numpy() for b in self.b.bufs] if device is None else None

    def view(self) -> np.ndarray:
        """The current piece's host bytes (its buffer's earlier send finished first)."""
        self._finish(self.slot)
        if self._host is not None:
            return self._host[self.slot]
        assert self.b.host is not None
        return self.b.host.numpy()

    def send(self, length: int) -> None:
        buf = self.b.bufs[self.slot][:length]
        if self.b.host is not None:  # nccl: the piece crosses on the device
            buf.copy_(self.b.host[:length])
        if self.pace is not None:
            self.pace("send", length)
        self.b.sends[self.slot] = (self.pg.send([buf], 1, TAG), length)
        self.slot = (self.slot + 1) % len(self.b.bufs)

    def _finish(self, slot: int) -> None:
        pending, self.b.sends[slot] = self.b.sends[slot], None
        if pending is not None:
            pending[0].wait(self.timeout)
            self.counter.add(sent=pending[1])

    def close(self) -> None:
        for slot in range(len(self.b.bufs)):
            self._finish(slot)


def chain_receive(pg: Any, index: int, size: int, total: int, piece_bytes: int, on_piece: Callable[[bytes], None],
                  *, window: int = 4, timeout: float = 30.0, device: Any = None,
                  counter: LinkBytes | None = None, pace: Pace | None = None) -> None:
    """Group rank ``index`` (of ``size``): receive ``total`` bytes from ``index - 1`` in pieces
    of ``piece_bytes``, forward each to ``index + 1`` (unless last) and hand it to ``on_piece``."""
    counter = counter or LinkBytes()
    wait = timedelta(seconds=timeout)
    count = -(-total // piece_bytes)
    window = max(1, min(window, count))
    b = _Buffers(piece_bytes, window, device)
    forward = index + 1 < size

    def length(k: int) -> int:
        return min(piece_bytes, total - k * piece_bytes)

    recvs = {k: pg.recv([b.bufs[k][: length(k)]], index - 1, TAG) for k in range(window)}
    try:
        for k in range(count):
            slot, n = k % window, length(k)
            recvs.pop(k).wait(wait)
            counter.add(received=n)
            if pace is not None:
                pace("recv", n)
            buf = b.bufs[slot][:n]
            if forward:
                if pace is not None:
                    pace("send", n)
                b.sends[slot] = (pg.send([buf], index + 1, TAG), n)
            if b.host is not None:
                b.host[:n].copy_(buf)
                data = b.host[:n].numpy().tobytes()
            else:
                data = buf.numpy().tobytes()
            on_piece(data)
            if k + window < count:
                pending, b.sends[slot] = b.sends[slot], None
                if pending is not None:
                    pending[0].wait(wait)
                    counter.add(sent=pending[1])
                recvs[k + window] = pg.recv([b.bufs[slot][: length(k + window)]], index - 1, TAG)
        for slot, pending in enumerate(b.sends):
            if pending is not None:
                b.sends[slot] = None
                pending[0].wait(wait)
                counter.add(sent=pending[1])
    finally:
        for work in recvs.values():  # a piece that will not come (the chain broke): stop waiting for it
            with contextlib.suppress(Exception):  # a work that cannot abort times out instead
                work.abort()


def binomial_children(index: int, size: int) -> int:
    """How many ranks group rank ``index`` sends a piece to in a binomial-tree broadcast from 0
    (what gloo's broadcast does): the old path's bytes, for comparison."""
    children, step = 0, 1
    while step < size:
        if index < step and index + step < size:
            children += 1
        step *= 2
    return children


__all__ = ["ChainOut", "LinkBytes", "Pace", "binomial_children", "chain_receive"]

"""A pipelined chain over a ``torch.distributed`` process group: one root's bytes to every rank,
each link carrying them once, whatever the group's size.

Group rank 0 sends its pieces to rank 1, rank ``i`` forwards each piece it receives to
``i + 1`` while the next ones are on their way (``window`` pieces in flight on every link), so
the root's link carries the payload once (a binomial-tree broadcast, gloo's, sends it
``ceil(log2 N)`` times from the root) and the time to the last rank is the payload's time on
one link plus ``N - 2`` pieces' time. Point-to-point ``send``/``recv`` of the group (gloo on
CPU, nccl on GPU) carry the bytes; every rank counts what it sent and received
(:class:`LinkBytes`), and ``pace`` (a link model, in benchmarks) is charged with them.

The same code spreads down a binomial ``tree`` (the pattern of gloo's own broadcast), to set
the old path beside the chain with every link counted and paced alike.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

#: ``pace(peer, nbytes)``: called before a piece leaves for group rank ``peer`` (a link model
#: charges the sender's egress and the peer's ingress, then lets it go).
Pace = Callable[[int, int], None]
TAG = 7
SHAPES = ("chain", "tree")


def peers(index: int, size: int, shape: str = "chain") -> tuple[int | None, list[int]]:
    """Group rank ``index``'s parent (None for the root) and children: a ``chain`` (``i`` sends
    to ``i + 1``) or a binomial ``tree`` (``i`` sends to ``i + 2**k`` for every ``2**k > i``:
    the pattern of gloo's broadcast, root sending ``ceil(log2 size)`` times)."""
    if shape == "chain":
        return (index - 1 if index else None), ([index + 1] if index + 1 < size else [])
    if shape != "tree":
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    parent = None if index == 0 else index - (1 << (index.bit_length() - 1))
    children, step = [], 1
    while step < size:
        if index < step and index + step < size:
            children.append(index + step)
        step *= 2
    return parent, children


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
        self.sends: list[list[tuple[Any, int]]] = [[] for _ in range(window)]

    def post(self, pg: Any, slot: int, length: int, children: list[int], pace: Pace | None) -> None:
        buf = self.bufs[slot][:length]
        for child in children:
            if pace is not None:
                pace(child, length)
            self.sends[slot].append((pg.send([buf], child, TAG), length))

    def finish(self, slot: int, timeout: timedelta, counter: LinkBytes) -> None:
        pending, self.sends[slot] = self.sends[slot], []
        for work, length in pending:
            work.wait(timeout)
            counter.add(sent=length)


class ChainOut:
    """The root's end: fill :meth:`view`, then :meth:`send` its first bytes; :meth:`close` waits.
    ``size`` and ``shape``: the group's size and how it spreads (:func:`peers`)."""

    def __init__(self, pg: Any, piece_bytes: int, *, size: int, shape: str = "chain", window: int = 4,
                 timeout: float = 30.0, device: Any = None, counter: LinkBytes | None = None,
                 pace: Pace | None = None) -> None:
        self.pg, self.timeout = pg, timedelta(seconds=timeout)
        self.children = peers(0, size, shape)[1]
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
        if self.b.host is not None:  # nccl: the piece crosses on the device
            self.b.bufs[self.slot][:length].copy_(self.b.host[:length])
        self.b.post(self.pg, self.slot, length, self.children, self.pace)
        self.slot = (self.slot + 1) % len(self.b.bufs)

    def _finish(self, slot: int) -> None:
        self.b.finish(slot, self.timeout, self.counter)

    def close(self) -> None:
        for slot in range(len(self.b.bufs)):
            self._finish(slot)


def chain_receive(pg: Any, index: int, size: int, total: int, piece_bytes: int, on_piece: Callable[[bytes], None],
                  *, shape: str = "chain", window: int = 4, timeout: float = 30.0, device: Any = None,
                  counter: LinkBytes | None = None, pace: Pace | None = None) -> None:
    """Group rank ``index`` (of ``size``): receive ``total`` bytes from its parent in pieces of
    ``piece_bytes``, forward each to its children (:func:`peers`) and hand it to ``on_piece``."""
    counter = counter or LinkBytes()
    wait = timedelta(seconds=timeout)
    parent, children = peers(index, size, shape)
    count = -(-total // piece_bytes)
    window = max(1, min(window, count))
    b = _Buffers(piece_bytes, window, device)

    def length(k: int) -> int:
        return min(piece_bytes, total - k * piece_bytes)

    recvs = {k: pg.recv([b.bufs[k][: length(k)]], parent, TAG) for k in range(window)}
    try:
        for k in range(count):
            slot, n = k % window, length(k)
            recvs.pop(k).wait(wait)
            counter.add(received=n)
            buf = b.bufs[slot][:n]
            if b.host is not None:
                b.host[:n].copy_(buf)
                data = b.host[:n].numpy().tobytes()
            else:
                data = buf.numpy().tobytes()
            b.post(pg, slot, n, children, pace)  # on its way down while this node takes it in
            on_piece(data)
            if k + window < count:
                b.finish(slot, wait, counter)
                recvs[k + window] = pg.recv([b.bufs[slot][: length(k + window)]], parent, TAG)
        for slot in range(window):
            b.finish(slot, wait, counter)
    finally:
        for work in recvs.values():  # a piece that will not come (the chain broke): stop waiting for it
            with contextlib.suppress(Exception):  # a work that cannot abort times out instead
                work.abort()


def binomial_children(index: int, size: int) -> int:
    """How many ranks group rank ``index`` sends a piece to in a binomial-tree broadcast from 0
    (what gloo's broadcast does): the old path's bytes, for comparison."""
    return len(peers(index, size, "tree")[1])


__all__ = ["SHAPES", "ChainOut", "LinkBytes", "Pace", "binomial_children", "chain_receive", "peers"]

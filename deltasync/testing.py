"""Running a function on N local ranks, for tests and benchmarks of multi-rank features.

Each rank is a spawned process (a fresh interpreter: no forked torch or thread state) that
gets its rank, a rendezvous port on loopback for ``torch.distributed`` (``tcp://127.0.0.1:
PORT``) and a queue, and puts ``(rank, result, error)`` on the queue when it is done
(``error``: a formatted traceback, or None). The target reports itself, so that a rank can
leave with ``os._exit`` right after reporting when its peers may be dead (a group teardown
would wait for them).
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(
    target: Callable[..., Any],
    world: int,
    args_of: Callable[[int, int, Any], tuple[Any, ...]],
    *,
    expect: int | None = None,
    timeout: float = 180.0,
    join_timeout: float = 30.0,
) -> dict[int, Any]:
    """Run ``target(*args_of(rank, port, results))`` on ranks ``0 .. world-1``, each putting
    ``(rank, result, traceback or None)`` on ``results``; return ``{rank: result}``.

    Waits for ``expect`` results (default: every rank; fewer when a test kills some), each
    within ``timeout`` seconds. A rank that raised fails the call with its traceback; ranks
    still running afterwards get ``join_timeout`` seconds, then are killed.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=args_of(r, port, results), name=f"rank-{r}") for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        for _ in range(world if expect is None else expect):
            try:
                rank, result, error = results.get(timeout=timeout)
            except queue_module.Empty:
                raise AssertionError(f"no rank reported within {timeout:.0f} s (done: {sorted(out)})") from None
            if error is not None:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            out[rank] = result
    finally:
        for p in procs:
            p.join(timeout=join_timeout)
            if p.is_alive():
                p.kill()
                p.join()
    return out

"""The pipelined chain packcast spreads a version with (engines/_chain.py), over a real gloo
group of 4 processes on 127.0.0.1: every rank gets the root's bytes bit-exact, for payloads
that do not divide into pieces or ranks and for tiny ones, and the bytes every rank counts
are what a chain carries: the root's link the payload once (a binomial broadcast: twice at 4)."""

from __future__ import annotations

import traceback
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from deltasync.engines._chain import ChainOut, LinkBytes, binomial_children, chain_receive, peers
from deltasync.testing import spawn_ranks

WORLD = 4
#: (payload bytes, piece bytes): a payload not divisible by the piece or by N, one smaller
#: than a piece, single bytes, and more pieces than the window.
#: The binomial tree (the old path's pattern) once, for its counts.
CASES = [(10_007, 1024, "chain"), (5, 4096, "chain"), (1, 1, "chain"), (3, 2, "chain"), (65_537, 999, "chain"),
         (10_007, 1024, "tree")]


def _payload(n: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()


def _rank(rank: int, port: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=60))
        pg = dist.ProcessGroupGloo(store, rank, WORLD, timedelta(seconds=60))
        out = []
        for total, piece, shape in CASES:
            counter = LinkBytes()
            paced: list[tuple[int, int]] = []
            got = bytearray()

            def pace(peer: int, n: int, paced: list[tuple[int, int]] = paced) -> None:
                paced.append((peer, n))

            if rank == 0:
                data = np.frombuffer(_payload(total), dtype=np.uint8)
                chain = ChainOut(pg, min(piece, total), size=WORLD, shape=shape, window=3, timeout=60, counter=counter,
                                 pace=pace)
                step = min(piece, total)
                for at in range(0, total, step):
                    n = min(step, total - at)
                    chain.view()[:n] = data[at : at + n]
                    chain.send(n)
                chain.close()
                got += data.tobytes()
            else:
                chain_receive(pg, rank, WORLD, total, min(piece, total), got.extend, shape=shape, window=3, timeout=60,
                              counter=counter, pace=pace)
            out.append((bytes(got) == _payload(total), *counter.snapshot(), sum(n for _, n in paced),
                        sorted({p for p, _ in paced})))
        queue.put((rank, out, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def test_chain_is_bit_exact_and_each_link_carries_the_payload_once() -> None:
    out = spawn_ranks(_rank, WORLD, lambda r, port, q: (r, port, q), timeout=120)
    for i, (total, _piece, shape) in enumerate(CASES):
        for rank in range(WORLD):
            exact, sent, received, paced, to = out[rank][i]
            children = peers(rank, WORLD, shape)[1]
            assert exact, (rank, total, shape)
            assert received == (total if rank else 0), (rank, total)
            assert sent == total * len(children), (rank, total, shape)
            assert paced == sent and to == children  # the link model is charged what is sent, to whom
        if shape == "chain":
            assert out[0][i][1] <= 2.1 * total  # the target; a chain's root sends it exactly once
        else:
            assert out[0][i][1] == 2 * total  # gloo's pattern: log2(4) times


@pytest.mark.parametrize(("size", "root_sends"), [(2, 1), (4, 2), (8, 3), (32, 5), (33, 6)])
def test_binomial_tree_root_sends_log2_n_times(size: int, root_sends: int) -> None:
    assert binomial_children(0, size) == root_sends
    # every rank but the root receives each piece once, from its parent, which received it earlier
    assert sum(binomial_children(i, size) for i in range(size)) == size - 1
    for i in range(1, size):
        parent = peers(i, size, "tree")[0]
        assert parent is not None and parent < i and i in peers(parent, size, "tree")[1]
    assert peers(0, size, "chain") == (None, [1]) and peers(size - 1, size, "chain") == (size - 2, [])

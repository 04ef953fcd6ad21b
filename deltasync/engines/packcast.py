"""Packcast: a version's stored bytes fetched once per cluster, spread to every node by gloo or nccl.

Every node of a cluster keeps its own engine (a :class:`TorchEngine`, say) current. Without
packcast each node pulls each version from the cluster's relay, so the relay's egress
carries the delta once per node and time grows with the node count. With packcast, node 0
fetches the version's objects (its manifests, then its packs: compressed, as stored) from
the relay once and sends them down a pipelined chain of the group's nodes in pieces
(``torch.distributed`` point-to-point sends, gloo on CPU, nccl on GPU: engines/_chain.py):
node 0 sends each piece to node 1, which forwards it to node 2 while the next pieces arrive,
so every link, node 0's included, carries the stream once whatever the group's size (a plain
``broadcast``, ``spread="broadcast"``, kept for comparison, is gloo's binomial tree: node 0
sends the stream ``ceil(log2 N)`` times). Every node counts the bytes it sent and received
(``RoundReport.link_sent`` / ``link_received``). Every node decodes, verifies and
applies only what its engine holds, from those bytes. Nothing is decoded on one node for
another, so the bytes on each link are the stored delta, not decoded changes.

Stages overlap at pack granularity: node 0 fetches pack k+1 while pack k is broadcast, and
every engine's pull pipeline decodes pack k as soon as it has arrived (a read of an
announced object waits for it), while later pieces are still on the wire. Through relays
(a ``grpc://`` URL; several comma-separated), each object is read at the relay its key
hashes to (storage/_grpc.py), and node 0 asks for one byte of each of the next four objects
per relay ahead of the one it reads: a relay fetches an object whole on its first read, so
every relay fetches its share over its own link at once, without a gap between its packs,
instead of one relay after another.

Everything stays bit-exact through the usual path: the bytes received sit in a
:class:`PackCache`, the store the node's engine reads its repository through. Packs are
content addressed, so a corrupt one is dropped on arrival; a manifest is checked by its
digest (and signature) when parsed; every chunk by its digest when decoded. What did not
arrive, or arrived corrupt, is read from the relay behind the cache instead, so a node that
missed a broadcast, joined late or got a damaged piece catches up from the relay, exactly.

The control plane is a ``torch.distributed`` key-value store (a TCPStore hosted by node 0):
round ``n`` starts when node 0 writes its header (version, members, objects). Members are the
nodes that said they were ready within ``timeout`` seconds; a node that died or hangs is
left out of the next group (a fresh gloo group over the members, built through the store),
so it blocks the others for at most ``timeout`` seconds. A node left out catches up from the
relay and says it is ready for the next round.

Anyone who reaches node 0's store can write into it (node 0 binds it to the host it is given
only). With a ``token`` (a secret every node shares) every record in it carries an HMAC over
the record, its kind, its round or rank and node 0's run, and what does not authenticate is
refused: a follower never takes a header node 0 did not write, and node 0 never takes in a
member that does not hold the token. A round counter naming a round never written is not
followed, token or not (docs/trust.md).

Shard-aware: a node whose engine holds only some tensors or regions (``TorchEngine.holdings``:
``--tensors``, ``--shard I/N``, :class:`~deltasync.Slice` values) says so when it joins. Node
0 groups the members by what they hold; each class gets its own stream, over its own group
(node 0 and the class's members): the objects, or the byte ranges of packs, that the class's
pull will read (the byte ranges of the chunks covering what it holds, along the path its
planner takes; its pull then reads those packs by ranges, served from memory). Node 0 reads the union of
all streams from the relay once and copies each range into the streams that carry it. Nodes
holding the same shard thus share one fetch and one broadcast, and a node receives about its
share of the delta, not the whole of it. Ranges of a pack cannot be checked against its
content address: every chunk is checked by its digest when decoded, and a round whose staging
does not verify is staged again from the relay, as for a corrupt piece.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from ..errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    DeltasyncError,
    GroupError,
    UsageError,
)
from ..format.codec import SAME
from ..format.manifest import MAX_MANIFEST_BYTES, ManifestInfo, key_of, manifest_key
from ..format.slices import Region
from ..pull.plan import wanted
from ..pull.select import select_tensors
from ..repo.repository import squash_key
from ..storage import WrappingStore
from ._chain import ChainOut, LinkBytes, binomial_children, chain_receive
from ._changes import want_of
from ._packcache import PackCache
from .base import Engine, SwapRecord

#: One object, or a byte range of one, in a class's stream: (key, object size, offset, length).
Segment = tuple[str, int, int, int]
#: What a node's engine holds: tensor name -> None (whole) or [offsets, shape]; None: everything.
Holds = dict[str, list[list[int]] | None] | None
Apply = Callable[[int], SwapRecord | None]

log = logging.getLogger("deltasync.engines")

#: Objects node 0 asks each relay for ahead of its reads (one byte each: the relay fetches the
#: object whole): enough that a relay's link has its next packs on the way (_send;
#: benchmarks/bench_projection.py measures the links added up).
_AHEAD_PER_RELAY = 4


@dataclass(frozen=True)
class RoundReport:
    """What one node did in one round."""

    round: int
    version: int
    members: tuple[int, ...]
    """Nodes the round's group held (empty: this node was left out and pulled from the relay)."""
    record: SwapRecord | None
    """The swap (None: the engine already served ``version``)."""
    received_bytes: int
    """Bytes received from the group this round (node 0: fetched for it)."""
    upstream_bytes: int
    """Bytes read from the relay this round (node 0: its fetch; others: what they caught up on)."""
    broadcast_error: str | None
    """Why the broadcast stopped short on this node (it then read the rest from the relay)."""
    repaired: bool
    """Staging from the bytes received failed verification and was redone from the relay."""
    served_at: float
    """``time.time()`` when the engine served ``version`` (when the round ended, on an error)."""
    error: str | None = None
    """Why the engine did not take ``version`` (a follower goes on to the next round)."""
    link_sent: int = 0
    """Bytes this node sent to other nodes of its group this round: counted by the chain and the
    tree as they send; with ``spread='broadcast'`` (gloo's own collective, which reports nothing)
    computed from the binomial pattern it follows, not counted."""
    link_received: int = 0
    """Bytes this node received from another node of its group this round."""


class PackcastNode:
    """One node of a cluster group that fans out each version's stored bytes.

    >>> cache = PackCache("grpc://relay:7070")            # every node
    >>> engine = TorchEngine(model, cache)                # any engine reading through the cache
    >>> node = PackcastNode(engine, cache, rank=r, world=32, master="node0:29600")
    >>> node.update()       # node 0: the latest version, fetched once, to every node
    >>> node.follow()       # other nodes: every round node 0 starts, until it closes

    ``world`` is the most nodes there will be (ranks ``0 .. world-1``; a node may start late).
    ``master``: ``host:port`` of node 0's key-value store (node 0 listens there), or ``store``:
    a ``torch.distributed`` Store shared by the nodes. ``timeout``: seconds a node waits for
    another (to say it is ready, to build the group, for a piece) before going on without it.
    ``piece_bytes``: the unit of a broadcast; ``window``: pieces in flight on each link.
    ``backend``: ``gloo`` (CPU) or ``nccl``. ``spread``: ``chain`` (every link carries the
    stream once), or for comparison ``broadcast`` (the process group's own broadcast, a
    binomial tree in gloo: node 0 sends it ``ceil(log2 N)`` times) or ``tree`` (the same
    binomial tree of point-to-point sends, counted and paced per link like the chain).
    An engine with ``holdings()`` (a :class:`TorchEngine`) receives only what covers them.
    """

    def __init__(
        self,
        engine: Engine,
        cache: PackCache,
        *,
        rank: int,
        world: int,
        master: str | None = None,
        store: Any = None,
        timeout: float = 30.0,
        piece_bytes: int = 4 << 20,
        backend: str = "gloo",
        prefix: str = "deltasync-packcast",
        spread: str = "chain",
        window: int = 4,
        token: bytes | None = None,
    ) -> None:
        import torch.distributed as dist

        if world < 1 or not 0 <= rank < world:
            raise UsageError(f"rank must be in 0..{world - 1}, got {rank}" if world >= 1 else
                             f"world must be at least 1, got {world}")
        if timeout <= 0 or piece_bytes < 1:
            raise UsageError("timeout and piece_bytes must be positive")
        if spread not in ("chain", "tree", "broadcast"):
            raise UsageError(f"spread must be chain, tree or broadcast, got {spread!r}")
        if window < 1:
            raise UsageError(f"window must be at least 1, got {window}")
        if backend not in ("gloo", "nccl"):
            raise UsageError(f"backend must be gloo or nccl, got {backend!r}")
        if backend == "nccl":
            import torch

            if not (dist.is_nccl_available() and torch.cuda.is_available()):
                raise UsageError("backend nccl needs a GPU and a torch built with nccl; use gloo")
        if (master is None) == (store is None):
            raise UsageError("give either master (host:port of node 0) or a torch.distributed store")
        reads: Any = getattr(getattr(getattr(engine, "subscriber", None), "repo", None), "store", None)
        while reads is not cache and isinstance(reads, WrappingStore):  # an agent's counting, caching store
            reads = reads.inner
        if reads is not cache:
            raise UsageError("the engine must read its repository through the PackCache given (engine(model, cache))")
        self.engine, self.cache, self.rank, self.world = engine, cache, rank, world
        self.timeout, self.piece_bytes, self.backend = timeout, piece_bytes, backend
        self.spread, self.window = spread, window
        if token is not None and not token:
            raise UsageError("the packcast token is empty: give a file holding a shared secret")
        self._token = token
        # This run's group: with a token, every record names it, so one of another run of
        # node 0 (same token) is refused (the next record tells followers which one it is).
        self._gid = secrets.token_hex(8) if rank == 0 else ""
        self.link_bytes = LinkBytes()  # bytes sent to and received from the group, over every round
        self.reports: list[RoundReport] = []
        if store is None:
            assert master is not None
            host, _, port = master.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise UsageError(f"master must be host:port, got {master!r}")
            listen: socket.socket | None = None
            try:
                if rank == 0:
                    # TCPStore alone listens on every interface whatever host it is given: bind
                    # the socket where told and hand it over.
                    listen = _listen(host, int(port))
                    _warn_open(host, token)
                store = dist.TCPStore(  # type: ignore[attr-defined]
                    host, int(port), None, rank == 0, timeout=timedelta(seconds=timeout), wait_for_workers=False,
                    master_listen_fd=listen.fileno() if listen is not None else None,
                )
                if listen is not None:
                    listen.detach()  # the store owns the descriptor now
            except (RuntimeError, OSError) as e:  # torch's DistError is one
                if listen is not None:
                    listen.close()
                if rank == 0:
                    raise UsageError(f"packcast node 0 cannot listen on {master}: {e}") from None
                raise GroupError(f"packcast node {rank}: node 0's store at {master} did not answer within "
                                 f"{timeout:g}s: {e}") from None
        self._store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        self._round = 0
        self._epoch = 0
        self._members: tuple[int, ...] = ()
        self._classes: tuple[tuple[int, ...], ...] = ()  # node 0: how the members were grouped
        self._groups: dict[tuple[int, ...], Any] = {}  # process groups of ``_group_epoch``, by their ranks
        self._group_epoch = -1
        self._groups_lock = threading.Lock()
        self._rebuild = False
        self._retained_raw: dict[str, bytes] = {}  # node 0: the manifests of the round being planned
        self._holds_of: dict[int, Holds] = {}  # node 0: what each node holds, as it said when it joined
        self._started: tuple[int, threading.Thread, list[str], tuple[int, int]] | None = None  # start_round's
        self._joins_seen = 0
        self._refused: set[tuple[str, bytes]] = set()  # records refused, logged once each
        if rank == 0:
            self._put_next(1)
            self._fetchers = max(2, min(8, cache.io_concurrency))
            self._fetch_pool = ThreadPoolExecutor(self._fetchers, thread_name_prefix="deltasync-packcast")
            # Reading through relays (grpc://a[,b,…]): the objects node 0 asks for ahead of its
            # reads, four per relay, so every relay's link carries its share without gaps (_send).
            self._lead = _AHEAD_PER_RELAY * cache.inner.relays
            self._touch_pool = ThreadPoolExecutor(max(1, self._lead), thread_name_prefix="deltasync-packcast-ahead")
        else:
            try:
                self._store.wait(["next"], timedelta(seconds=timeout))
                nxt = self._read_next()
                if nxt is None:
                    raise GroupError(f"packcast node {rank}: node 0's store at {master or 'the store given'} holds no "
                                     "round counter this node can authenticate (a different --packcast-token-file?)")
                # A counter naming a round never written (set from outside) is not followed:
                # the next round written is found while waiting (next_round).
                self._round = nxt - 1 if nxt == 1 or self._store.check([f"round/{nxt - 1}"]) else 0
                self._put(f"holds/{rank}", "holds", rank, self.holds())
                self._put(f"joined/{rank}", "joined", rank, 1)  # node 0 waits for it from its next round
                self._store.add("joins", 1)  # and starts one soon, even at the version it holds
            except dist.DistError as e:
                raise GroupError(f"packcast node {rank}: node 0's store at {master or 'the store given'} did not "
                                 f"answer within {timeout:g}s: {e}") from None

    def holds(self) -> Holds:
        """What this node's engine holds, as node 0 plans with it (None: every tensor)."""
        holdings = getattr(self.engine, "holdings", None)
        if not callable(holdings):
            return None
        held: Mapping[str, Region | None] = holdings()
        return {n: None if r is None else [list(r.offsets), list(r.shape)] for n, r in held.items()}

    # -- node 0 ------------------------------------------------------------------------------------

    def update(self, version: int | None = None, *, apply: Apply | None = None,
               note: Mapping[str, Any] | None = None) -> RoundReport:
        """Node 0: bring every member's engine to ``version`` (default: the latest).

        Members are last round's nodes that say they are ready within ``timeout`` (the first
        round waits for all ``world``), nodes that joined since, and any other already ready.
        ``apply(version)`` takes the version into this node's engine (default:
        ``engine.update``); ``note`` goes to the followers with the round (an agent's latest
        and pin). Returns this node's report; each follower keeps its own in ``reports``."""
        if self.rank != 0:
            raise UsageError("nodes other than 0 follow node 0: call follow()")
        sub = self.engine.subscriber  # type: ignore[attr-defined]
        counters = self.cache.received_bytes, self.cache.upstream_bytes
        target = sub.repo.resolve(version)
        n = self._round + 1
        self._store.set(f"ready/{n}/0", "ok")
        members, versions = self._gather_ready(n)
        # Nodes that join from here on get a round of their own (joins_pending); one that joined
        # just before and missed this round's members catches up from the relay when it reads
        # the round's header.
        self._joins_seen = int(self._store.add("joins", 0))
        classes = self._classes_for(sub, target, members, versions)
        grouping = tuple(tuple(c["ranks"]) for c in classes)
        if members != self._members or grouping != self._classes or self._rebuild:
            self._epoch += 1
            self._members, self._classes, self._rebuild = members, grouping, False
        header: dict[str, Any] = {"version": target, "members": members, "epoch": self._epoch, "classes": classes}
        if note:
            header["note"] = dict(note)
        self._put(f"round/{n}", "round", n, header)
        self._put_next(n + 1)  # the round a node starting now takes part in
        for r in range(self.world) if n > 2 else ():  # what no node reads any more
            self._store.delete_key(f"ready/{n - 2}/{r}")
        if n > 2:
            self._store.delete_key(f"round/{n - 2}")
        return self._run_round(n, header, apply, counters)

    def joins_pending(self) -> bool:
        """Node 0: whether a node joined (or came back) since the last round started; a round,
        even at the version node 0 holds, brings it to that version."""
        return int(self._store.add("joins", 0)) > self._joins_seen

    def close(self) -> None:
        """Node 0: tell the followers to return from :meth:`follow`."""
        if self.rank == 0:
            self._put(f"round/{self._round + 1}", "round", self._round + 1, {"stop": True})
            self._fetch_pool.shutdown(wait=False, cancel_futures=True)
            self._touch_pool.shutdown(wait=False, cancel_futures=True)

    def _gather_ready(self, n: int) -> tuple[tuple[int, ...], dict[int, int | None]]:
        """Last round's members and nodes that joined since, those that say they are ready
        within the timeout; and any other node that already has. With the version each one's
        engine holds."""
        expected = set(self._members or range(self.world))  # the first round waits for every node
        joined = [r for r in range(1, self.world)
                  if self._store.check([f"joined/{r}"]) and self._take(f"joined/{r}", "joined", r) is not None]
        for r in joined:  # waited for once: one that died since is not waited for again
            self._store.delete_key(f"joined/{r}")
            self._holds_of.pop(r, None)  # it may hold something else now
        wanted_keys = [f"ready/{n}/{r}" for r in sorted(expected.union(joined)) if r != 0]
        deadline = time.monotonic() + self.timeout
        while wanted_keys and not self._store.check(wanted_keys) and time.monotonic() < deadline:
            time.sleep(0.005)
        ready = [0]
        versions: dict[int, int | None] = {0: self.engine.version}
        for r in range(1, self.world):
            key = f"ready/{n}/{r}"
            said = self._take(key, f"ready/{n}", r) if self._store.check([key]) else None
            if isinstance(said, dict):  # a member only once it says so with the group's token
                ready.append(r)
                versions[r] = said.get("version")
                if not said.get("ok"):
                    self._rebuild = True  # its group broke last round
        return tuple(ready), versions

    def _holds_of_node(self, r: int) -> Holds:
        if r == 0:
            return self.holds()
        if r not in self._holds_of:
            key = f"holds/{r}"
            self._holds_of[r] = self._take(key, "holds", r) if self._store.check([key]) else None
        return self._holds_of[r]

    def _classes_for(self, sub: Any, target: int, members: tuple[int, ...],
                     versions: Mapping[int, int | None]) -> list[dict[str, Any]]:
        """The members grouped by what they hold and the version they hold it at, each class
        with the stream it receives."""
        info = sub.repo.manifest(target)
        by_holds: dict[str, list[int]] = {}
        holds: dict[str, tuple[Holds, int | None]] = {}
        for r in members:
            h = self._holds_of_node(r)
            k = hashlib.sha256(json.dumps([h, versions.get(r)], sort_keys=True).encode()).hexdigest()
            by_holds.setdefault(k, []).append(r)
            holds[k] = h, versions.get(r)
        self._retained_raw.clear()
        streams = {k: self._segments_for(sub, info, *holds[k]) for k in by_holds}
        # One order of objects for every stream, so that node 0 reads each range once and
        # copies it into every stream that carries it.
        rank = _object_order(streams.values())
        return [{"ranks": ranks, "segments": sorted(streams[k], key=lambda s: (rank[s[0]], s[2]))}
                for k, ranks in by_holds.items()]

    def _segments_for(self, sub: Any, info: ManifestInfo, holds: Holds, base: int | None) -> list[Segment]:
        """What a node holding ``holds`` at version ``base`` reads to stage ``info``'s version:
        the manifests of its path, then the packs in the order it first reads them: the ranges
        its pull reads (it reads them as ranges: ``PackCache.prefers_ranges``), or whole for an
        engine that does not say what it holds."""
        want = _want(info, holds)
        plan, chain = sub.plan(info.version, base, want)
        out: list[Segment] = []
        for step in chain.infos:
            if step.version == plan.base:
                continue  # the nodes at that version hold it already
            key = squash_key(step.parent or 0, step.version) if chain.is_squash(step) else manifest_key(step.version)
            raw = self._retained_raw.get(key) or self.cache.retained(key)
            if raw is None:
                raw = self.cache.inner.get(key, max_bytes=MAX_MANIFEST_BYTES)
                self.cache.add_upstream(len(raw))
            self._retained_raw[key] = raw
            out.append((key, len(raw), 0, len(raw)))
        reads: dict[str, tuple[int, list[tuple[int, int]]]] = {}
        for t in info.pb.tensors:
            key = key_of(t)
            for idx in wanted(want, key, len(t.chunks)):
                for step, c in reversed(chain.steps(key, idx, plan.base)[0]):
                    if c.encoding != SAME:
                        pack = step.pb.packs[c.pack]
                        reads.setdefault(pack.key, (int(pack.size), []))[1].append((int(c.offset), int(c.length)))
        for key, (size, ranges) in reads.items():
            if holds is None:
                out.append((key, size, 0, size))
            else:  # the ranges it reads (all of the pack, often: one whole object, checked on arrival)
                out.extend((key, size, off, n) for off, n in _merged(ranges))
        return out

    def _touch(self, key: str, offset: int) -> None:
        """One byte of ``key`` read ahead (node 0, through relays): its relay starts fetching it
        whole. A failure is only a lost head start: the window's reads of it fail over as any."""
        try:
            self.cache.add_upstream(len(self.cache.inner.get(key, (offset, 1))))
        except (DeltasyncError, OSError) as e:
            log.debug("packcast: reading ahead %s failed (%s)", key, e)

    def _fetch(self, key: str, size: int, offset: int, length: int) -> bytes:
        """Bytes ``offset .. offset+length`` of an object of the round (ranged reads: a piece
        goes out while the rest of its pack is still on its way)."""
        raw = self._retained_raw.get(key)
        if raw is not None:
            data = raw[offset : offset + length]
        else:
            try:
                data = self.cache.inner.get(key, (offset, length))
            except (DeltasyncError, OSError) as e:
                log.warning("packcast: fetching %s failed (%s); the nodes read it from the relay", key, e)
                data = b""
            self.cache.add_upstream(len(data))
        return data[:length].ljust(length, b"\0")  # what does not match its key or digest is refused on arrival

    # -- other nodes -------------------------------------------------------------------------------

    def follow(self, *, rounds: int | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Every round node 0 starts, until it closes, ``rounds`` rounds were taken part in or
        ``stop`` returns True. A round this node is left out of, it catches up on from the relay.
        Raises GroupError when node 0's store is gone (the caller then follows the relay:
        ``engine.update()``)."""
        if self.rank == 0:
            raise UsageError("node 0 drives the group: call update()")
        done = 0
        while (stop is None or not stop()) and (rounds is None or done < rounds):
            done += 1
            got = self.next_round(stop)
            if got is None or got[1].get("stop"):
                return
            n, header = got
            try:
                self.take_round(n, header)
            except (DeltasyncError, OSError) as e:  # the engine serves what it held; the next round retries
                log.warning("packcast node %d: version %s did not reach the engine: %s", self.rank, header["version"], e)
                self.reports.append(RoundReport(n, int(header["version"]), tuple(header["members"]), None, 0, 0, None,
                                                False, time.time(), f"{type(e).__name__}: {e}"))

    def next_round(self, stop: Callable[[], bool] | None = None) -> tuple[int, dict[str, Any]] | None:
        """Say this node is ready and wait for the next round node 0 starts: ``(round, header)``
        (``header["stop"]``: node 0 closed); None once ``stop`` returns True (asked every 50 ms
        while waiting). Raises GroupError when node 0's store is gone.

        The store is shared with whoever reaches its port: a round counter that names a round
        not written is not followed, a header that does not authenticate (with a token) is
        refused and waited past, and a node that sees no round for ``2 * timeout`` goes back
        to the round node 0's counter names (one forged far ahead does not hold it)."""
        import torch.distributed as dist

        n = self._round + 1
        try:
            # Rounds that went on while this node was busy (node 0 keeps only the last two):
            # take the newest one, as a member if it has not started, else catching up.
            n = self._upcoming(n, back=False)
            self._say_ready(n)
            since = time.monotonic()
            resync = since
            while True:
                if self._store.check([f"round/{n}"]):
                    got = self._take(f"round/{n}", "round", n)
                    if isinstance(got, dict):
                        header: dict[str, Any] = got
                        break
                if stop is not None and stop():
                    return None
                time.sleep(0.05)
                now = time.monotonic()
                if now - resync >= 1.0:
                    resync = now
                    m = self._upcoming(n, back=now - since >= 2 * self.timeout)
                    if m != n:
                        n, since = m, now
                        self._say_ready(n)
        except dist.DistError as e:
            raise GroupError(f"packcast node {self.rank}: node 0's store is gone ({e})") from None
        if not header.get("stop"):
            self._round = n
        return n, header

    def _say_ready(self, n: int) -> None:
        self._put(f"ready/{n}/{self.rank}", f"ready/{n}", self.rank,
                  {"ok": not self._rebuild, "version": self.engine.version})

    def _upcoming(self, n: int, *, back: bool) -> int:
        """The round to wait for: ``n``, or the newest one node 0's counter names when that
        round was written and not taken (later than ``n``, or with ``back``, any)."""
        nxt = self._read_next()
        if nxt is None or nxt - 1 < 1 or nxt - 1 == n or nxt - 1 == self._round:
            return n
        if not self._store.check([f"round/{nxt - 1}"]):
            return n  # a counter naming a round never written (set from outside, say): not followed
        if nxt - 1 > n or back:
            if nxt - 1 < n:
                log.warning("packcast node %d: no round %d after %gs; node 0's counter says round %d: following it",
                            self.rank, n, 2 * self.timeout, nxt - 1)
            return nxt - 1
        return n

    # -- records in the store: authenticated with the token, when there is one ----------------------

    def _mac(self, kind: str, n: int, body: Any, gid: str) -> str:
        assert self._token is not None
        canon = json.dumps([gid, kind, n, body], sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._token, canon, hashlib.sha256).hexdigest()

    def _put(self, key: str, kind: str, n: int, body: Any) -> None:
        """Write ``body`` at ``key``: with a token, with its MAC over the group, ``kind`` and
        ``n`` (the round, or the rank), so a record cannot be replayed under another key."""
        if self._token is None:
            self._store.set(key, json.dumps(body, sort_keys=True))
            return
        self._store.set(key, json.dumps({"body": body, "mac": self._mac(kind, n, body, self._gid)}, sort_keys=True))

    def _take(self, key: str, kind: str, n: int) -> Any:
        """The body at ``key``; None (an error logged) when it does not authenticate."""
        raw = bytes(self._store.get(key))
        try:
            value = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            if (key, raw) not in self._refused:
                self._refused.add((key, raw))
                log.error("packcast node %d: %s in node 0's store is not a packcast record: refused", self.rank, key)
            return None
        if self._token is None:
            return value
        if not isinstance(value, dict) or not isinstance(value.get("mac"), str) or "body" not in value or \
                not hmac.compare_digest(value["mac"], self._mac(kind, n, value["body"], self._gid)):
            if (key, raw) in self._refused:
                return None
            if len(self._refused) > 1000:
                self._refused.clear()
            self._refused.add((key, raw))
            log.error("packcast node %d: %s in node 0's store does not carry this group's token (written by another "
                      "process, another run of node 0, or with another --packcast-token-file): refused", self.rank, key)
            return None
        return value["body"]

    def _put_next(self, n: int) -> None:
        body = {"next": n, "group": self._gid}
        if self._token is None:
            self._store.set("next", str(n))
        else:
            self._store.set("next", json.dumps({"body": body, "mac": self._mac("next", 0, body, "")}, sort_keys=True))

    def _read_next(self) -> int | None:
        """Node 0's round counter (with a token: authenticated, and the group learned from it);
        None when it cannot be read or does not authenticate."""
        raw = self._store.get("next")
        if self._token is None:
            try:
                return int(raw)
            except ValueError:
                return None
        try:
            value = json.loads(raw)
            body = value["body"]
            ok = hmac.compare_digest(str(value["mac"]), self._mac("next", 0, body, ""))
            n, gid = int(body["next"]), str(body["group"])
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError):
            ok = False
        if not ok:
            if ("next", bytes(raw)) in self._refused:
                return None
            self._refused.add(("next", bytes(raw)))
            log.error("packcast node %d: node 0's round counter does not carry this group's token: refused", self.rank)
            return None
        if gid != self._gid and self.rank != 0:
            self._gid = gid
        return n

    def take_round(self, n: int, header: dict[str, Any], apply: Apply | None = None) -> RoundReport:
        """Take part in round ``n`` (from :meth:`next_round`): as a member, receive and stage
        from what arrives; left out of it, catch up from the relay. ``apply`` as for :meth:`update`."""
        self._round = n
        if self.rank in header["members"]:
            return self._run_round(n, header, apply)
        return self._catch_up(n, int(header["version"]), apply)

    def _catch_up(self, n: int, version: int, apply: Apply | None) -> RoundReport:
        before = self.cache.upstream_bytes
        record = (apply or self.engine.update)(version)
        report = RoundReport(n, version, (), record, 0, self.cache.upstream_bytes - before, None, False, time.time())
        self.reports.append(report)
        return report

    # -- every member --------------------------------------------------------------------------------

    def _group(self, epoch: int, ranks: tuple[int, ...]) -> Any:
        """The process group of ``ranks`` (node 0 first) for ``epoch``, built through the store."""
        import torch.distributed as dist

        with self._groups_lock:
            if epoch != self._group_epoch:
                self._groups.clear()
                self._group_epoch, self._rebuild = epoch, False
            pg = self._groups.get(ranks)
        if pg is not None:
            return pg
        store = dist.PrefixStore(f"epoch/{epoch}/{'.'.join(map(str, ranks))}", self._store)  # type: ignore[attr-defined]
        idx, size = ranks.index(self.rank), len(ranks)
        if self.backend == "nccl":
            pg = dist.ProcessGroupNCCL(store, idx, size, dist.ProcessGroupNCCL.Options())
        else:
            pg = dist.ProcessGroupGloo(store, idx, size, timedelta(seconds=self.timeout))
        with self._groups_lock:
            if epoch == self._group_epoch:
                self._groups[ranks] = pg
        return pg

    def start_round(self, n: int, header: dict[str, Any]) -> None:
        """Start receiving round ``n`` (from :meth:`next_round`) before taking it: reads of its
        objects (the target's manifest, say) wait for them from here on. :meth:`take_round`
        finishes it, or :meth:`drop_round` lets it go."""
        if self.rank in header["members"] and (self._started is None or self._started[0] != n):
            self.drop_round()
            self._started = self._begin(n, header)

    def drop_round(self) -> None:
        """Let a round started and not taken go: what arrives is forgotten."""
        started, self._started = self._started, None
        if started is not None:
            started[1].join()
            self.cache.forget()

    def _begin(self, n: int, header: dict[str, Any],
               counters: tuple[int, int] | None = None) -> tuple[int, threading.Thread, list[str], tuple[int, int]]:
        classes = [(tuple(int(r) for r in c["ranks"]), [_segment(s) for s in c["segments"]]) for c in header["classes"]]
        mine = next((segs for ranks, segs in classes if self.rank in ranks), [])
        self._round = n
        counters = counters or (self.cache.received_bytes, self.cache.upstream_bytes)
        self._links0 = self.link_bytes.snapshot()
        self.cache.expect((s[0] for s in mine), in_part={s[0] for s in mine if s[3] != s[1]})
        errors: list[str] = []
        mover = threading.Thread(target=self._move, args=(int(header["epoch"]), classes, errors),
                                 name="deltasync-packcast", daemon=True)
        mover.start()
        return n, mover, errors, counters

    def _run_round(self, n: int, header: dict[str, Any], apply: Apply | None = None,
                   counters: tuple[int, int] | None = None) -> RoundReport:
        version, members = int(header["version"]), tuple(header["members"])
        started, self._started = self._started, None
        if started is not None and started[0] != n:
            self._started = started
            self.drop_round()
            started = None
        _, mover, errors, (received0, upstream0) = started or self._begin(n, header, counters)
        take = apply or self.engine.update
        repaired = False
        try:
            try:
                record = take(version)
            except (CorruptObjectError, ChecksumMismatchError) as e:
                log.warning("packcast: version %d from the bytes received did not verify (%s); reading it from the relay",
                            version, e)
                mover.join()
                self.cache.forget()
                repaired = True
                record = take(version)
        finally:
            mover.join()
            self.cache.forget()
        if errors:
            self._rebuild = True
            with self._groups_lock:
                self._groups.clear()
                self._group_epoch = -1
        sent, got = self.link_bytes.snapshot()
        sent0, got0 = getattr(self, "_links0", (0, 0))
        report = RoundReport(
            n, version, members, record, self.cache.received_bytes - received0, self.cache.upstream_bytes - upstream0,
            errors[0] if errors else None, repaired, time.time(), link_sent=sent - sent0, link_received=got - got0,
        )
        self.reports.append(report)
        return report

    def _move(self, epoch: int, classes: list[tuple[tuple[int, ...], list[Segment]]], errors: list[str]) -> None:
        """Send (node 0) or receive the round's streams, in pieces, handing each object (or its
        ranges) to the cache as it completes. Any failure ends a stream here: the rest comes
        from the relay."""
        import torch

        try:
            if self.rank == 0:
                self._send(epoch, classes, errors)
                return
            segments = next((segs for ranks, segs in classes if self.rank in ranks), [])
            total = sum(s[3] for s in segments)
            if total:
                ranks = next(_group_ranks(r) for r, _ in classes if self.rank in r)
                pg = self._group(epoch, ranks)
                if self.spread != "broadcast":
                    assembly = _Assembly(segments, self.cache)
                    chain_receive(pg, ranks.index(self.rank), len(ranks), total, self.piece_bytes, assembly.feed,
                                  shape=self.spread, window=self.window, timeout=self.timeout, device=self._device(),
                                  counter=self.link_bytes, pace=self._pacer(ranks))
                else:
                    piece = torch.empty(min(self.piece_bytes, total), dtype=torch.uint8)
                    self._receive(pg, piece, segments, total, ranks.index(self.rank), len(ranks))
        except Exception as e:  # a dead or hung peer, or a group that could not be built
            errors.append(f"{type(e).__name__}: {e}")
            log.warning("packcast node %d: the broadcast stopped (%s); reading the rest from the relay", self.rank, e)
        finally:
            self.cache.give_up()

    def _send(self, epoch: int, classes: list[tuple[tuple[int, ...], list[Segment]]], errors: list[str]) -> None:
        streams = [_Stream(self, ranks, segs) for ranks, segs in classes if any(s[3] for s in segs)]
        if not streams:
            return
        # Every class's group at once (each waits for its own members).
        def build(st: _Stream) -> None:
            if st.ranks == (0,):
                return  # node 0's own class, alone: nothing to send
            try:
                st.pg = self._group(epoch, _group_ranks(st.ranks))
            except Exception as e:
                st.failed(e, errors)

        remote = [st for st in streams if st.ranks != (0,)]
        if len(remote) > 1:
            with ThreadPoolExecutor(len(remote), thread_name_prefix="deltasync-packcast-group") as pool:
                list(pool.map(build, remote))
        else:
            for st in remote:
                build(st)
        # The union of the streams, in their one order, read once in pieces (ranged reads run
        # ahead in a bounded window while earlier pieces go out).
        order = _object_order(st.segments for st in streams)
        runs: dict[str, tuple[int, list[tuple[int, int]]]] = {}
        for st in streams:
            for key, size, off, n in st.segments:
                runs.setdefault(key, (size, []))[1].append((off, n))
        step = self.piece_bytes
        parts = [(key, size, off, min(step, start + n - off))
                 for key, (size, ranges) in sorted(runs.items(), key=lambda kv: order[kv[0]])
                 for start, n in _merged(ranges) for off in range(start, start + n, step)]
        window: deque[Future[bytes]] = deque()
        ahead = 2 * self._fetchers
        todo = iter(parts)
        # Through relays, each read starts at the relay its key hashes to (storage/_grpc.py),
        # but the window spans about one pack: alone, the relays would fetch their shares one
        # after another, and one relay would start each pack only when the window reached it.
        # So node 0 asks for one byte of each of the next ``_lead`` objects (four per relay)
        # ahead of the one it reads: a relay fetches an object whole, once, on its first read
        # (relay/fetch.py), so every relay's link carries its next packs while node 0 reads,
        # and the window's reads find them landing.
        first: dict[str, int] = {}  # each object's first offset read, in the stream's order
        for key, _size, off, _n in parts:
            if key not in self._retained_raw:
                first.setdefault(key, off)
        objects = list(first)
        index = {key: i for i, key in enumerate(objects)}
        touched = 0
        for key, _size, off, _n in parts:
            if self._lead and key in index:
                while touched < min(len(objects), index[key] + 1 + self._lead):
                    self._touch_pool.submit(self._touch, objects[touched], first[objects[touched]])
                    touched += 1
            while len(window) < ahead and (nxt := next(todo, None)) is not None:
                window.append(self._fetch_pool.submit(self._fetch, *nxt))
            data = window.popleft().result()
            for st in streams:
                st.take(key, off, data, errors)
        for st in streams:
            st.flush(errors)

    def _device(self) -> Any:
        if self.backend != "nccl":
            return None
        import torch

        return torch.device("cuda", torch.cuda.current_device())

    def _pace(self, peer: int, nbytes: int) -> None:
        """A link model's hook (benchmarks): ``nbytes`` are about to leave for node ``peer``."""

    def _pacer(self, ranks: tuple[int, ...]) -> Callable[[int, int], None] | None:
        if type(self)._pace is PackcastNode._pace:
            return None
        return lambda peer, nbytes: self._pace(ranks[peer], nbytes)

    def _receive(self, pg: Any, piece: Any, segments: list[Segment], total: int, index: int, size: int) -> None:
        view = piece.numpy()
        assembly = _Assembly(segments, self.cache)
        left = total
        while left:
            length = min(len(view), left)
            self._broadcast(pg, piece[:length], index, size)
            assembly.feed(view[:length].tobytes())
            left -= length

    def _broadcast(self, pg: Any, piece: Any, index: int, size: int) -> None:
        """The old path: the group's own broadcast. Its bytes per rank are counted by the
        binomial tree gloo's broadcast runs (gloo does not report them)."""
        import torch.distributed as dist

        sends = binomial_children(index, size) * piece.numel()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = timedelta(seconds=self.timeout)
        if self.backend == "nccl":  # the piece crosses the links on the GPUs, decoding reads it on the host
            import torch

            dev = piece.to(torch.device("cuda", torch.cuda.current_device()))
            pg.broadcast([dev], opts).wait()
            piece.copy_(dev)
        else:
            pg.broadcast([piece], opts).wait()
        self.link_bytes.add(sent=sends, received=piece.numel() if index else 0)


class _Assembly:
    """Objects (or their ranges) out of a stream's bytes, handed to a cache as each completes."""

    def __init__(self, segments: list[Segment], cache: PackCache) -> None:
        self.queue = deque(segments)
        self.cache = cache
        self.cur = bytearray()
        self.left: dict[str, int] = {}
        for key, *_ in segments:
            self.left[key] = self.left.get(key, 0) + 1
        self.parts: dict[str, list[tuple[int, bytes]]] = {}

    def feed(self, data: bytes) -> None:
        at = 0
        while at < len(data) and self.queue:
            key, size, off, n = self.queue[0]
            take = min(n - len(self.cur), len(data) - at)
            self.cur += data[at : at + take]
            at += take
            if len(self.cur) < n:
                continue
            self.queue.popleft()
            got, self.cur = bytes(self.cur), bytearray()
            self.parts.setdefault(key, []).append((off, got))
            self.left[key] -= 1
            if not self.left[key]:
                parts = self.parts.pop(key)
                if len(parts) == 1 and parts[0][0] == 0 and len(parts[0][1]) == size:
                    self.cache.offer(key, got)  # whole: checked against its content address
                else:
                    self.cache.offer_parts(key, parts)


class _Stream:
    """Node 0's side of one class's stream: the ranges it carries, copied out of the pieces
    node 0 reads, sent a piece at a time down the class's chain (or broadcast over its group),
    and, for node 0's own class, handed to its own cache."""

    def __init__(self, node: PackcastNode, ranks: tuple[int, ...], segments: list[Segment]) -> None:
        self.node, self.ranks, self.segments = node, ranks, segments
        self.queue = deque(segments)
        self.done = 0  # bytes of the first segment in the queue already taken
        self.step = min(node.piece_bytes, sum(s[3] for s in segments))
        self.filled = 0
        self.pg: Any = None
        self.out: ChainOut | None = None
        self.piece: Any = None  # the broadcast's one buffer
        self.own = _Assembly(segments, node.cache) if 0 in ranks else None

    def failed(self, e: BaseException, errors: list[str]) -> None:
        self.pg = None
        errors.append(f"{type(e).__name__}: {e}")
        log.warning("packcast: the stream to nodes %s stopped (%s); they read the rest from the relay",
                    list(self.ranks), e)

    def take(self, key: str, off: int, data: bytes, errors: list[str]) -> None:
        """Copy what this stream carries of bytes ``off ..`` of ``key`` (the reads come in the
        stream's own order, so its segments are met in turn)."""
        end = off + len(data)
        while self.queue:
            k, _size, s_off, n = self.queue[0]
            if k != key or s_off + self.done >= end:
                return
            lo = max(s_off + self.done, off)
            hi = min(s_off + n, end)
            self._emit(data[lo - off : hi - off], errors)
            self.done += hi - lo
            if self.done < n:
                return
            self.queue.popleft()
            self.done = 0

    def _view(self) -> np.ndarray:
        node = self.node
        if node.spread != "broadcast":
            if self.out is None:
                group = _group_ranks(self.ranks)
                self.out = ChainOut(self.pg, self.step, size=len(group), shape=node.spread, window=node.window,
                                    timeout=node.timeout, device=node._device(), counter=node.link_bytes,
                                    pace=node._pacer(group))
            return self.out.view()
        if self.piece is None:
            import torch

            self.piece = torch.empty(self.step, dtype=torch.uint8)
        view: np.ndarray = self.piece.numpy()
        return view

    def _emit(self, data: bytes, errors: list[str]) -> None:
        if self.own is not None:
            self.own.feed(data)
        src = np.frombuffer(data, dtype=np.uint8)
        at = 0
        try:
            while at < len(src) and self.pg is not None:
                view = self._view()
                take = min(self.step - self.filled, len(src) - at)
                view[self.filled : self.filled + take] = src[at : at + take]
                self.filled, at = self.filled + take, at + take
                if self.filled == self.step:
                    self._send(self.step)
                    self.filled = 0
        except Exception as e:  # a dead or hung member: the others of this class read the rest from the relay
            self.failed(e, errors)

    def flush(self, errors: list[str]) -> None:
        try:
            if self.filled and self.pg is not None:
                self._send(self.filled)
            if self.out is not None and self.pg is not None:
                self.out.close()
        except Exception as e:
            self.failed(e, errors)
        self.filled = 0

    def _send(self, length: int) -> None:
        if self.out is not None:
            self.out.send(length)
        else:
            self.node._broadcast(self.pg, self.piece[:length], 0, len(_group_ranks(self.ranks)))


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket bound to ``host`` (its first address) only."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _warn_open(host: str, token: bytes | None) -> None:
    if token is not None:
        return
    try:
        loopback = all(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        loopback = False
    if not loopback:
        log.warning("packcast node 0 listens on %s without a token: anyone who reaches that port can move the "
                    "followers to another version or stall them (give --packcast-token-file; docs/trust.md)", host)


def _object_order(streams: Iterable[list[Segment]]) -> dict[str, int]:
    """One order of the objects of all streams: manifests first (a node's staging starts
    with them), then packs by first use (class by class)."""
    streams = list(streams)
    rank: dict[str, int] = {}
    for segs in streams:
        for key, *_ in segs:
            if not key.startswith("packs/"):
                rank.setdefault(key, len(rank))
    for segs in streams:
        for key, *_ in segs:
            rank.setdefault(key, len(rank))
    return rank


def _want(info: ManifestInfo, holds: Holds) -> dict[str, list[int]] | None:
    """The chunks a torch engine holding ``holds`` stages (as TorchEngine._stage picks them)."""
    if holds is None:
        return None
    names = {t.name for t in info.pb.tensors}
    keys = [key_of(t) for t in info.pb.tensors if t.name in holds]
    regions = {n: Region(tuple(r[0]), tuple(r[1])) for n, r in holds.items() if r is not None and n in names}
    chunks = select_tensors(info, None, regions)[0] if regions else None
    return want_of(info.entries(), keys, chunks)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges joined where they touch or overlap, in order."""
    out: list[tuple[int, int]] = []
    for off, n in sorted(ranges):
        if out and off <= out[-1][0] + out[-1][1]:
            last_off, last_n = out[-1]
            out[-1] = (last_off, max(last_n, off + n - last_off))
        else:
            out.append((off, n))
    return out


def _segment(s: Any) -> Segment:
    key, size, off, n = s
    return str(key), int(size), int(off), int(n)


def _group_ranks(ranks: tuple[int, ...]) -> tuple[int, ...]:
    """A class's group: node 0 (the root, group rank 0) and the class's members."""
    return (0, *sorted(r for r in ranks if r != 0))


__all__ = ["PackCache", "PackcastNode", "RoundReport"]

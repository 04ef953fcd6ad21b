"""Packcast: a version's stored bytes fetched once per cluster, spread to every node by gloo or nccl.

Every node of a cluster keeps its own engine (a :class:`TorchEngine`, say) current. Without
packcast each node pulls each version from the cluster's relay, so the relay's egress
carries the delta once per node and time grows with the node count. With packcast, node 0
fetches the version's objects (its manifests, then its packs: compressed, as stored) from
the relay once and broadcasts them to the group in pieces (``torch.distributed`` gloo on
CPU, nccl on GPU, both pipelined by their own algorithms); every node decodes, verifies and
applies only what its engine holds, from those bytes. Nothing is decoded on one node for
another, so the bytes on each link are the stored delta, not decoded changes.

Stages overlap at pack granularity: node 0 fetches pack k+1 while pack k is broadcast, and
every engine's pull pipeline decodes pack k as soon as it has arrived (a read of an
announced object waits for it), while later pieces are still on the wire.

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
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
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
from ..format.manifest import MAX_MANIFEST_BYTES, key_of, manifest_key
from ..repo.repository import squash_key
from ..storage import WrappingStore
from ._packcache import PackCache
from .base import Engine, SwapRecord

log = logging.getLogger("deltasync.engines")

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
    ``piece_bytes``: the unit of a broadcast. ``backend``: ``gloo`` (CPU) or ``nccl``.
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
    ) -> None:
        import torch.distributed as dist

        if not 0 <= rank < world:
            raise UsageError(f"rank must be in 0..{world - 1}, got {rank}")
        if timeout <= 0 or piece_bytes < 1:
            raise UsageError("timeout and piece_bytes must be positive")
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
        self.reports: list[RoundReport] = []
        if store is None:
            assert master is not None
            host, _, port = master.rpartition(":")
            if not host or not port.isdigit():
                raise UsageError(f"master must be host:port, got {master!r}")
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, int(port), None, rank == 0, timeout=timedelta(seconds=timeout), wait_for_workers=False
            )
        self._store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        self._round = 0
        self._epoch = 0
        self._members: tuple[int, ...] = ()
        self._pg: Any = None
        self._rebuild = False
        self._retained_raw: dict[str, bytes] = {}  # node 0: the manifests of the round being planned
        if rank == 0:
            self._store.set("next", "1")
            self._fetchers = max(2, min(8, cache.io_concurrency))
            self._fetch_pool = ThreadPoolExecutor(self._fetchers, thread_name_prefix="deltasync-packcast")
        else:
            try:
                self._store.wait(["next"], timedelta(seconds=timeout))
                self._round = int(self._store.get("next")) - 1
                self._store.set(f"joined/{rank}", "1")  # node 0 waits for it from its next round
            except dist.DistError as e:
                raise GroupError(f"packcast node {rank}: node 0's store at {master or 'the store given'} did not "
                                 f"answer within {timeout:g}s: {e}") from None

    # -- node 0 ------------------------------------------------------------------------------------

    def update(self, version: int | None = None) -> RoundReport:
        """Node 0: bring every member's engine to ``version`` (default: the latest).

        Members are last round's nodes that say they are ready within ``timeout`` (the first
        round waits for all ``world``), nodes that joined since, and any other already ready.
        Returns this node's report; each follower keeps its own in ``reports``."""
        if self.rank != 0:
            raise UsageError("nodes other than 0 follow node 0: call follow()")
        sub = self.engine.subscriber  # type: ignore[attr-defined]
        counters = self.cache.received_bytes, self.cache.upstream_bytes
        target = sub.repo.resolve(version)
        n = self._round + 1
        self._store.set(f"ready/{n}/0", "ok")
        members = self._gather_ready(n)
        objects = self._objects_for(sub, target)
        if members != self._members or self._rebuild:
            self._epoch += 1
        header = {"version": target, "members": members, "epoch": self._epoch, "objects": objects}
        self._store.set(f"round/{n}", json.dumps(header))
        self._store.set("next", str(n + 1))  # the round a node starting now takes part in
        for r in range(self.world) if n > 2 else ():  # what no node reads any more
            self._store.delete_key(f"ready/{n - 2}/{r}")
        if n > 2:
            self._store.delete_key(f"round/{n - 2}")
        return self._run_round(n, header, counters)

    def close(self) -> None:
        """Node 0: tell the followers to return from :meth:`follow`."""
        if self.rank == 0:
            self._store.set(f"round/{self._round + 1}", json.dumps({"stop": True}))
            self._fetch_pool.shutdown(wait=False, cancel_futures=True)

    def _gather_ready(self, n: int) -> tuple[int, ...]:
        """Last round's members and nodes that joined since, those that say they are ready
        within the timeout; and any other node that already has."""
        expected = set(self._members or range(self.world))  # the first round waits for every node
        joined = [r for r in range(1, self.world) if r not in expected and self._store.check([f"joined/{r}"])]
        for r in joined:  # waited for once: one that died since is not waited for again
            self._store.delete_key(f"joined/{r}")
        wanted = [f"ready/{n}/{r}" for r in sorted(expected.union(joined)) if r != 0]
        deadline = time.monotonic() + self.timeout
        while wanted and not self._store.check(wanted) and time.monotonic() < deadline:
            time.sleep(0.005)
        ready = [0]
        for r in range(1, self.world):
            key = f"ready/{n}/{r}"
            if self._store.check([key]):
                ready.append(r)
                if self._store.get(key) != b"ok":
                    self._rebuild = True  # its group broke last round
        return tuple(ready)

    def _objects_for(self, sub: Any, target: int) -> list[tuple[str, int]]:
        """The objects a node at node 0's version reads to stage ``target``, in the order it reads
        them: the manifests of the path, then the packs by first use."""
        plan, chain = sub.plan(target, self.engine.version)
        out: dict[str, int] = {}
        self._retained_raw.clear()
        for info in chain.infos:
            if info.version == plan.base:
                continue  # the nodes at node 0's version hold it already
            key = squash_key(info.parent or 0, info.version) if chain.is_squash(info) else manifest_key(info.version)
            raw = self.cache.retained(key)
            if raw is None:
                raw = self.cache.inner.get(key, max_bytes=MAX_MANIFEST_BYTES)
                self.cache.add_upstream(len(raw))
            out[key] = len(raw)
            self._retained_raw[key] = raw
        info = sub.repo.manifest(target)
        for t in info.pb.tensors:
            key = key_of(t)
            for idx in range(len(t.chunks)):
                for step, c in reversed(chain.steps(key, idx, plan.base)[0]):
                    if c.encoding != SAME:
                        pack = step.pb.packs[c.pack]
                        out.setdefault(pack.key, int(pack.size))
        return list(out.items())

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
        import torch.distributed as dist

        if self.rank == 0:
            raise UsageError("node 0 drives the group: call update()")
        done = 0
        while (stop is None or not stop()) and (rounds is None or done < rounds):
            done += 1
            n = self._round + 1
            try:
                # Rounds that went on while this node was busy (node 0 keeps only the last two):
                # take the newest one, as a member if it has not started, else catching up.
                n = max(n, int(self._store.get("next")) - 1)
                self._store.set(f"ready/{n}/{self.rank}", "rebuild" if self._rebuild else "ok")
                # Waiting is event driven (node 0's close is a round too); with ``stop`` it is
                # asked twice a second.
                wait = timedelta(seconds=0.5) if stop is not None else timedelta(hours=24)
                while True:
                    try:
                        self._store.wait([f"round/{n}"], wait)
                        break
                    except dist.DistStoreError:
                        if stop is not None and stop():
                            return
                header = json.loads(self._store.get(f"round/{n}"))
            except dist.DistError as e:
                raise GroupError(f"packcast node {self.rank}: node 0's store is gone ({e})") from None
            if header.get("stop"):
                return
            self._round = n
            try:
                if self.rank in header["members"]:
                    self._run_round(n, header)
                else:
                    self._catch_up(n, int(header["version"]))
            except (DeltasyncError, OSError) as e:  # the engine serves what it held; the next round retries
                log.warning("packcast node %d: version %s did not reach the engine: %s", self.rank, header["version"], e)
                self.reports.append(RoundReport(n, int(header["version"]), tuple(header["members"]), None, 0, 0, None,
                                                False, time.time(), f"{type(e).__name__}: {e}"))

    def _catch_up(self, n: int, version: int) -> None:
        before = self.cache.upstream_bytes
        record = self.engine.update(version)
        self.reports.append(RoundReport(n, version, (), record, 0, self.cache.upstream_bytes - before, None, False, time.time()))

    # -- every member --------------------------------------------------------------------------------

    def _group(self, epoch: int, members: tuple[int, ...]) -> Any:
        import torch.distributed as dist

        if self._pg is not None and epoch == self._epoch and members == self._members:
            return self._pg
        self._pg = None
        store = dist.PrefixStore(f"epoch/{epoch}", self._store)  # type: ignore[attr-defined]
        idx, size = members.index(self.rank), len(members)
        pg: Any
        if self.backend == "nccl":
            pg = dist.ProcessGroupNCCL(store, idx, size, dist.ProcessGroupNCCL.Options())
        else:
            pg = dist.ProcessGroupGloo(store, idx, size, timedelta(seconds=self.timeout))
        self._pg, self._epoch, self._members, self._rebuild = pg, epoch, members, False
        return pg

    def _run_round(self, n: int, header: dict[str, Any], counters: tuple[int, int] | None = None) -> RoundReport:
        version, members = int(header["version"]), tuple(header["members"])
        objects = [(str(k), int(size)) for k, size in header["objects"]]
        self._round = n
        received0, upstream0 = counters or (self.cache.received_bytes, self.cache.upstream_bytes)
        self.cache.expect(k for k, _ in objects)
        errors: list[str] = []
        mover = threading.Thread(target=self._move, args=(int(header["epoch"]), members, objects, errors),
                                 name="deltasync-packcast", daemon=True)
        mover.start()
        repaired = False
        try:
            try:
                record = self.engine.update(version)
            except (CorruptObjectError, ChecksumMismatchError) as e:
                log.warning("packcast: version %d from the bytes received did not verify (%s); reading it from the relay",
                            version, e)
                mover.join()
                self.cache.forget()
                repaired = True
                record = self.engine.update(version)
        finally:
            mover.join()
            self.cache.forget()
        if errors:
            self._rebuild = True
            self._pg = None
        report = RoundReport(
            n, version, members, record, self.cache.received_bytes - received0, self.cache.upstream_bytes - upstream0,
            errors[0] if errors else None, repaired, time.time(),
        )
        self.reports.append(report)
        return report

    def _move(self, epoch: int, members: tuple[int, ...], objects: list[tuple[str, int]], errors: list[str]) -> None:
        """Send (node 0) or receive the round's objects, back to back in pieces, handing each to
        the cache as it completes. Any failure ends the broadcast here: the rest comes from the relay."""
        import torch

        try:
            pg = self._group(epoch, members)
            total = sum(size for _, size in objects)
            if total:
                piece = torch.empty(min(self.piece_bytes, total), dtype=torch.uint8)
                (self._send if self.rank == 0 else self._receive)(pg, piece, objects, total)
        except Exception as e:  # a dead or hung peer, or a group that could not be built
            errors.append(f"{type(e).__name__}: {e}")
            log.warning("packcast node %d: the broadcast stopped (%s); reading the rest from the relay", self.rank, e)
        finally:
            self.cache.give_up()

    def _send(self, pg: Any, piece: Any, objects: list[tuple[str, int]], total: int) -> None:
        view = piece.numpy()
        step = len(view)
        parts = [(key, size, off, min(step, size - off)) for key, size in objects for off in range(0, size, step)]
        whole: dict[str, bytearray] = {}
        filled = 0
        window: deque[Future[bytes]] = deque()
        ahead = 2 * self._fetchers
        todo = iter(parts)
        for key, size, off, n in parts:
            # Fetches run ahead (a bounded window) while earlier pieces go out.
            while len(window) < ahead and (nxt := next(todo, None)) is not None:
                window.append(self._fetch_pool.submit(self._fetch, *nxt))
            data = window.popleft().result()
            got = whole.setdefault(key, bytearray())
            got += data
            if off + n == size:
                self.cache.offer(key, bytes(whole.pop(key)))  # this node's own engine starts on it now
            src = np.frombuffer(data, dtype=np.uint8)
            at = 0
            while at < n:
                take = min(step - filled, n - at)
                view[filled : filled + take] = src[at : at + take]
                filled, at = filled + take, at + take
                if filled == step:
                    self._broadcast(pg, piece)
                    filled = 0
        if filled:
            self._broadcast(pg, piece[:filled])

    def _receive(self, pg: Any, piece: Any, objects: list[tuple[str, int]], total: int) -> None:
        view = piece.numpy()
        queue = deque(objects)
        cur = bytearray()
        left = total
        while left:
            length = min(len(view), left)
            self._broadcast(pg, piece[:length])
            at = 0
            while at < length or (queue and queue[0][1] == len(cur)):
                key, size = queue[0]
                take = min(size - len(cur), length - at)
                cur += view[at : at + take].tobytes()
                at += take
                if len(cur) == size:
                    self.cache.offer(key, bytes(cur))
                    cur = bytearray()
                    queue.popleft()
            left -= length

    def _broadcast(self, pg: Any, piece: Any) -> None:
        import torch.distributed as dist

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


__all__ = ["PackCache", "PackcastNode", "RoundReport"]

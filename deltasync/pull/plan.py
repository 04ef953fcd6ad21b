"""Planning a pull: the cheapest path to a version, in stored bytes.

The version graph's edges are the deltas (parent -> version) and the squashes (A -> C, see
:mod:`deltasync.publish.squash`); a path starts at the version held locally (free) or at
any snapshot (its stored bytes). :class:`Planner` finds the path, :class:`Chain` is the
manifests along it with per-chunk lookups (which records rebuild chunk ``idx`` of a tensor),
and :class:`Plan` is what the path costs, as a pull reports it.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import CorruptObjectError, DeltasyncError, StoreError, VersionNotFoundError
from ..format.codec import FULL
from ..format.manifest import ManifestInfo, key_of
from ..repo.repository import Repository
from ..v1 import manifest_pb2 as pb

log = logging.getLogger("deltasync.pull")

@dataclass(frozen=True)
class Plan:
    """The path a pull takes to ``target`` and the stored bytes it reads."""

    target: int
    base: int | None  # local version the path starts from; None: from a snapshot
    versions: tuple[int, ...]  # the path: its start, then the version each step reaches
    fetch_bytes: int  # stored bytes the chunks of this plan reference
    squashes: tuple[tuple[int, int], ...] = ()  # the steps (a, c) that are squashes


class Chain:
    """Manifests of one path to the target, each a delta against the one before it (the
    first is the start), with per-version tensor lookups."""

    def __init__(self, infos: list[ManifestInfo], squashes: Iterable[ManifestInfo] = ()) -> None:
        self.infos = infos
        self.by_version = {i.version: i for i in infos}
        self.tensors = {i.version: i.entries() for i in infos}
        self._squashes = {id(i) for i in squashes}

    def is_squash(self, info: ManifestInfo) -> bool:
        return id(info) in self._squashes

    def squash_edges(self) -> tuple[tuple[int, int], ...]:
        return tuple((i.parent or 0, i.version) for i in self.infos if self.is_squash(i))

    def steps(self, name: str, idx: int, stop_at: int | None) -> tuple[list[tuple[ManifestInfo, pb.Chunk]], bool]:
        """Records needed for chunk ``idx`` of entry ``name``, newest first; True if they end at ``stop_at``."""
        out: list[tuple[ManifestInfo, pb.Chunk]] = []
        for info in reversed(self.infos):
            if info.version == stop_at:
                return out, True
            t = self.tensors[info.version].get(name)
            if t is None or idx >= len(t.chunks):
                break
            c = t.chunks[idx]
            out.append((info, c))
            if c.encoding == FULL:
                return out, False
        raise CorruptObjectError(
            f"version {self.infos[-1].version}", f"tensor {name!r} chunk {idx} has no full copy in its chain"
        )

    def cost(self, stop_at: int | None, want: Want | None) -> int:
        target = self.infos[-1]
        total = 0
        for t in target.pb.tensors:
            key = key_of(t)
            for idx in wanted(want, key, len(t.chunks)):
                steps, _ = self.steps(key, idx, stop_at)
                total += sum(c.length for _, c in steps)
        return total

    def plan(self, base: int | None, want: Want | None) -> Plan:
        target = self.infos[-1].version
        return Plan(target, base, tuple(self.by_version), self.cost(base, want), self.squash_edges())


#: Chunks to materialise: entry key -> chunk indices (None: every chunk of every entry).
Want = dict[str, list[int]]


def wanted(want: Want | None, key: str, n_chunks: int) -> Iterable[int]:
    if want is None:
        return range(n_chunks)
    return want.get(key, ())


class Planner:
    """Plans pulls from one repository; remembers squashes found unusable (warned about once)."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.bad_squashes: set[tuple[int, int]] = set()  # unreadable or untrusted

    def plan(
        self, target: int, local: int | None, want: Want | None = None, *, squashes: bool = True
    ) -> tuple[Plan, Chain]:
        """The cheapest way to ``target`` in stored bytes, from ``local`` or from a snapshot.

        Candidates: the nearest snapshot and its chain, the chain of deltas from ``local``,
        and (with ``squashes``) the cheapest path through the graph of deltas and squashes.
        Ties go to a path from ``local``, then to the shorter path.
        """
        snap = Chain(self.repo.chain(target))
        options = [(snap, snap.plan(None, want))]
        if local is not None and local <= target:
            with contextlib.suppress(DeltasyncError):
                inc = self.repo.chain(target, stop_at=local)
                if inc[0].version == local:
                    inc_chain = Chain(inc)
                    options.append((inc_chain, inc_chain.plan(local, want)))
        if squashes:
            found = self.graph_path(target, local, want, bound=min(o[1].fetch_bytes for o in options))
            if found is not None and found.squash_edges():
                base = local if found.infos[0].version == local else None
                options.append((found, found.plan(base, want)))
        chain, plan = min(options, key=lambda o: (o[1].fetch_bytes, o[1].base is None, len(o[1].versions)))
        return plan, chain

    def graph_path(self, target: int, local: int | None, want: Want | None, *, bound: int) -> Chain | None:
        """Dijkstra, backwards from ``target``, over versions and the edges into them: a
        delta from its parent, a squash from its first version. A path starts at ``local``
        (free) or at a snapshot (its bytes). An edge costs the bytes of the wanted chunks it
        stores (an upper bound of what a path reads: a full chunk makes older steps moot);
        the candidates are then compared exactly. Only paths cheaper than ``bound`` are
        explored, so a repository without squashes costs one listing.
        """
        into: dict[int, list[int]] = {}
        try:
            listed = self.repo.squashes()
        except StoreError as e:  # squashes only shorten a path: the chain alone is enough
            log.debug("squashes of %s not listed (%s): planning without them", self.repo.url, e)
            return None
        for a, c in listed:
            if c <= target:
                into.setdefault(c, []).append(a)
        if not into:
            return None
        wanted: dict[str, list[int] | None] = (
            dict(want) if want is not None else dict.fromkeys(self.repo.manifest(target).entries())
        )

        def cost(info: ManifestInfo) -> int:
            entries = info.entries()
            total = 0
            for key, idxs in wanted.items():
                t = entries.get(key)
                if t is None:
                    continue
                if idxs is None:
                    total += sum(c.length for c in t.chunks)
                else:
                    total += sum(t.chunks[i].length for i in idxs if i < len(t.chunks))
            return total

        # dist[v]: (bytes, steps) from v to the target; via[v]: the edge leaving v on that path.
        dist: dict[int, tuple[int, int]] = {target: (0, 0)}
        via: dict[int, tuple[ManifestInfo, int]] = {}
        squash_infos: list[ManifestInfo] = []
        best: tuple[int, int, int] | None = None  # (bytes, 0 local / 1 snapshot, start)
        heap = [(0, 0, target)]
        while heap:
            d, h, v = heapq.heappop(heap)
            if (d, h) > dist[v]:
                continue
            if d > (best[0] if best is not None else bound):
                break
            try:
                info = self.repo.manifest(v)
            except DeltasyncError:
                continue  # not (or no longer) a committed version: no path through it
            if v == local:
                best = min(best or (d, 0, v), (d, 0, v))
                continue  # nothing is cheaper than starting here
            edges: list[tuple[int, ManifestInfo]] = []
            if info.is_snapshot:
                start = (d + cost(info), 1, v)
                best = min(best or start, start)
            elif info.parent is not None:
                edges.append((info.parent, info))
            for a in into.get(v, ()):
                if (a, v) in self.bad_squashes:
                    continue
                try:
                    sq = self.repo.squash(a, v)
                except VersionNotFoundError:
                    continue  # version a is gone (gc deletes the squash next)
                except DeltasyncError as e:
                    self.bad_squashes.add((a, v))
                    log.warning("ignoring squash %d->%d: %s", a, v, e)
                    continue
                squash_infos.append(sq)
                edges.append((a, sq))
            for u, edge in edges:
                du = (d + cost(edge), h + 1)
                if u not in dist or du < dist[u]:
                    dist[u] = du
                    via[u] = (edge, v)
                    heapq.heappush(heap, (*du, u))
        if best is None:
            return None
        v = best[2]
        infos = [self.repo.manifest(v)]  # cached: loaded above
        while v != target:
            edge, v = via[v]
            infos.append(edge)
        return Chain(infos, squash_infos)

"""The subscriber: brings a local copy (a directory, or tensors in memory) to a version.

Planning finds the cheapest path by stored bytes through the version graph: its edges are
the deltas (parent -> version) and the squashes (A -> C, see squash.py); a path starts at
the version held locally (free) or at any snapshot (its stored bytes). Applying is per
chunk and idempotent (DESIGN.md invariant 3): target digest already present → keep; base
digest present → apply the path; otherwise → rebuild the chunk from the snapshot. Every
step is verified against its digest, and a directory only changes once every file is
complete and verified. A squash is redundant data: a chunk it fails to rebuild is rebuilt
from plain deltas instead (with a warning), so damage to a squash never fails a pull.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from . import dtypes
from .codec import FULL, SAME, EncodedChunk
from .digest import StreamDigest, digest
from .errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    DeltasyncError,
    ObjectNotFoundError,
    UsageError,
    VersionNotFoundError,
)
from .fetch import PackFetcher
from .localstate import install_staged as install_staged
from .localstate import read_local_state as read_local_state  # re-exported: the publisher's cache, tests
from .localstate import write_local_state as write_local_state
from .manifest import ManifestInfo, key_of
from .placement import Placement as Placement  # re-exported: placement.py holds them now
from .placement import file_digest as file_digest
from .placement import logical_shape
from .placement import placements as placements
from .placement import read_placed as read_placed
from .placement import version_files as version_files
from .placement import write_placed as write_placed
from .progress import Progress
from .repository import Repository, open_repository
from .signing import PublicKeyLike
from .slices import Region, byte_span, check_region, copy_region, intersect
from .storage import Store
from .tensors import bits_to_tensor
from .v1 import manifest_pb2 as pb

if TYPE_CHECKING:
    import torch

    from .slotfill import FillResult

Bits = npt.NDArray[np.uint8]
log = logging.getLogger(__name__)


def state_url(url: str) -> str:
    """A repository URL as recorded in a copy's state: plain paths made absolute."""
    return url if "://" in url or not url else os.path.abspath(url)


# -- planning -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    target: int
    base: int | None  # local version the path starts from; None: from a snapshot
    versions: tuple[int, ...]  # the path: its start, then the version each step reaches
    fetch_bytes: int  # stored bytes the chunks of this plan reference
    squashes: tuple[tuple[int, int], ...] = ()  # the steps (a, c) that are squashes


class _Chain:
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
            for idx in _wanted(want, key, len(t.chunks)):
                steps, _ = self.steps(key, idx, stop_at)
                total += sum(c.length for _, c in steps)
        return total

    def plan(self, base: int | None, want: Want | None) -> Plan:
        target = self.infos[-1].version
        return Plan(target, base, tuple(self.by_version), self.cost(base, want), self.squash_edges())


#: Chunks to materialise: entry key -> chunk indices (None: every chunk of every entry).
Want = dict[str, list[int]]


def _wanted(want: Want | None, key: str, n_chunks: int) -> Iterable[int]:
    if want is None:
        return range(n_chunks)
    return want.get(key, ())


# -- where the local bits come from -------------------------------------------------------------


class _LocalBits:
    """Bits at hand locally, by entry key: of the version held (None: none is), and for a
    directory also the chunks a resumed pull staged (see ``Subscriber._dir_local``)."""

    def __init__(self, version: int | None, read: Callable[[str, int, int], Bits | None]) -> None:
        self.version = version
        self.read = read


class Subscriber:
    """Pulls versions from a repository.

    >>> state = Subscriber("./repo").pull(v)            # dict of tensors, bit-identical
    >>> Subscriber("./repo").pull_to_dir("./serving")    # the latest version, as files
    """

    def __init__(
        self,
        repo: str | Store | Repository,
        *,
        workers: int = 0,
        progress: bool | None = None,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
    ) -> None:
        """``trusted_keys``: ed25519 public keys (or PEM files); versions not signed by one are refused."""
        self.repo = open_repository(repo, trusted_keys=trusted_keys)
        self.workers = workers or os.cpu_count() or 1
        self.progress = progress
        self._mem_version: int | None = None
        self._mem_bits: dict[str, Bits] = {}
        self.last_plan: Plan | None = None
        self._bad_squashes: set[tuple[int, int]] = set()  # unreadable or untrusted: warned about once

    # -- planning ----------------------------------------------------------------------------

    def plan(
        self, target: int, local: int | None, want: Want | None = None, *, squashes: bool = True
    ) -> tuple[Plan, _Chain]:
        """The cheapest way to ``target`` in stored bytes, from ``local`` or from a snapshot.

        Candidates: the nearest snapshot and its chain, the chain of deltas from ``local``,
        and (with ``squashes``) the cheapest path through the graph of deltas and squashes.
        Ties go to a path from ``local``, then to the shorter path.
        """
        snap = _Chain(self.repo.chain(target))
        options = [(snap, snap.plan(None, want))]
        if local is not None and local <= target:
            with contextlib.suppress(DeltasyncError):
                inc = self.repo.chain(target, stop_at=local)
                if inc[0].version == local:
                    inc_chain = _Chain(inc)
                    options.append((inc_chain, inc_chain.plan(local, want)))
        if squashes:
            found = self._graph_path(target, local, want, bound=min(o[1].fetch_bytes for o in options))
            if found is not None and found.squash_edges():
                base = local if found.infos[0].version == local else None
                options.append((found, found.plan(base, want)))
        chain, plan = min(options, key=lambda o: (o[1].fetch_bytes, o[1].base is None, len(o[1].versions)))
        return plan, chain

    def _graph_path(self, target: int, local: int | None, want: Want | None, *, bound: int) -> _Chain | None:
        """Dijkstra, backwards from ``target``, over versions and the edges into them: a
        delta from its parent, a squash from its first version. A path starts at ``local``
        (free) or at a snapshot (its bytes). An edge costs the bytes of the wanted chunks it
        stores (an upper bound of what a path reads: a full chunk makes older steps moot);
        the candidates are then compared exactly. Only paths cheaper than ``bound`` are
        explored, so a repository without squashes costs one listing.
        """
        into: dict[int, list[int]] = {}
        for a, c in self.repo.squashes():
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
                if (a, v) in self._bad_squashes:
                    continue
                try:
                    sq = self.repo.squash(a, v)
                except VersionNotFoundError:
                    continue  # version a is gone (gc deletes the squash next)
                except DeltasyncError as e:
                    self._bad_squashes.add((a, v))
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
        return _Chain(infos, squash_infos)

    # -- library -----------------------------------------------------------------------------

    def pull(
        self,
        version: int | None = None,
        *,
        tensors: Iterable[str] | None = None,
        regions: Mapping[str, Region] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Tensors of ``version`` (default: latest), bit-identical to what was published.

        By default every tensor; ``tensors`` pulls only those names and ``regions`` only a
        hyper-rectangle of a tensor (what one tensor-parallel inference rank holds), each
        fetching just the chunks that hold those bytes. Tensors published as slices by
        several ranks come back whole (parts no rank published read as zeros).
        """
        target = self.repo.resolve(version)
        info = self.repo.manifest(target)
        local: _LocalBits | None = None
        if self._mem_version is not None:
            bits = self._mem_bits

            def read_mem(key: str, off: int, length: int) -> Bits | None:
                arr = bits.get(key)
                return arr[off : off + length] if arr is not None and off + length <= arr.nbytes else None

            local = _LocalBits(self._mem_version, read_mem)
        want, requests = _select(info, tensors, regions)
        entries = info.entries()
        # np.empty commits no memory until touched: a partial pull costs only what it fills.
        out = {key: np.empty(entries[key].nbytes, dtype=np.uint8) for key in (want or entries)}
        # Workers write straight into the output arrays: first touches of fresh memory then
        # happen in parallel, not one chunk at a time on the consuming thread.
        self._run(info, local, lambda t, off, data: None, dest=out, want=want)
        self._mem_version, self._mem_bits = target, out
        # The tensors share memory with the base of the next pull. That is safe: a caller who
        # changes them only costs that pull a repair, since every base chunk is digest-checked.
        return {name: _assemble(req, out) for name, req in requests.items()}

    # -- directories -------------------------------------------------------------------------

    def pull_to_dir(
        self,
        out: str | os.PathLike[str],
        version: int | None = None,
        *,
        stop: Callable[[], bool] | None = None,
        move_aside: bool = False,
        fsync: bool = False,
    ) -> int:
        """Bring directory ``out`` to ``version`` (default: latest); returns the version.

        See :meth:`update_dir`, which also says what the update took."""
        return self.update_dir(out, version, stop=stop, move_aside=move_aside, fsync=fsync).version

    def update_dir(
        self,
        out: str | os.PathLike[str],
        version: int | None = None,
        *,
        stop: Callable[[], bool] | None = None,
        move_aside: bool = False,
        fsync: bool = False,
    ) -> FillResult:
        """Bring directory ``out`` to ``version`` (default: latest), in O(changed bytes).

        ``out`` keeps two slots of files (slots.py): the one not served is brought to the
        target in place (slotfill.py), every chunk written is verified, and one atomic
        switch serves it; on any error ``out`` keeps serving what it served. A fill that
        stops (an error, a kill, ``stop``) is resumed by the next pull, to any version.
        ``stop`` is asked between chunks; once it returns True the pull raises PullStopped.
        Files in ``out`` that are not the repository's are refused (UsageError naming them)
        or, with ``move_aside``, moved into ``out/.deltasync/aside/``. ``fsync`` flushes the
        slot to disk before the switch (else a copy is checked after a power loss). Another
        process changing ``out`` meanwhile gets CopyInUseError.
        """
        from .slotfill import update_copy

        target = self.repo.resolve(version)
        info = self.repo.manifest(target)
        root = Path(out)
        root.mkdir(parents=True, exist_ok=True)
        return update_copy(self, root, info, stop=stop, move_aside=move_aside, fsync=fsync, repo_url=state_url(self.repo.url))

    def _write_blob(self, f: pb.File, path: Path) -> None:
        """Download non-tensor file ``f`` to ``path``, checked against its digest."""
        d = StreamDigest()
        with open(path, "wb") as fh:
            for part in f.blob_parts:
                data = self.repo.get_blob(part)
                d.update(data)
                fh.write(data)
        if d.digest() != f.digest:
            raise CorruptObjectError(f"file {f.path}", "rebuilt bytes do not match the manifest digest")

    def check(self, version: int) -> None:
        """Rebuild ``version`` chunk by chunk from its snapshot, verifying every step; output discarded."""
        self._run(self.repo.manifest(version), None, lambda t, off, data: None, squashes=False)

    # -- the shared chunk pipeline -----------------------------------------------------------

    def _run(
        self,
        info: ManifestInfo,
        local: _LocalBits | None,
        sink: Callable[[pb.Tensor, int, Bits], None],
        *,
        dest: dict[str, Bits] | None = None,
        want: Want | None = None,
        squashes: bool = True,
    ) -> Plan:
        """Materialise the chunks of ``info`` (all, or those in ``want``) in order: into
        ``dest`` arrays by entry key (written by the workers), and through ``sink`` (called in
        order on this thread). Without ``squashes`` only the stored chains are read."""
        local_version = local.version if local is not None else None
        plan, chain = self.plan(info.version, local_version, want, squashes=squashes)
        self.last_plan = plan
        snapshot_chain: list[_Chain] = [chain] if plan.base is None and not plan.squashes else []
        plain_chain: list[_Chain | None] = []  # deltas only, from the local version: after a squash fails
        broken: set[tuple[int, int]] = set()
        lock = threading.Lock()

        def full_chain() -> _Chain:
            with lock:
                if not snapshot_chain:
                    snapshot_chain.append(_Chain(self.repo.chain(info.version)))
                return snapshot_chain[0]

        def plain_from_local() -> _Chain | None:
            with lock:
                if not plain_chain:
                    found = None
                    if local_version is not None and local_version <= info.version:
                        with contextlib.suppress(DeltasyncError):
                            inc = self.repo.chain(info.version, stop_at=local_version)
                            found = _Chain(inc) if inc[0].version == local_version else None
                    plain_chain.append(found)
                return plain_chain[0]

        Route = tuple[Bits | None, list[tuple[ManifestInfo, pb.Chunk]]]

        def route(via: _Chain | None, start: int | None, key: str, idx: int, held: Bits | None, held_digest: bytes) -> Route:
            """Base bits and steps for one chunk along ``via``; from the snapshot chain when
            the path needs local bits that do not match (repair)."""
            if via is not None:
                steps, at_start = via.steps(key, idx, start)
                if not at_start:
                    return None, steps  # the path stores this chunk in full
                if held is not None and steps and steps[-1][1].base_digest == held_digest:
                    return held, steps
            return None, full_chain().steps(key, idx, None)[0]

        progress = Progress(f"pull v{info.version}", info.pb.raw_bytes, enabled=self.progress)
        codec = info.codec
        fetcher = PackFetcher(self.repo.store)
        for t in info.pb.tensors:
            key = key_of(t)
            for idx in _wanted(want, key, len(t.chunks)):
                for step_info, c in chain.steps(key, idx, plan.base)[0]:
                    if c.encoding != SAME:
                        fetcher.expect(step_info.pb.packs[c.pack].key, step_info.pb.packs[c.pack].size, c.length)
        # I/O threads may outnumber cores (remote stores want many requests in flight); the
        # semaphore keeps decoding to one thread per worker.
        cpu = threading.Semaphore(self.workers)
        threads = max(self.workers, self.repo.store.io_concurrency)

        def job(t: pb.Tensor, idx: int, off: int, length: int) -> Bits:
            bits = materialise(t, idx, off, length)
            if dest is not None:
                dest[key_of(t)][off : off + length] = bits
            return bits

        def materialise(t: pb.Tensor, idx: int, off: int, length: int) -> Bits:
            width = dtypes.element_width(t.dtype)
            key = key_of(t)
            held = local.read(key, off, length) if local is not None else None
            held_digest = digest(held) if held is not None else b""
            if held is not None and held_digest == t.chunks[idx].target_digest:
                return held  # already there (idempotent, resumable)
            base, steps = route(chain, plan.base, key, idx, held, held_digest)
            try:
                return self._apply(t, idx, length, width, base, steps, fetcher, cpu)
            except (CorruptObjectError, ChecksumMismatchError) as e:
                used = {(s.parent or 0, s.version) for s, _ in steps if chain.is_squash(s)}
                if not used:
                    raise
                with lock:
                    new = used - broken
                    broken.update(used)
                for a, c in sorted(new):
                    log.warning("squash %d->%d is unusable (%s); rebuilding its chunks from plain deltas", a, c, e)
            base, steps = route(plain_from_local(), local_version, key, idx, held, held_digest)
            return self._apply(t, idx, length, width, base, steps, fetcher, cpu)

        def jobs() -> Iterator[tuple[pb.Tensor, int, Callable[[], Bits]]]:
            for t in info.pb.tensors:
                width = dtypes.element_width(t.dtype)
                ranges = codec.chunk_ranges(t.nbytes, width)
                for idx in _wanted(want, key_of(t), len(ranges)):
                    off, length = ranges[idx]
                    yield t, off, _bind(job, t, idx, off, length)

        window: deque[tuple[pb.Tensor, int, Future[Bits]]] = deque()

        def drain_one() -> None:  # results reach the sink in chunk order
            wt, woff, fut = window.popleft()
            data = fut.result()
            sink(wt, woff, data)
            progress.advance(len(data))
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="deltasync-pull") as pool:
            try:
                for t, off, fn in jobs():
                    window.append((t, off, pool.submit(fn)))
                    if len(window) >= 2 * threads:
                        drain_one()
                while window:
                    drain_one()
            except BaseException:
                for _, _, fut in window:
                    fut.cancel()
                raise
        progress.finish()
        return plan

    def _apply(
        self,
        t: pb.Tensor,
        idx: int,
        length: int,
        width: int,
        base: Bits | None,
        steps: list[tuple[ManifestInfo, pb.Chunk]],
        fetcher: PackFetcher,
        cpu: threading.Semaphore,
    ) -> Bits:
        payloads: list[bytes] = []
        for info, c in reversed(steps):  # oldest first; all I/O before taking a CPU slot
            if c.encoding == SAME:
                payloads.append(b"")
                continue
            pack = info.pb.packs[c.pack]
            try:
                payloads.append(fetcher.get(pack.key, c.offset, c.length))
            except CorruptObjectError as e:
                raise CorruptObjectError(_where(info, t, idx, pack.key), e.detail) from None
            except ObjectNotFoundError:
                # A committed version names this pack: its absence is damage, as verify reports it.
                raise CorruptObjectError(_where(info, t, idx, pack.key), "pack is missing") from None
        with cpu:
            return self._decode_steps(t, idx, length, width, base, steps, payloads)

    def _decode_steps(
        self,
        t: pb.Tensor,
        idx: int,
        length: int,
        width: int,
        base: Bits | None,
        steps: list[tuple[ManifestInfo, pb.Chunk]],
        payloads: list[bytes],
    ) -> Bits:
        bits = base
        for (info, c), payload in zip(reversed(steps), payloads, strict=True):
            if c.encoding == SAME:
                continue  # bits are unchanged; the digest below still checks the final result
            try:
                bits = info.codec.decode(EncodedChunk(c.encoding, payload), bits, width, length)
            except CorruptObjectError as e:
                raise CorruptObjectError(_where(info, t, idx, info.pb.packs[c.pack].key), e.detail) from None
            actual = digest(bits)
            if actual != c.target_digest:
                raise ChecksumMismatchError(
                    version=info.version, tensor=t.name, chunk=idx,
                    expected=c.target_digest.hex(), actual=actual.hex(),
                )
        if bits is None:  # pragma: no cover - a chain always starts with a full chunk or local bits
            raise CorruptObjectError(f"tensor {t.name!r}", f"chunk {idx} has nothing to start from")
        final = t.chunks[idx].target_digest
        if steps and steps[0][1].encoding == SAME and digest(bits) != final:
            raise ChecksumMismatchError(
                version=steps[0][0].version, tensor=t.name, chunk=idx, expected=final.hex(), actual=digest(bits).hex()
            )
        return bits


def _where(info: ManifestInfo, t: pb.Tensor, idx: int, pack_key: str) -> str:
    return f"version {info.version}, tensor {t.name!r}, chunk {idx} (pack {pack_key})"


def _bind(fn: Callable[[pb.Tensor, int, int, int], Bits], t: pb.Tensor, idx: int, off: int, length: int) -> Callable[[], Bits]:
    return lambda: fn(t, idx, off, length)


@dataclass
class _Request:
    """One tensor the caller asked for: the whole logical tensor, or a region of it."""

    dtype: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    parts: list[pb.Tensor]  # manifest entries that may hold some of it




def _select(
    info: ManifestInfo, tensors: Iterable[str] | None, regions: Mapping[str, Region] | None
) -> tuple[Want | None, dict[str, _Request]]:
    groups: dict[str, list[pb.Tensor]] = {}
    for t in info.pb.tensors:
        groups.setdefault(t.name, []).append(t)

    def parts_of(name: str) -> list[pb.Tensor]:
        parts = groups.get(name)
        if parts is None:
            raise UsageError(f"version {info.version} has no tensor {name!r}")
        return parts

    requests: dict[str, _Request] = {}
    if tensors is None and regions is None:
        for name, parts in groups.items():
            shape = logical_shape(parts[0])
            requests[name] = _Request(parts[0].dtype, (0,) * len(shape), shape, parts)
        return None, requests
    want: dict[str, set[int]] = {}
    for name in tensors or ():
        parts = parts_of(name)
        shape = logical_shape(parts[0])
        requests[name] = _Request(parts[0].dtype, (0,) * len(shape), shape, parts)
        for t in parts:
            want.setdefault(key_of(t), set()).update(range(len(t.chunks)))
    for name, region in (regions or {}).items():
        if name in requests:
            raise UsageError(f"tensor {name!r} is asked for both whole and as a region")
        parts = parts_of(name)
        offsets, shape = tuple(region.offsets), tuple(region.shape)
        check_region(logical_shape(parts[0]), offsets, shape)
        requests[name] = _Request(parts[0].dtype, offsets, shape, parts)
        itemsize = dtypes.itemsize(parts[0].dtype)
        for t in parts:
            e_off = tuple(t.slice_offsets) or (0,) * len(t.shape)
            inter = intersect(e_off, tuple(t.shape), offsets, shape)
            if inter is None or not t.chunks:
                continue
            start, end = byte_span(e_off, tuple(t.shape), inter[0], inter[1], itemsize)
            step = info.codec.chunk_step(dtypes.element_width(t.dtype))
            want.setdefault(key_of(t), set()).update(range(start // step, (end - 1) // step + 1))
    return {key: sorted(idx) for key, idx in want.items()}, requests


def _assemble(req: _Request, out: dict[str, Bits]) -> torch.Tensor:
    only = req.parts[0]
    if len(req.parts) == 1 and not only.full_shape and req.shape == tuple(only.shape):
        return bits_to_tensor(out[key_of(only)], req.dtype, req.shape)  # the entry itself, no copy
    itemsize = dtypes.itemsize(req.dtype)
    buf = np.zeros(math.prod(req.shape) * itemsize, dtype=np.uint8)
    for t in req.parts:
        e_off = tuple(t.slice_offsets) or (0,) * len(t.shape)
        inter = intersect(e_off, tuple(t.shape), req.offsets, req.shape)
        if inter is not None:
            copy_region(out[key_of(t)], e_off, tuple(t.shape), buf, req.offsets, req.shape, inter[0], inter[1], itemsize)
    return bits_to_tensor(buf, req.dtype, req.shape)

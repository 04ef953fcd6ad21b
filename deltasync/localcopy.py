"""Checking, repairing and moving a directory copy without a full pull.

``check_copy`` re-hashes every chunk of a copy against the manifest of the version it holds
(recorded in the copy: it works offline) and names what drifted (file, tensor, chunk). With
``repair`` it fetches only those chunks, rebuilt from the nearest snapshot and verified, and
writes them in place: a file is never copied for a repair, so repairing one chunk of a 5 GB
shard writes one chunk. At every moment each chunk of a file is either its old (drifted)
bytes or its verified repaired bytes, and a repair killed midway is finished by running it
again. (Readers mapping the file see repaired chunks appear; they were reading wrong bits.)

``move_copy`` brings a copy to another version by walking the delta chain between them from
the local bits, chunk by chunk: backwards with :func:`deltasync.codec.decode_reverse` (same,
sparse and dense chunks are reversible), forwards with ``decode``; every step is checked
against its digest. Payloads come from the copy's object cache (localcache.py) when it kept
them, so rolling back a few versions downloads nothing; a chunk that cannot be walked (a
full chunk on the way, damaged local bits, a resized tensor) is fetched from the snapshot
chain. The result is staged, verified file by file and installed like any pull.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from . import dtypes
from .checkpoint import FileReader
from .codec import FULL, SAME, EncodedChunk, decode_reverse
from .digest import digest
from .errors import ChecksumMismatchError, DeltasyncError, UsageError
from .localcache import CachedStore
from .localstate import PullStopped, StateDB, copy_lock, finish_install, install_staged
from .manifest import ManifestInfo, key_of
from .repository import Repository
from .signing import PublicKeyLike
from .subscriber import (
    Placement,
    StagedFiles,
    Subscriber,
    Want,
    begin_staging,
    file_digest,
    held_manifest,
    placements,
    read_placed,
    version_files,
    write_placed,
)
from .v1 import manifest_pb2 as pb

Bits = npt.NDArray[np.uint8]
T = TypeVar("T")
R = TypeVar("R")


# -- check and repair ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Drift:
    """One part of a copy that differs from its manifest: a chunk, or a whole-file matter."""

    file: str
    tensor: str  # "" for a file-level problem (missing, size, header, non-tensor file)
    chunk: int  # -1 for a file-level problem
    detail: str
    entry: str = ""  # the manifest entry's key (differs from the tensor name for slices)

    def __str__(self) -> str:
        where = f"{self.file}: tensor {self.tensor!r} chunk {self.chunk}" if self.tensor else self.file
        return f"{where}: {self.detail}"


@dataclass
class CheckReport:
    version: int
    files: int = 0
    chunks: int = 0
    drifted: list[Drift] = field(default_factory=list)
    repaired: bool = False
    fetched_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.drifted or self.repaired


def check_copy(
    out: str | os.PathLike[str],
    *,
    repo: str | Repository | None = None,
    repair: bool = False,
    workers: int = 0,
    trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
) -> CheckReport:
    """Compare the copy at ``out`` with the manifest of the version it holds; with
    ``repair``, fetch exactly the drifted chunks (and non-tensor files) and fix them in place.

    ``repo`` defaults to the repository the copy was pulled from (needed only to repair, or
    when the copy predates the recorded manifest)."""
    root = Path(out)
    db = StateDB.open(root, create=False)
    state = db.state() if db is not None else None
    if db is None or state is None:
        raise UsageError(f"{root} holds no deltasync copy (pull or subscribe into it first)")
    if not repair:
        info = held_manifest(db, state, _repository(repo, state.repo, trusted_keys, required=False))
        if info is None:
            raise UsageError(f"the manifest of version {state.version} is unknown here; pass the repository")
        return _check(root, info, workers)
    with copy_lock(root):
        finish_install(root)
        state = db.state()
        assert state is not None
        upstream = _repository(repo, state.repo, trusted_keys, required=True)
        assert upstream is not None
        counting = CachedStore(upstream.store)
        repository = Repository(counting)
        repository.trusted_keys = upstream.trusted_keys
        info = repository.manifest(state.version)  # authenticated: repairs follow the repository
        report = _check(root, info, workers)
        if report.drifted:
            _repair(Subscriber(repository, workers=workers, progress=False), root, info, report.drifted)
            again = _check(root, info, workers)
            if again.drifted:
                d = again.drifted[0]
                raise ChecksumMismatchError(
                    version=info.version, tensor=d.tensor or f"<file {d.file}>", chunk=d.chunk,
                    expected="the manifest's digest", actual=f"still different after repair ({d.detail})",
                )
            report.repaired = True
        report.fetched_bytes = counting.fetched_bytes
        return report


def _repository(
    repo: str | Repository | None,
    recorded: str,
    trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None,
    *,
    required: bool,
) -> Repository | None:
    if isinstance(repo, Repository):
        return repo
    url = repo or recorded
    if not url:
        if required:
            raise UsageError("the copy records no repository; pass one")
        return None
    return Repository(url, trusted_keys=trusted_keys)


def _check(root: Path, info: ManifestInfo, workers: int) -> CheckReport:
    report = CheckReport(info.version)
    places = placements(info)
    by_file: dict[str, list[Placement]] = {}
    for p in places.values():
        by_file.setdefault(p.file, []).append(p)
    items: list[tuple[Placement, int, int, int]] = []
    for f in version_files(info):
        report.files += 1
        path = root / f.path
        if f.kind == pb.File.BLOB:
            if file_digest(path) != f.digest:
                report.drifted.append(Drift(f.path, "", -1, "missing" if not path.is_file() else "content differs"))
            continue
        if path.is_symlink() or not path.is_file():
            report.drifted.append(Drift(f.path, "", -1, "missing"))
        else:
            size = path.stat().st_size
            if size != f.size:
                report.drifted.append(Drift(f.path, "", -1, f"size {size}, expected {f.size}"))
            with open(path, "rb") as fh:
                if fh.read(len(f.header)) != f.header:
                    report.drifted.append(Drift(f.path, "", -1, "safetensors header differs"))
        for p in by_file.get(f.path, []):
            width = dtypes.element_width(p.tensor.dtype)
            for idx, (off, length) in enumerate(info.codec.chunk_ranges(p.tensor.nbytes, width)):
                items.append((p, idx, off, length))
    report.chunks = len(items)

    with FileReader() as reader:

        def drifted(item: tuple[Placement, int, int, int]) -> Drift | None:
            p, idx, off, length = item
            try:
                bits = read_placed(reader, root, p, off, length)
            except DeltasyncError:
                return Drift(p.file, p.tensor.name, idx, "missing (file too short)", key_of(p.tensor))
            if digest(bits) != p.tensor.chunks[idx].target_digest:
                return Drift(p.file, p.tensor.name, idx, "bytes differ from the manifest", key_of(p.tensor))
            return None

        for d in _ordered(items, drifted, workers or os.cpu_count() or 1):
            if d is not None:
                report.drifted.append(d)
    return report


def _repair(sub: Subscriber, root: Path, info: ManifestInfo, drifted: list[Drift]) -> None:
    files = {f.path: f for f in version_files(info)}
    places = placements(info)
    want: Want = {}
    for d in drifted:
        if d.tensor:
            want.setdefault(d.entry, []).append(d.chunk)
    for rel in sorted({d.file for d in drifted if not d.tensor}):
        f = files[rel]
        path = root / rel
        if f.kind == pb.File.BLOB:
            tmp = path.with_name(f".{path.name}.deltasync-repair")
            sub._write_blob(f, tmp)
            os.replace(tmp, path)
            continue
        if path.is_symlink() or not path.is_file():
            with contextlib.suppress(OSError):
                path.unlink()
            path.parent.mkdir(parents=True, exist_ok=True)
            # A missing file: every chunk of it is rebuilt (they were all reported).
        with open(path, "ab"):
            pass
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, f.header, 0)
            os.ftruncate(fd, f.size)
            os.fsync(fd)
        finally:
            os.close(fd)
    if not want:
        return
    fds: dict[str, int] = {}
    try:
        for key in want:
            rel = places[key].file
            if rel not in fds:
                fds[rel] = os.open(root / rel, os.O_RDWR)

        def sink(t: pb.Tensor, off: int, data: Bits) -> None:
            p = places[key_of(t)]
            write_placed(fds[p.file], p, off, data)  # verified bits, in place (see the module doc)

        sub._run(info, None, sink, want={k: sorted(set(v)) for k, v in want.items()})
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


# -- moving between versions --------------------------------------------------------------------


@dataclass
class MoveResult:
    version: int
    walked: int = 0  # chunks rebuilt from the local bits along the chain
    unchanged: int = 0  # chunks the two versions share: copied from the local bits
    kept: int = 0  # chunks already staged by an interrupted move or pull
    fetched: int = 0  # chunks rebuilt from the snapshot chain

    def __str__(self) -> str:
        return (f"local: {self.walked} chunks walked, {self.unchanged} unchanged, "
                f"{self.fetched} fetched, {self.kept} already staged")


def version_path(repo: Repository, held: int, target: int) -> list[ManifestInfo] | None:
    """Manifests from ``held`` to ``target`` along parent links (either direction), or None
    when a snapshot or a missing version lies between them."""
    newer, older = (held, target) if held > target else (target, held)
    path: list[ManifestInfo] = []
    v: int | None = newer
    try:
        while v is not None and v >= older:
            info = repo.manifest(v)
            path.append(info)
            if v == older:
                break
            v = None if info.is_snapshot else info.parent
    except DeltasyncError:
        return None
    if not path or path[-1].version != older:
        return None
    return path if held > target else path[::-1]


class _Walker:
    """Rebuilds chunks of the last version of ``path`` from the local bits of the first."""

    def __init__(self, sub: Subscriber, path: list[ManifestInfo], cached_only: CachedStore | None = None) -> None:
        self.sub = sub
        self.path = path
        self.backward = path[0].version > path[-1].version
        self.entries = [info.entries() for info in path]
        self.cached_only = cached_only

    def steps(self, key: str, idx: int) -> list[tuple[ManifestInfo, pb.Chunk]] | None:
        """The chunk records to apply, in order, or None when this chunk cannot be walked."""
        start = self.entries[0].get(key)
        if start is None or idx >= len(start.chunks):
            return None
        width = dtypes.element_width(start.dtype)
        step = self.path[0].codec.chunk_step(width)
        out: list[tuple[ManifestInfo, pb.Chunk]] = []
        # Backwards, version i's records lead to version i+1 (its parent); forwards, version
        # i+1's records lead to it.
        pairs = range(len(self.path) - 1)
        for i in pairs:
            j = i if self.backward else i + 1
            info, t = self.path[j], self.entries[j].get(key)
            if (
                t is None or t.nbytes != start.nbytes or dtypes.element_width(t.dtype) != width
                or info.codec.chunk_step(width) != step or idx >= len(t.chunks)
            ):
                return None
            c = t.chunks[idx]
            if self.backward and c.encoding == FULL:
                return None
            out.append((info, c))
        return out

    def uncached_bytes(self, steps: list[tuple[ManifestInfo, pb.Chunk]]) -> int:
        """Payload bytes of ``steps`` that walking them would download."""
        cache = self.cached_only.cache if self.cached_only is not None else None
        return sum(
            c.length for info, c in steps
            if c.encoding != SAME and (cache is None or not cache.has(info.pb.packs[c.pack].key, (c.offset, c.length)))
        )

    def walk(self, bits: Bits, key: str, idx: int, width: int, steps: list[tuple[ManifestInfo, pb.Chunk]]) -> Bits | None:
        for info, c in steps:
            payload = b""
            if c.encoding != SAME:
                try:
                    payload = self.sub.repo.store.get(info.pb.packs[c.pack].key, (c.offset, c.length))
                except DeltasyncError:
                    return None
            chunk = EncodedChunk(c.encoding, payload)
            try:
                if self.backward:
                    bits = decode_reverse(info.codec, chunk, bits, width)
                    if digest(bits) != c.base_digest:
                        self._damaged(info, c)
                        return None
                    continue
                if c.encoding != FULL and digest(bits) != c.base_digest:
                    return None
                bits = info.codec.decode(chunk, None if c.encoding == FULL else bits, width, len(bits))
            except DeltasyncError:
                self._damaged(info, c)
                return None
            if digest(bits) != c.target_digest:
                self._damaged(info, c)
                return None
        return bits

    def _damaged(self, info: ManifestInfo, c: pb.Chunk) -> None:
        store = self.sub.repo.store
        if isinstance(store, CachedStore) and store.cache is not None and c.encoding != SAME:
            store.cache.forget(info.pb.packs[c.pack].key)  # a damaged kept payload: fetch it again


def move_copy(
    sub: Subscriber,
    out: str | os.PathLike[str],
    target: int,
    *,
    only_if_cached: bool = False,
    stop: Callable[[], bool] | None = None,
) -> MoveResult | None:
    """Bring the copy at ``out`` to ``target`` along the delta chain from the version it
    holds (see the module doc). None when there is no such chain, when walking it would
    download more than the snapshot chain, or (``only_if_cached``) when it would download
    anything at all: the caller pulls instead."""
    root = Path(out)
    with copy_lock(root):
        finish_install(root)
        db = StateDB.open(root)
        assert db is not None
        state = db.state()
        held = held_manifest(db, state, sub.repo)
        if state is None or held is None or held.version == target:
            return None
        path = version_path(sub.repo, held.version, target)
        if path is None:
            return None
        path[0] = held
        store = sub.repo.store
        walker = _Walker(sub, path, store if isinstance(store, CachedStore) else None)
        info = path[-1]
        places, held_places = placements(info), placements(held)
        items: list[tuple[pb.Tensor, int, int, int]] = []
        plans: dict[tuple[str, int], list[tuple[ManifestInfo, pb.Chunk]] | None] = {}  # [] = unchanged
        walkable: Want = {}
        download = 0
        for t in info.pb.tensors:
            key, width = key_of(t), dtypes.element_width(t.dtype)
            h = held_places.get(key)
            same_layout = (
                h is not None and h.tensor.nbytes == t.nbytes and dtypes.element_width(h.tensor.dtype) == width
                and held.codec.chunk_step(width) == info.codec.chunk_step(width)
            )
            for idx, (off, length) in enumerate(info.codec.chunk_ranges(t.nbytes, width)):
                items.append((t, idx, off, length))
                if same_layout and h is not None and h.tensor.chunks[idx].target_digest == t.chunks[idx].target_digest:
                    plans[(key, idx)] = []
                    continue
                steps = plans[(key, idx)] = walker.steps(key, idx)
                if steps is None:
                    if only_if_cached:
                        return None
                    continue
                download += walker.uncached_bytes(steps)
                if only_if_cached and download:
                    return None
                walkable.setdefault(key, []).append(idx)
        if download and sub.plan(target, None, walkable)[0].fetch_bytes < download:
            return None  # rollback across many deltas: the snapshot chain is cheaper
        result = MoveResult(target)
        staging, recorder, resuming = begin_staging(root, db, info)
        staged = StagedFiles(info, staging)
        try:
            for f in staged.blobs:
                sub._write_blob(f, staged.path(f.path), root)
            staged.open()
            lock = threading.Lock()
            with FileReader() as reader:

                def produce(item: tuple[pb.Tensor, int, int, int]) -> str:
                    t, idx, off, length = item
                    key, width = key_of(t), dtypes.element_width(t.dtype)
                    expected = t.chunks[idx].target_digest
                    if resuming:
                        with contextlib.suppress(DeltasyncError):
                            if digest(read_placed(reader, staging, places[key], off, length)) == expected:
                                return "kept"
                    steps, h = plans[(key, idx)], held_places.get(key)
                    if steps is None or h is None:
                        return "fetched"
                    try:
                        bits = read_placed(reader, root, h, off, length)
                    except DeltasyncError:
                        return "fetched"
                    if digest(bits) != h.tensor.chunks[idx].target_digest:
                        return "fetched"  # drifted local bits: rebuilt from the snapshot
                    walked = walker.walk(bits, key, idx, width, steps) if steps else bits
                    if walked is None or digest(walked) != expected:
                        return "fetched"
                    with lock:
                        staged.write(t, off, walked, streamed=False)
                    return "walked" if steps else "unchanged"

                remaining: Want = {}
                for item, how in zip(items, _ordered(items, produce, sub.workers), strict=True):
                    if stop is not None and stop():
                        raise PullStopped(target)
                    recorder.advance()
                    if how == "fetched":
                        remaining.setdefault(key_of(item[0]), []).append(item[1])
                    setattr(result, how, getattr(result, how) + 1)
            if remaining:

                def sink(t: pb.Tensor, off: int, data: Bits) -> None:
                    if stop is not None and stop():
                        raise PullStopped(target)
                    staged.write(t, off, data, streamed=False)

                sub._run(info, None, sink, want=remaining)
            staged.verify_by_reading()
            staged.fsync()
        finally:
            staged.close()
        install_staged(root, staging, info, repo=state.repo)
        return result


def _ordered(items: list[T], fn: Callable[[T], R], workers: int) -> Iterator[R]:
    """``map(fn, items)`` on ``workers`` threads, in order, with a bounded window in flight."""
    window: deque[Future[R]] = deque()
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="deltasync-local") as pool:
        try:
            for item in items:
                window.append(pool.submit(fn, item))
                if len(window) >= 2 * workers:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        finally:
            for fut in window:
                fut.cancel()

"""Squashes: version C stored once more, as one delta from an older version A.

A subscriber far behind would otherwise download every delta between its version and the
newest one. A squash A -> C is an extra edge of the version graph that the planner
(:meth:`Subscriber.plan`) takes when it costs fewer bytes: a stride-50 squash replaces 50
deltas whose changes mostly overlap (RL updates touch the same elements again and again).

A squash is a manifest like a delta's (kind DELTA, ``parent`` A, ``version`` C, base
digests A's chunk digests, its own packs) stored under ``squashes/<C>-<A>.pb``. It is never
a commit: C is committed first (so its commit never waits on a squash), and a squash is
checked against C's manifest before use (same tensors, same chunk digests; signed like a
commit when the repository has keys). It is redundant: a damaged or missing squash costs a
pull only the bytes of the plain deltas (the subscriber falls back per chunk), gc keeps it
exactly while both its versions are kept, and ``verify`` decodes every chunk of it.

Building one reads C's bits (in memory or on disk right after a publish, else rebuilt
from the repository chunk by chunk) and, for the chunks that differ, A's bits rebuilt from
the repository chunk by chunk: memory stays O(chunk size x workers + pack size), never a
copy of the model per stride. A squash that would not be smaller than what a subscriber
at A fetches today is not written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from ..errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    DeltasyncError,
    ObjectExistsError,
    ObjectNotFoundError,
    UsageError,
    VersionNotFoundError,
)
from ..format import dtypes
from ..format.codec import FULL, SAME
from ..format.manifest import ManifestInfo, key_of
from ..format.signing import PrivateKeyLike
from ..pull.fetch import PackFetcher
from ..pull.plan import Chain
from ..pull.subscriber import Subscriber
from ..repo.leases import Lease
from ..repo.repository import Repository, open_repository, squash_key
from ..storage import Store
from ..v1 import manifest_pb2 as pb
from .commit import encoded_manifest
from .config import PublisherConfig
from .encode import BaseTensor, DeltaTooLarge, Reader, SourceTensor, abandon, encode

if TYPE_CHECKING:
    from .publisher import Publisher

Bits = npt.NDArray[np.uint8]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SquashResult:
    a: int
    c: int
    outcome: Literal["written", "exists", "not smaller"]
    stored_bytes: int  # of the squash (0 unless written)
    path_bytes: int  # what a subscriber at ``a`` fetched for ``c`` before this squash
    seconds: float

    def summary(self) -> str:
        from ..progress import human_bytes

        if self.outcome == "written":
            return (
                f"squash {self.a}->{self.c}: {human_bytes(self.stored_bytes)} stored "
                f"(the cheapest path was {human_bytes(self.path_bytes)}), {self.seconds:.2f}s"
            )
        if self.outcome == "exists":
            return f"squash {self.a}->{self.c}: already stored"
        return (
            f"squash {self.a}->{self.c}: not written, not smaller than the "
            f"{human_bytes(self.path_bytes)} a subscriber at {self.a} fetches now"
        )


def write_squash(
    repo: str | Store | Repository,
    a: int,
    c: int,
    *,
    config: PublisherConfig | None = None,
    target: Mapping[str, Reader] | None = None,
    signing_key: PrivateKeyLike | None = None,
) -> SquashResult:
    """Store committed version ``c`` as one delta from committed version ``a`` (a < c).

    ``config`` gives workers, pack size and progress. The codec is ``c``'s (its version, chunk size
    and levels are recorded in the squash), with ``config``'s choice of magnitude classes where
    ``c``'s version has them: the manifest says what a decoder must read, not how to encode.
    ``target`` reads ``c``'s bits by entry key (what the publisher still holds right after
    the commit); without it they are rebuilt from the repository. Either way every chunk
    must match ``c``'s digests. Written only if smaller than the cheapest path a subscriber
    at ``a`` has now (deltas, other squashes, or a snapshot).
    """
    start = time.monotonic()
    r = open_repository(repo, signing_key=signing_key)
    r.ensure_exists()
    if not 0 < a < c:
        raise UsageError(f"a squash goes from an older version to a newer one, got {a} -> {c}")
    ainfo, cinfo = r.manifest(a), r.manifest(c)
    if r.store.exists(squash_key(a, c)):
        return SquashResult(a, c, "exists", 0, 0, time.monotonic() - start)
    base_cfg = config or PublisherConfig()
    classes = base_cfg.codec.max_classes if cinfo.codec.codec_version >= 2 else 0  # what c's readers accept
    cfg = dataclasses.replace(base_cfg, codec=dataclasses.replace(cinfo.codec, max_classes=classes))
    sub = Subscriber(r, workers=cfg.threads, progress=False)
    before, _ = sub.plan(c, a)
    if before.fetch_bytes == 0:
        return SquashResult(a, c, "not smaller", 0, 0, time.monotonic() - start)

    fetcher = PackFetcher(r.store)
    a_chunks = _Chunks(sub, ainfo, fetcher)
    bases = _bases(ainfo, cinfo, a_chunks)
    if target is None:
        c_chunks = _Chunks(sub, cinfo, fetcher)
        c_chunks.expect((t, idx) for t in cinfo.pb.tensors for idx in range(len(t.chunks)))
        target = {key_of(t): c_chunks.reader(t) for t in cinfo.pb.tensors}
    a_chunks.expect(_changed(ainfo, cinfo, bases))
    sources = []
    for t in cinfo.pb.tensors:
        key = key_of(t)
        if key not in target:
            raise UsageError(f"no bits given for tensor {t.name!r} of version {c}")
        sources.append(SourceTensor(t.name, t.dtype, tuple(t.shape), t.nbytes, t.file, t.data_offset, target[key],
                                     tuple(t.slice_offsets), tuple(t.full_shape)))
    files = [pb.File() for _ in cinfo.pb.files]
    for mine, theirs in zip(files, cinfo.pb.files, strict=True):
        mine.CopyFrom(theirs)
    with Lease(r.store, f"squash {a}->{c}"):  # its packs are unreferenced until put_squash (repo/leases.py)
        return _write(r, cfg, a, c, cinfo, sources, files, bases, before.fetch_bytes, start)


def _write(r: Repository, cfg: PublisherConfig, a: int, c: int, cinfo: ManifestInfo, sources: list[SourceTensor],
           files: list[pb.File], bases: dict[str, BaseTensor], before: int, start: float) -> SquashResult:
    """Encode and store the squash ``a`` -> ``c`` if smaller than ``before`` bytes of fetch."""
    try:
        encoded = encode(r.store, cfg, sources, files, bases, label=f"squash {a}->{c}", limit=before - 1)
    except DeltaTooLarge:
        return SquashResult(a, c, "not smaller", 0, before, time.monotonic() - start)
    manifest = encoded_manifest(
        encoded, version=c, kind=pb.DELTA, parent=a, has_parent=True, snapshot=cinfo.pb.snapshot,
        codec=cinfo.pb.codec, files=files, metadata=dict(cinfo.pb.metadata), version_digest=cinfo.pb.version_digest,
    )
    try:
        r.put_squash(manifest)  # refuses a squash whose chunks are not exactly c's
    except ObjectExistsError:  # another writer stored this squash first: keep what it uses
        with contextlib.suppress(DeltasyncError):
            encoded.created -= {p.key for p in r.squash(a, c).pb.packs}
        abandon(r.store, encoded)
        return SquashResult(a, c, "exists", 0, before, time.monotonic() - start)
    except BaseException:
        abandon(r.store, encoded)
        raise
    return SquashResult(a, c, "written", encoded.stored, before, time.monotonic() - start)


def write_squashes(
    repo: str | Store | Repository,
    strides: Iterable[int],
    *,
    config: PublisherConfig | None = None,
    signing_key: PrivateKeyLike | None = None,
) -> list[SquashResult]:
    """The squashes a publisher with ``squash_strides=strides`` would have written: c - s
    -> c for each committed c that s divides and each committed c - s, where missing.
    For a background job (``deltasync squash --stride S``); existing ones are skipped."""
    r = open_repository(repo, signing_key=signing_key)
    r.ensure_exists()
    chosen = sorted(set(strides))
    if not chosen or any(isinstance(s, bool) or not isinstance(s, int) or s < 2 for s in chosen):
        raise UsageError(f"strides must be integers >= 2, got {chosen!r}")
    versions = r.versions()
    present, stored = set(versions), set(r.squashes())
    out = []
    for c in versions:
        for stride in chosen:
            a = c - stride
            if c % stride == 0 and a in present and (a, c) not in stored:
                out.append(write_squash(r, a, c, config=config))
    return out


def squash_after_commit(pub: Publisher, c: int, target: Mapping[str, Reader]) -> list[SquashResult]:
    """The publisher's hook: squashes into ``c`` for each configured stride dividing it.

    Version ``c`` is committed already; a squash that fails is logged and skipped (it is
    only an optimisation, and ``deltasync squash`` can build it later)."""
    out: list[SquashResult] = []
    for stride in sorted(set(pub.config.squash_strides)):
        a = c - stride
        if c % stride or a < 1:
            continue
        try:
            out.append(write_squash(pub.repo, a, c, config=pub.config, target=target))
        except VersionNotFoundError:
            continue  # version a was never committed here (explicit ids) or is deleted
        except DeltasyncError as e:
            log.warning("squash %d->%d not written: %s", a, c, e)
    return out


def verify_squash(repo: Repository, a: int, c: int, *, workers: int = 0) -> int:
    """Decode every stored chunk of squash ``a`` -> ``c`` against ``a``'s bits rebuilt from
    the repository (the digests of its bases and targets are checked when it is read);
    raise CorruptObjectError naming the squash on the first problem.
    Returns the number of chunks checked."""
    what = f"squash {a}->{c}"
    sq = repo.squash(a, c)
    ainfo = repo.manifest(a)
    for p in sq.pb.packs:
        try:
            size = repo.store.size(p.key)
        except ObjectNotFoundError:
            raise CorruptObjectError(what, f"pack {p.key} is missing") from None
        if size != p.size:
            raise CorruptObjectError(what, f"pack {p.key} has {size} bytes, the squash says {p.size}")
    a_entries = ainfo.entries()
    sub = Subscriber(repo, workers=workers, progress=False)
    fetcher = PackFetcher(repo.store)
    a_chunks = _Chunks(sub, ainfo, fetcher)
    jobs: list[Callable[[], None]] = []
    for t in sq.pb.tensors:
        width = dtypes.element_width(t.dtype)
        ranges = sq.codec.chunk_ranges(t.nbytes, width)
        base_t = a_entries.get(key_of(t))
        for idx, chunk in enumerate(t.chunks):
            if chunk.encoding == FULL:
                jobs.append(_checker(sub, sq, t, idx, ranges[idx][1], None, fetcher, a_chunks.cpu))
            elif chunk.encoding != SAME and base_t is not None:  # repo.squash checked the base digests
                a_chunks.expect([(base_t, idx)])
                jobs.append(_checker(sub, sq, t, idx, ranges[idx][1], a_chunks.later(base_t, idx), fetcher, a_chunks.cpu))
    with ThreadPoolExecutor(max_workers=sub.workers, thread_name_prefix="deltasync-verify") as pool:
        for f in [pool.submit(job) for job in jobs]:
            f.result()
    return sum(len(t.chunks) for t in sq.pb.tensors)


# -- helpers --------------------------------------------------------------------------------------


class _Chunks:
    """Chunks of one committed version, rebuilt from its snapshot chain and verified."""

    def __init__(self, sub: Subscriber, info: ManifestInfo, fetcher: PackFetcher) -> None:
        self.sub = sub
        self.info = info
        self.chain = Chain(sub.repo.chain(info.version))
        self.fetcher = fetcher
        self.cpu = threading.Semaphore(sub.workers)

    def expect(self, chunks: Iterable[tuple[pb.Tensor, int]]) -> None:
        """Announce the chunks that will be read, so that mostly-read packs come whole."""
        for t, idx in chunks:
            for info, c in self.chain.steps(key_of(t), idx, None)[0]:
                if c.encoding != SAME:
                    self.fetcher.expect(info.pb.packs[c.pack].key, info.pb.packs[c.pack].size, c.length)

    def read(self, t: pb.Tensor, idx: int, length: int) -> Bits:
        steps, _ = self.chain.steps(key_of(t), idx, None)
        width = dtypes.element_width(t.dtype)
        return self.sub.pipeline.apply_steps(t, idx, length, width, None, steps, self.fetcher, self.cpu)

    def reader(self, t: pb.Tensor) -> Reader:
        step = self.info.codec.chunk_step(dtypes.element_width(t.dtype))

        def read(off: int, length: int) -> Bits:
            return self.read(t, off // step, length)

        return read

    def later(self, t: pb.Tensor, idx: int) -> Callable[[int], Bits]:
        return lambda length: self.read(t, idx, length)


def _bases(ainfo: ManifestInfo, cinfo: ManifestInfo, a_chunks: _Chunks) -> dict[str, BaseTensor]:
    """Version a's tensors that c's chunks can be encoded against: same size, same element
    width and the same chunk boundaries (else their chunks start over in full)."""
    a_entries = ainfo.entries()
    out: dict[str, BaseTensor] = {}
    for t in cinfo.pb.tensors:
        key = key_of(t)
        base = a_entries.get(key)
        width = dtypes.element_width(t.dtype)
        if base is None or base.nbytes != t.nbytes or dtypes.element_width(base.dtype) != width:
            continue
        steps = (ainfo.codec.chunk_step(width), cinfo.codec.chunk_step(width))
        if steps[0] != steps[1] and t.nbytes > min(steps):
            continue
        out[key] = BaseTensor(width, t.nbytes, [c.target_digest for c in base.chunks], a_chunks.reader(base),
                               verify=False)  # rebuilt bits are verified already
    return out


def _changed(ainfo: ManifestInfo, cinfo: ManifestInfo, bases: Mapping[str, BaseTensor]) -> list[tuple[pb.Tensor, int]]:
    """Chunks of version a that differ in c: the only ones read from a."""
    a_entries = ainfo.entries()
    out = []
    for t in cinfo.pb.tensors:
        key = key_of(t)
        base = bases.get(key)
        if base is not None:
            out += [(a_entries[key], i) for i, (c, d) in enumerate(zip(t.chunks, base.digests, strict=True))
                    if c.target_digest != d]
    return out


def _checker(
    sub: Subscriber,
    sq: ManifestInfo,
    t: pb.Tensor,
    idx: int,
    length: int,
    base: Callable[[int], Bits] | None,
    fetcher: PackFetcher,
    cpu: threading.Semaphore,
) -> Callable[[], None]:
    """Decode one chunk of squash ``sq`` onto its base (errors rebuilding the base name
    their own version); a bad payload or digest is reported as damage to the squash."""

    def run() -> None:
        bits = base(length) if base is not None else None
        chunk = t.chunks[idx]
        try:
            sub.pipeline.apply_steps(t, idx, length, dtypes.element_width(t.dtype), bits, [(sq, chunk)], fetcher, cpu)
        except (CorruptObjectError, ChecksumMismatchError) as e:
            where = f"tensor {t.name!r} chunk {idx}"
            if chunk.encoding != SAME:
                where += f" (pack {sq.pb.packs[chunk.pack].key})"
            detail = e.detail if isinstance(e, CorruptObjectError) else "decoded bits do not match the chunk digest"
            raise CorruptObjectError(f"squash {sq.parent}->{sq.version}", f"{where}: {detail}") from None

    return run

"""The chunk pipeline of a pull: fetch, decode, apply and verify, chunk by chunk.

Every pull (tensors in memory, a directory's slot, an engine's changes, a check) goes
through :meth:`ChunkPipeline.run`. Applying is per chunk and idempotent (DESIGN.md
invariant 3): target digest already present -> keep; base digest present -> apply the path;
otherwise -> rebuild the chunk from the snapshot chain. Every decoded step is checked against
its digest. A squash is redundant data: a chunk it fails to rebuild is rebuilt from plain
deltas instead (with a warning), so damage to a squash never fails a pull.

Chunks run on a thread pool with a bounded window in flight; I/O threads may outnumber
cores (remote stores want many requests in flight) while every CPU step of a chunk (the
digest of the local bits, decoding and verifying, the copy into ``dest``, the caller's
``work``) holds one of ``workers`` CPU slots: ``workers`` is the number of cores a pull
uses, no more (so that 1 worker next to 2 measures what a second core adds). Results reach
the caller's ``sink`` in chunk order on the calling thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from ..errors import ChecksumMismatchError, CorruptObjectError, DeltasyncError, ObjectNotFoundError
from ..format import dtypes
from ..format.codec import SAME, EncodedChunk
from ..format.digest import StreamDigest, digest
from ..format.manifest import BLOB_PART_SIZE, ManifestInfo, key_of
from ..progress import Progress
from ..repo.repository import Repository
from ..v1 import manifest_pb2 as pb
from .fetch import PackFetcher
from .plan import Chain, Plan, Planner, Want, wanted

Bits = npt.NDArray[np.uint8]
log = logging.getLogger("deltasync.pull")

T = TypeVar("T")
R = TypeVar("R")

#: Bytes the chunks in flight of one pull may hold (results, decode buffers, payloads).
IN_FLIGHT_BYTES = 192 << 20


class LocalBits:
    """Bits at hand locally, by entry key: of the version held (None: none is), and for a
    directory also the chunks a resumed pull staged (see :mod:`deltasync.local.slotfill`)."""

    def __init__(self, version: int | None, read: Callable[[str, int, int], Bits | None]) -> None:
        self.version = version
        self.read = read


class ChunkPipeline:
    """Materialises the chunks of versions of one repository (see the module docstring)."""

    def __init__(self, repo: Repository, planner: Planner, *, workers: int, progress: bool | None = None) -> None:
        self.repo = repo
        self.planner = planner
        self.workers = workers
        self.progress = progress

    def run(
        self,
        info: ManifestInfo,
        local: LocalBits | None,
        sink: Callable[[pb.Tensor, int, Bits], None],
        *,
        dest: dict[str, Bits] | None = None,
        want: Want | None = None,
        squashes: bool = True,
        label: str = "pull",
        work: Callable[[pb.Tensor, int, Bits], None] | None = None,
    ) -> Plan:
        """Materialise the chunks of ``info`` (all, or those in ``want``) in order: into
        ``dest`` arrays by entry key (written by the workers), and through ``sink`` (called in
        order on this thread). ``work(tensor, offset, bits)``, if given, runs on the worker
        that made each chunk, in its CPU slot, before the chunk reaches ``sink``: per-chunk
        CPU work of the caller's (an engine's diff) then spreads over the workers instead of
        running on the calling thread. Without ``squashes`` only the stored chains are read.
        ``label`` names the work on the progress line (``verify v3``)."""
        local_version = local.version if local is not None else None
        plan, chain = self.planner.plan(info.version, local_version, want, squashes=squashes)
        snapshot_chain: list[Chain] = [chain] if plan.base is None and not plan.squashes else []
        plain_chain: list[Chain | None] = []  # deltas only, from the local version: after a squash fails
        broken: set[tuple[int, int]] = set()
        lock = threading.Lock()

        def full_chain() -> Chain:
            with lock:
                if not snapshot_chain:
                    snapshot_chain.append(Chain(self.repo.chain(info.version)))
                return snapshot_chain[0]

        def plain_from_local() -> Chain | None:
            with lock:
                if not plain_chain:
                    found = None
                    if local_version is not None and local_version <= info.version:
                        with contextlib.suppress(DeltasyncError):
                            inc = self.repo.chain(info.version, stop_at=local_version)
                            found = Chain(inc) if inc[0].version == local_version else None
                    plain_chain.append(found)
                return plain_chain[0]

        Route = tuple[Bits | None, list[tuple[ManifestInfo, pb.Chunk]]]

        def route(via: Chain | None, start: int | None, key: str, idx: int, held: Bits | None, held_digest: bytes) -> Route:
            """Base bits and steps for one chunk along ``via``; from the snapshot chain when
            the path needs local bits that do not match (repair)."""
            if via is not None:
                steps, at_start = via.steps(key, idx, start)
                if not at_start:
                    return None, steps  # the path stores this chunk in full
                if held is not None and steps and steps[-1][1].base_digest == held_digest:
                    return held, steps
            return None, full_chain().steps(key, idx, None)[0]

        progress = Progress(f"{label} v{info.version}", info.pb.raw_bytes, enabled=self.progress)
        codec = info.codec
        fetcher = PackFetcher(self.repo.store)
        for t in info.pb.tensors:
            key = key_of(t)
            for idx in wanted(want, key, len(t.chunks)):
                for step_info, c in chain.steps(key, idx, plan.base)[0]:
                    if c.encoding != SAME:
                        fetcher.expect(step_info.pb.packs[c.pack].key, step_info.pb.packs[c.pack].size, c.length)
        # I/O threads may outnumber cores (remote stores want many requests in flight); the
        # semaphore keeps decoding to one thread per worker.
        cpu = threading.Semaphore(self.workers)
        threads = max(self.workers, self.repo.store.io_concurrency)

        def job(t: pb.Tensor, idx: int, off: int, length: int) -> Bits:
            bits = materialise(t, idx, off, length)
            if dest is not None or work is not None:
                with cpu:
                    if dest is not None:
                        dest[key_of(t)][off : off + length] = bits
                    if work is not None:
                        work(t, off, bits)
            return bits

        def materialise(t: pb.Tensor, idx: int, off: int, length: int) -> Bits:
            width = dtypes.element_width(t.dtype)
            key = key_of(t)
            held = local.read(key, off, length) if local is not None else None
            with cpu:
                held_digest = digest(held) if held is not None else b""
            if held is not None and held_digest == t.chunks[idx].target_digest:
                return held  # already there (idempotent, resumable)
            base, steps = route(chain, plan.base, key, idx, held, held_digest)
            try:
                return self.apply_steps(t, idx, length, width, base, steps, fetcher, cpu)
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
            return self.apply_steps(t, idx, length, width, base, steps, fetcher, cpu)

        def jobs() -> Iterator[tuple[pb.Tensor, int, int, Callable[[], Bits]]]:
            for t in info.pb.tensors:
                width = dtypes.element_width(t.dtype)
                ranges = codec.chunk_ranges(t.nbytes, width)
                for idx in wanted(want, key_of(t), len(ranges)):
                    off, length = ranges[idx]
                    # What the job holds at its peak: its result, a decode buffer, its payload.
                    cost = 2 * length + t.chunks[idx].length
                    yield t, off, cost, bind(job, t, idx, off, length)

        window: deque[tuple[pb.Tensor, int, int, Future[Bits]]] = deque()
        in_flight = 0  # cost of the jobs in the window

        def drain_one() -> None:  # results reach the sink in chunk order
            nonlocal in_flight
            wt, woff, cost, fut = window.popleft()
            data = fut.result()
            in_flight -= cost
            sink(wt, woff, data)
            progress.advance(len(data))
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="deltasync-pull") as pool:
            try:
                for t, off, cost, fn in jobs():
                    window.append((t, off, cost, pool.submit(fn)))
                    in_flight += cost
                    # A count bound for small chunks, a byte bound for big ones (up to 64 MiB
                    # each): memory stays bounded whatever chunk size a manifest names.
                    while len(window) >= 2 * threads or (in_flight > IN_FLIGHT_BYTES and len(window) > 1):
                        drain_one()
                while window:
                    drain_one()
            except BaseException:
                for _, _, _, fut in window:
                    fut.cancel()
                raise
        progress.finish()
        return plan

    def apply_steps(
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
                raise CorruptObjectError(where(info, t, idx, pack.key), e.detail) from None
            except ObjectNotFoundError:
                # A committed version names this pack: its absence is damage, as verify reports it.
                raise CorruptObjectError(where(info, t, idx, pack.key), "pack is missing") from None
        with cpu:
            return self.decode_steps(t, idx, length, width, base, steps, payloads)

    def decode_steps(
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
                raise CorruptObjectError(where(info, t, idx, info.pb.packs[c.pack].key), e.detail) from None
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


def where(info: ManifestInfo, t: pb.Tensor, idx: int, pack_key: str) -> str:
    return f"version {info.version}, tensor {t.name!r}, chunk {idx} (pack {pack_key})"


def bind(fn: Callable[[pb.Tensor, int, int, int], Bits], t: pb.Tensor, idx: int, off: int, length: int) -> Callable[[], Bits]:
    return lambda: fn(t, idx, off, length)


def blob_parts(repo: Repository, f: pb.File) -> Iterator[bytes]:
    """The parts of non-tensor file ``f`` in order, checked against their digests, none
    larger than what is left of the declared size (nor than BLOB_PART_SIZE): what is written
    from them never exceeds ``f.size``, whatever the store holds or the manifest lists."""
    left = f.size
    for part in f.blob_parts:
        if not left:
            raise CorruptObjectError(f"file {f.path}", f"lists more blob parts than its {f.size} bytes need")
        data = repo.get_blob(part, max_size=min(BLOB_PART_SIZE, left))
        if not data:
            raise CorruptObjectError(f"file {f.path}", "an empty blob part (no publisher writes one)")
        left -= len(data)
        yield data
    if left:
        raise CorruptObjectError(f"file {f.path}", f"its blob parts hold {f.size - left} bytes, the manifest says {f.size}")


def write_blob(repo: Repository, f: pb.File, path: Path) -> None:
    """Download non-tensor file ``f`` to ``path``, checked against its digest; on any failure
    ``path`` is removed: bytes that did not verify are never left behind."""
    d = StreamDigest()
    try:
        with open(path, "wb") as fh:
            for data in blob_parts(repo, f):
                d.update(data)
                fh.write(data)
        if d.digest() != f.digest:
            raise CorruptObjectError(f"file {f.path}", "rebuilt bytes do not match the manifest digest")
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise


def ordered_map(items: list[T], fn: Callable[[T], R], workers: int) -> Iterator[R]:
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

"""Packs: payloads appended back to back into content-addressed objects, uploaded in the background.

A :class:`Packer` closes a pack at ``pack_bytes`` (64 MiB by default) and uploads it on a
thread while encoding goes on, with at most ``max(2, store.upload_concurrency)`` packs
waiting or in flight, and (where the store says, ``store.upload_bytes``: a writable relay's
about bandwidth x round trip) no more bytes of them than that beyond one pack, so memory
stays O(pack size * upload streams) and within the store's byte bound.

**Early flushes** (stores whose ``overlap_uploads`` is true: S3, a writable relay). A delta
of a few MiB never fills a 64 MiB pack, so it would upload only once encoding ends, and the
link would idle through the encode and then the encode wait through the link. So such a
store also gets a pack closed early, once the bytes waiting reach the *early floor* and an
upload stream is free: the link then carries the version while it is encoded, and what is
left to upload when encoding ends is at most one floor. The floor is
``max(EARLY_MIN_BYTES, flushed / EARLY_FRACTION)`` (``flushed``: the bytes this packer has
already closed into packs), capped at ``pack_bytes``, and a packer makes at most
:data:`MAX_EARLY_PACKS` early flushes. So no early pack is smaller than 2 MiB (or
``pack_bytes``, if smaller), and a version of ``S`` stored bytes gets at most
``ceil(S / pack_bytes) + MAX_EARLY_PACKS`` packs; a small delta (8 MiB) goes up as four
packs of 2 MiB. Where the link is the bottleneck (a snapshot over a slow link) every stream
is busy, no early flush happens, and packs are full size. Packs stay content-addressed
(named by the xxh3-128 of their bytes) and all are durable before :meth:`Packer.finish`
returns, i.e. before any manifest names them; except where the store orders a manifest after
the uploads it is receiving (``store.orders_references``: a writable relay), where the last
uploads may still be going when the manifest is sent (``finish(settle=False)``).

**Over several relays** (``store.upload_targets`` = ``n`` > 1: a ``grpc://`` URL naming several
writable relays, each behind a link of its own). Each pack goes to the relay with the fewest
of the publisher's bytes in flight, and the version is committed only when the last link is
done, so the links must end together: the larger the last packs, the more one link carries
alone at the end, and a pack counts whole against its relay until it is stored, so large ones
make the loads look uneven for as long as they take. So packs close at
:data:`SHARED_PACK_BYTES` (16 MiB) at most (each relay then takes the next pack as one of its
own is stored, at the pace of its link), the early floor grows n times slower (``flushed / (EARLY_FRACTION * n)``,
up to ``MAX_EARLY_PACKS * n`` early flushes: each relay's packs grow as one relay's would), and
what is left at the finish is split, at payload boundaries, into up to
``TAIL_PACKS_PER_TARGET * n`` packs of about equal size (as many as leave each about
:data:`EARLY_MIN_BYTES` or more), which start one after another on the least loaded relay:
every link ends within about one small pack of the others. The count above becomes
``ceil(S / pack_bytes) + (MAX_EARLY_PACKS + TAIL_PACKS_PER_TARGET) * n``. A payload is placed
with its chunk (:meth:`Packer.place`), which says where it is and is written again if it moves.
"""

from __future__ import annotations

import contextlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import ObjectExistsError
from ..format.digest import digest
from ..storage import Store
from ..v1 import manifest_pb2 as pb

__all__ = ["EARLY_FRACTION", "EARLY_MIN_BYTES", "MAX_EARLY_PACKS", "SHARED_PACK_BYTES", "TAIL_PACKS_PER_TARGET", "Packer"]

#: The smallest pack an early flush closes (unless ``pack_bytes`` is smaller).
EARLY_MIN_BYTES = 2 << 20
#: An early flush also waits for 1/EARLY_FRACTION of what was flushed before: pack sizes grow
#: geometrically (x1.25), so the count stays small and the last upload stays a small share.
EARLY_FRACTION = 4
#: Early flushes one packer makes at most (one version, or one rank's share of it).
MAX_EARLY_PACKS = 16
#: Packs per upload target (relay) the bytes left at :meth:`Packer.finish` are split into, at most.
TAIL_PACKS_PER_TARGET = 2
#: Over several relays, the size at which a pack closes at most (whatever ``pack_bytes``).
SHARED_PACK_BYTES = 16 << 20


class Packer:
    """Appends payloads to a pack; full packs (and, for remote stores, early ones) upload on
    background threads.

    Args:
        store: where packs go; its ``upload_concurrency`` sizes the upload window and its
            ``overlap_uploads`` turns early flushes on.
        pack_bytes: the size at which a pack closes.
        early: force early flushes on or off (default: ``store.overlap_uploads``).
        first_pack: the index in the manifest's pack list of this packer's first pack
            (:meth:`place` writes ``chunk.pack`` from it).
    """

    def __init__(self, store: Store, pack_bytes: int, *, early: bool | None = None, first_pack: int = 0) -> None:
        self.store = store
        # Over several relays a pack counts whole against its relay until it is stored: large
        # ones make the relays' loads look uneven for seconds (module docstring).
        self.pack_bytes = min(pack_bytes, SHARED_PACK_BYTES) if store.upload_targets > 1 else pack_bytes
        self.early = store.overlap_uploads if early is None else early
        self.first_pack = first_pack
        self.packs: list[pb.Pack] = []
        self._parts: list[bytes] = []
        self._chunks: list[pb.Chunk] = []  # per part: the chunk place() writes where it is
        self._size = 0
        self._uploads: deque[tuple[Future[None], int]] = deque()  # each upload and its size
        self._held = 0  # bytes of the packs in _uploads
        self._window_bytes = store.upload_bytes
        # As many uploads in flight as the store wants (several streams over relays), at least 2.
        self._window = max(2, store.upload_concurrency)
        self._pool = ThreadPoolExecutor(max_workers=self._window, thread_name_prefix="deltasync-upload")
        self.created: set[str] = set()  # keys this attempt wrote, the only ones abandon() may delete
        self.stored = 0
        self.early_flushes = 0

    def place(self, payload: bytes, chunk: pb.Chunk) -> None:
        """Append ``payload``, the stored bytes of ``chunk``, and write where it is into the
        chunk (``pack``: from ``first_pack``, ``offset``, ``length``); the chunk is written
        again if :meth:`finish` moves the payload into a pack of its own."""
        self._append_only(payload, chunk)
        if self._size >= self.pack_bytes:
            self.flush()
        elif self.early and self._size >= self.early_floor() and self._stream_free():
            self.early_flushes += 1
            self.flush()

    def early_floor(self) -> int:
        """The bytes waiting that an early flush needs now (past the last early flush: never)."""
        targets = self.store.upload_targets
        if self.early_flushes >= MAX_EARLY_PACKS * targets:
            return self.pack_bytes
        return min(self.pack_bytes, max(EARLY_MIN_BYTES, self.stored // (EARLY_FRACTION * targets)))

    def _stream_free(self) -> bool:
        """Whether fewer uploads are in flight than the store wants (an early pack would start
        now, not queue behind full ones). Finished uploads are collected, failures raised."""
        while self._uploads and self._uploads[0][0].done():
            self._collect()
        return sum(not f.done() for f, _ in self._uploads) < self._window and not self._full(self.early_floor())

    def _full(self, size: int) -> bool:
        """Whether a new pack of ``size`` bytes must wait for the oldest upload: the count is
        reached, or the byte bound would be passed by more than one pack with one upload still
        going (so full packs larger than the bound still go two at a time: the next is on its
        way behind the one being answered, and the link does not idle between them)."""
        if len(self._uploads) >= self._window:
            return True
        return (self._window_bytes is not None and bool(self._uploads)
                and self._held + size > self._window_bytes + self.pack_bytes)

    def _collect(self) -> None:
        """Wait for the oldest upload (raising its failure) and let go of its bytes."""
        future, size = self._uploads.popleft()
        self._held -= size
        future.result()

    def flush(self) -> None:
        if not self._parts:
            return
        data = b"".join(self._parts)
        self._parts, self._chunks, self._size = [], [], 0
        key = f"packs/{digest(data).hex()}.pack"
        self.packs.append(pb.Pack(key=key, size=len(data)))
        self.stored += len(data)
        while self._full(len(data)):  # bound memory: packs (and bytes) waiting to upload
            self._collect()
        self._held += len(data)
        self._uploads.append((self._pool.submit(self._upload, key, data), len(data)))

    def _upload(self, key: str, data: bytes) -> None:
        try:
            self.store.put(key, data, if_absent=True)
        except ObjectExistsError:
            return  # content-addressed: these very bytes are stored, maybe for a committed version
        self.created.add(key)

    def finish(self, *, settle: bool = True) -> list[Future[None]]:
        """Close the last pack(s) and wait until every upload is stored (raising the first
        failure). With ``settle`` false, the uploads still going are returned instead of
        waited for (a store that orders a manifest after them, ``store.orders_references``:
        the commit sends it meanwhile and waits for them after; :func:`~.encode.settle`)."""
        groups = self._tail_groups()
        if len(groups) > 1:
            held = list(zip(self._parts, self._chunks, strict=True))
            self._parts, self._chunks, self._size = [], [], 0
            for group in groups:
                for payload, chunk in held[group]:
                    self._append_only(payload, chunk)
                self.flush()
        self.flush()
        try:
            while self._uploads and (settle or self._uploads[0][0].done()):
                self._collect()
        except BaseException:
            self._pool.shutdown(wait=True)
            raise
        going = [f for f, _ in self._uploads]
        self._uploads.clear()
        self._held = 0
        self._pool.shutdown(wait=not going)  # (the threads end with their uploads)
        return going

    def _tail_groups(self) -> list[slice]:
        """The open pack's parts cut into runs of about equal bytes, one pack each (module
        docstring, the last bytes over several relays); one run where nothing is gained."""
        count = len(self._parts)
        packs = min(count, TAIL_PACKS_PER_TARGET * self.store.upload_targets, self._size // EARLY_MIN_BYTES)
        if packs < 2 or self.store.upload_targets < 2 or not self.early:
            return [slice(0, count)]
        cuts = [0]
        taken = 0
        for i, part in enumerate(self._parts[:-1]):  # the last run keeps at least the last part
            taken += len(part)
            if len(cuts) < packs and taken * packs >= self._size * len(cuts):  # this run has its share
                cuts.append(i + 1)
        return [slice(a, b) for a, b in zip(cuts, [*cuts[1:], count], strict=True)]

    def _append_only(self, payload: bytes, chunk: pb.Chunk) -> None:
        """Append without closing the pack (finish's runs: each is flushed as one pack)."""
        offset = self._size
        self._parts.append(payload)
        self._chunks.append(chunk)
        self._size += len(payload)
        chunk.pack, chunk.offset, chunk.length = self.first_pack + len(self.packs), offset, len(payload)

    def abandon(self) -> None:
        """Stop and remove what this attempt uploaded (it is referenced by nothing)."""
        for f, _ in self._uploads:
            f.cancel()
        self._pool.shutdown(wait=True)
        for key in self.created:
            with contextlib.suppress(Exception):
                self.store.delete(key)

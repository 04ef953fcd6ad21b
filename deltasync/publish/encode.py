"""Encoding and committing versions: the steps every producer of versions shares.

This is the publish side's internal API, called by :class:`~deltasync.publish.Publisher`,
:class:`~deltasync.publish.distributed.DistributedPublisher` (each rank encodes its own
tensors, rank 0 commits) and squashes (:mod:`~deltasync.publish.squash`):

* :class:`SourceTensor` is a tensor to encode, read through a :data:`Reader`;
  :class:`BaseTensor` the parent version's bits of it, with the parent's chunk digests.
* :func:`encode` diffs and encodes every chunk on a thread pool (zstd and numpy release the
  GIL) with a bounded window of chunks in flight, appends payloads in order to packs that
  upload in the background (:class:`Packer`), and returns :class:`Encoded`: the tensor
  records and the packs, all durable. Memory stays O(chunk size * workers + pack size).
* :func:`build_manifest` and :func:`commit` write the manifest last (its presence is the
  commit); :func:`abandon` removes the packs of an attempt that will not be committed.

**Objects deleted before the commit.** A publish slower than a concurrent gc's grace period
can find packs or blobs it uploaded deleted by gc (they were unreferenced until the commit).
So right before writing the manifest, :func:`commit` checks that every pack and blob the
version names, and its parent's manifest, still exist. A missing pack is stored again
(:func:`restore_packs`: the chunks it held are re-encoded in full from the source into new
packs, since the delta's base bits may be gone) and a missing blob is uploaded again from
its file; then the check runs again, up to :data:`COMMIT_ATTEMPTS` times, after which the
publish fails with nothing committed. Once committed, the check runs once more: a pack gc
deleted in the instant between the check and the manifest write (a gc whose grace is
shorter than the publish, deleting that very pack at that moment) makes the publish fail
naming it, instead of reporting a version that cannot be pulled.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..errors import CheckpointError, CommittedError, StoreError, UsageError
from ..format import dtypes
from ..format.checkpoint import FileReader
from ..format.codec import FULL, SAME, EncodedChunk, PlanesZstdCodec
from ..format.digest import StreamDigest, digest, version_digest
from ..format.manifest import FORMAT, ManifestInfo, key_of, manifest_key
from ..format.slices import Slice, entry_key
from ..format.tensors import tensor_bits
from ..progress import Progress
from ..repo.repository import Repository, blob_key
from ..storage import Store
from ..v1 import manifest_pb2 as pb
from .config import PublisherConfig, PublishResult
from .packs import Packer

if TYPE_CHECKING:
    import torch

Bits = npt.NDArray[np.uint8]
log = logging.getLogger("deltasync.publish")
#: Reads ``length`` bytes at ``offset`` of one tensor's data.
Reader = Callable[[int, int], Bits]
#: How many times :func:`commit` checks for deleted objects (and stores them again) before
#: it gives up with nothing committed.
COMMIT_ATTEMPTS = 3
#: Given the version to commit and the keys of its missing objects, store them again;
#: returns the version to commit now.
Restore = Callable[["Encoded", set[str]], "Encoded"]


@dataclass
class SourceTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    data_offset: int
    read: Reader
    offsets: tuple[int, ...] = ()  # for slices of a larger tensor
    full_shape: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        return entry_key(self.name, self.offsets)


@dataclass
class Encoded:
    """One rank's (or the whole) encoded tensors, with the packs already durable."""

    tensors: list[pb.Tensor]
    packs: list[pb.Pack]
    stored: int
    raw: int
    created: set[str]  # pack keys this attempt wrote (the only ones an abandon may delete)


@dataclass
class BaseTensor:
    """The parent version's bits of one tensor, and its chunk digests from the parent manifest."""

    width: int
    nbytes: int
    digests: list[bytes]
    read: Reader
    verify: bool  # digest what we read (bits from disk); in-memory bits are our own copy


class DeltaTooLarge(Exception):
    pass


def same_version(parent: ManifestInfo, files: list[pb.File], tensors: Sequence[pb.Tensor],
                  metadata: Mapping[str, str] | None) -> bool:
    """Whether a new version would hold exactly what ``parent`` holds."""

    def tensor_sig(t: pb.Tensor) -> tuple[object, ...]:
        return (t.name, t.dtype, tuple(t.shape), tuple(t.full_shape), tuple(t.slice_offsets),
                tuple(c.target_digest for c in t.chunks))

    return (
        dict(parent.pb.metadata) == dict(metadata or {})
        and [f.SerializeToString(deterministic=True) for f in parent.pb.files]
        == [f.SerializeToString(deterministic=True) for f in files]
        and [tensor_sig(t) for t in parent.pb.tensors] == [tensor_sig(t) for t in tensors]
    )


def encode_job(
    codec: PlanesZstdCodec,
    s: SourceTensor,
    base: BaseTensor | None,
    idx: int,
    off: int,
    length: int,
    width: int,
    dest: Bits | None,
) -> Callable[[], tuple[EncodedChunk, bytes, bytes, Bits]]:
    def run() -> tuple[EncodedChunk, bytes, bytes, Bits]:
        target = s.read(off, length)
        target_digest = digest(target)
        if base is None:
            enc = codec.encode(target, None, width)
            base_digest = b""
        else:
            base_digest = base.digests[idx]
            if target_digest == base_digest:
                return EncodedChunk(SAME, b""), target_digest, base_digest, target
            base_bits = base.read(off, length)
            if base.verify and digest(base_bits) != base_digest:
                raise CheckpointError(
                    s.name, f"base copy of chunk {idx} does not match the parent version (stale or corrupt base)"
                )
            enc = codec.encode(target, base_bits, width)
            if enc.encoding == FULL:
                base_digest = b""
        if dest is not None:
            dest[off : off + length] = target
        return enc, target_digest, base_digest, target

    return run


def array_reader(arr: Bits) -> Reader:
    def read(off: int, length: int) -> Bits:
        return arr[off : off + length]

    return read


def file_reader(reader: FileReader, path: Path, start: int) -> Reader:
    def read(off: int, length: int) -> Bits:
        return reader.read(path, start + off, length)

    return read


def state_sources(state: Mapping[str, torch.Tensor | Slice]) -> list[SourceTensor]:
    """A state dict as tensors to encode: whole tensors, or ``Slice``s of larger ones."""
    out: list[SourceTensor] = []
    for name, value in state.items():
        if not isinstance(name, str) or not name:
            raise UsageError(f"state keys must be non-empty strings, got {name!r}")
        if isinstance(value, Slice):
            t, offsets, full = value.tensor, tuple(value.offsets), tuple(value.full_shape)
            if not full:
                raise UsageError(f"slice of {name!r} needs a full_shape with at least one dimension")
        else:
            t, offsets, full = value, (), ()
        if not hasattr(t, "dtype") or not hasattr(t, "shape"):
            raise UsageError(f"state[{name!r}] is not a tensor")
        bits = tensor_bits(t)
        out.append(SourceTensor(
            name, dtypes.from_torch(t.dtype), tuple(t.shape), bits.nbytes, "", 0, array_reader(bits), offsets, full
        ))
    return out


def encode(
    store: Store,
    config: PublisherConfig,
    sources: list[SourceTensor],
    files: list[pb.File],
    bases: Mapping[str, BaseTensor],
    *,
    label: str,
    limit: int | None = None,
    keep: dict[str, Bits] | None = None,
    base_arrays: Mapping[str, Bits] | None = None,
) -> Encoded:
    """Encode every chunk of ``sources`` (against ``bases`` where present) into durable packs.

    Raises :class:`DeltaTooLarge` once the payload passes ``limit``; whatever it uploaded is
    removed. With ``keep``, each tensor's bits are copied into ``keep[key]`` (reusing
    ``base_arrays[key]`` in place when the size allows) to be the next version's base. The
    digests of safetensors ``files`` are filled in as their tensors' chunks complete.
    """
    codec = config.codec
    raw_total = sum(s.nbytes for s in sources)
    progress = Progress(label, raw_total, enabled=config.progress)
    packer = Packer(store, config.pack_bytes)
    # Tensors of one file in file order, so each file's digest streams as chunks complete.
    order = sorted(range(len(sources)), key=lambda i: (sources[i].file, sources[i].data_offset)) \
        if any(s.file for s in sources) else list(range(len(sources)))
    tensors: list[pb.Tensor] = []
    file_digests = {f.path: StreamDigest() for f in files if f.kind == pb.File.SAFETENSORS}
    for f in files:
        if f.kind == pb.File.SAFETENSORS:
            file_digests[f.path].update(f.header)

    def jobs() -> Iterator[tuple[pb.Tensor, Callable[[], tuple[EncodedChunk, bytes, bytes, Bits]]]]:
        for i in order:
            s = sources[i]
            width = dtypes.element_width(s.dtype)
            t = pb.Tensor(name=s.name, dtype=s.dtype, shape=s.shape, nbytes=s.nbytes, file=s.file,
                          data_offset=s.data_offset, full_shape=s.full_shape, slice_offsets=s.offsets)
            tensors.append(t)
            base = bases.get(s.key)
            if base is not None and (base.width != width or base.nbytes != s.nbytes):
                base = None  # added, resized or retyped: this tensor starts over in full
            dest: Bits | None = None
            if keep is not None:
                reuse = base_arrays.get(s.key) if base_arrays is not None else None
                dest = reuse if reuse is not None and reuse.nbytes == s.nbytes else np.empty(s.nbytes, np.uint8)
                keep[s.key] = dest
            for idx, (off, length) in enumerate(codec.chunk_ranges(s.nbytes, width)):
                yield t, encode_job(codec, s, base, idx, off, length, width, dest)

    pool = ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="deltasync-encode")
    window: deque[tuple[pb.Tensor, Future[tuple[EncodedChunk, bytes, bytes, Bits]]]] = deque()
    stored = 0

    def drain_one() -> None:
        nonlocal stored
        t, fut = window.popleft()
        enc, target_digest, base_digest, target = fut.result()
        chunk = pb.Chunk(encoding=enc.encoding, target_digest=target_digest, base_digest=base_digest)
        if enc.encoding != SAME:
            chunk.pack, chunk.offset = packer.add(enc.payload)
            chunk.length = len(enc.payload)
            stored += len(enc.payload)
            if limit is not None and stored > limit:
                raise DeltaTooLarge
        t.chunks.append(chunk)
        if t.file:
            file_digests[t.file].update(target)
        progress.advance(len(target))

    try:
        for t, job in jobs():
            window.append((t, pool.submit(job)))
            if len(window) >= 2 * config.threads:
                drain_one()
        while window:
            drain_one()
        packer.finish()
    except BaseException:
        for _, fut in window:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        packer.abandon()
        raise
    pool.shutdown(wait=True)
    progress.finish()
    for f in files:
        if f.kind == pb.File.SAFETENSORS:
            f.digest = file_digests[f.path].digest()
    return Encoded(tensors, packer.packs, packer.stored, raw_total, set(packer.created))


def abandon(store: Store, encoded: Encoded) -> None:
    """Remove the packs this attempt created (a committed version may share the others)."""
    for key in encoded.created:
        with contextlib.suppress(Exception):
            store.delete(key)


def build_manifest(
    repo: Repository,
    codec: PlanesZstdCodec,
    version: int,
    parent: int | None,
    is_snapshot: bool,
    files: list[pb.File],
    encoded: Encoded,
    blob_bytes: int,
    metadata: Mapping[str, str] | None,
) -> pb.Manifest:
    """The manifest of a new version made of ``encoded`` (and ``files``), version digest included."""
    manifest = pb.Manifest(
        format=FORMAT,
        version=version,
        kind=pb.SNAPSHOT if is_snapshot else pb.DELTA,
        parent=parent or 0,
        has_parent=parent is not None,
        snapshot=version if is_snapshot else repo.manifest(parent or 0).pb.snapshot,
        codec=pb.CodecSpec(name=codec.name, codec_version=codec.codec_version,
                           zstd_level=codec.zstd_level, chunk_bytes=codec.chunk_bytes,
                           full_zstd_level=codec.full_zstd_level),
        files=files,
        tensors=encoded.tensors,
        packs=encoded.packs,
        raw_bytes=encoded.raw,
        stored_bytes=encoded.stored + blob_bytes,
        created_unix=time.time(),
        metadata=dict(metadata or {}),
    )
    manifest.version_digest = version_digest(c.target_digest for t in encoded.tensors for c in t.chunks)
    return manifest


def commit(
    repo: Repository,
    config: PublisherConfig,
    version: int,
    parent: int | None,
    is_snapshot: bool,
    files: list[pb.File],
    encoded: Encoded,
    *,
    blob_bytes: int,
    metadata: Mapping[str, str] | None,
    start: float,
    restore: Restore | None = None,
) -> PublishResult:
    """Commit ``encoded`` as ``version`` (manifest, then the latest ref), or, with
    ``config.skip_unchanged`` and nothing different from ``parent``, commit nothing.

    Every object the version names must still exist (module docstring): ``restore`` stores
    missing ones again; without it, or after :data:`COMMIT_ATTEMPTS` checks, StoreError."""
    if config.skip_unchanged and parent is not None and same_version(repo.manifest(parent), files, encoded.tensors, metadata):
        abandon(repo.store, encoded)
        return PublishResult(parent, kind="unchanged", parent=parent, raw_bytes=encoded.raw, stored_bytes=0,
                             seconds=time.monotonic() - start)
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        missing = missing_objects(repo.store, files, encoded)
        if not missing:
            break
        if restore is None or attempt == COMMIT_ATTEMPTS:
            raise deleted_error(version, missing, attempt)
        log.warning("version %d: %s deleted before the commit (a gc with a --grace shorter than this publish?); "
                    "storing it again (attempt %d of %d)", version, _some(missing), attempt + 1, COMMIT_ATTEMPTS)
        encoded = restore(encoded, set(missing))
    if not is_snapshot and parent is not None and not repo.store.exists(manifest_key(parent)):
        raise StoreError(f"version {version} not committed: its parent version {parent} was deleted while publishing "
                         "(gc); nothing of it is visible, publish again (it will be a snapshot)")
    manifest = build_manifest(repo, config.codec, version, parent, is_snapshot, files, encoded, blob_bytes, metadata)
    repo.commit(manifest)
    gone = missing_objects(repo.store, files, encoded)
    if gone:
        # gc deleted it between the check above and the manifest write: say so, loudly.
        raise CommittedError(version, f"version {version} was committed but {_some(gone)} was deleted by a concurrent gc at that "
                         "moment: it cannot be pulled; `deltasync verify` names it, and the next version should be "
                         "published as a snapshot (--no-cache)")
    return PublishResult(version, kind="snapshot" if is_snapshot else "delta", parent=parent, raw_bytes=encoded.raw,
                         stored_bytes=manifest.stored_bytes, seconds=time.monotonic() - start)


def deleted_error(version: int, missing: Sequence[str], attempts: int) -> StoreError:
    """The publish of ``version`` gives up: ``missing`` objects are gone after ``attempts`` checks."""
    return StoreError(
        f"version {version} not committed: {_some(missing)} deleted while publishing"
        f"{f', again after {attempts} attempts to store it' if attempts > 1 else ''} (a gc with a --grace shorter "
        "than a publish?); nothing of it is visible, publish again"
    )


def _some(keys: Sequence[str]) -> str:
    more = f" (and {len(keys) - 1} more object(s))" if len(keys) > 1 else ""
    return f"{keys[0]}{more}"


def missing_objects(store: Store, files: Sequence[pb.File], encoded: Encoded) -> list[str]:
    """Keys of the packs and blobs a version of ``files`` and ``encoded`` names that the store
    lacks, sorted (checked on a few threads: one request each on S3)."""
    keys = sorted({p.key for p in encoded.packs}
                  | {blob_key(part) for f in files if f.kind == pb.File.BLOB for part in f.blob_parts})
    if not keys:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(keys)), thread_name_prefix="deltasync-check") as pool:
        present = list(pool.map(store.exists, keys))
    return [k for k, ok in zip(keys, present, strict=True) if not ok]


def restore_packs(store: Store, config: PublisherConfig, encoded: Encoded, sources: Sequence[SourceTensor],
                  missing: set[str]) -> Encoded:
    """``encoded`` with every chunk stored in a pack of ``missing`` re-encoded in full from
    ``sources`` into new packs (uploaded before return); other packs keep their chunks.

    In full, because the delta's base bits may be gone by now (the library overwrites its
    in-memory base with the new bits as it encodes). Each chunk re-read must still have the
    digest it was encoded with, else the source changed while publishing: CheckpointError."""
    lost = {i for i, p in enumerate(encoded.packs) if p.key in missing}
    if not lost:
        return encoded
    codec = config.codec
    kept = [p for i, p in enumerate(encoded.packs) if i not in lost]
    renumber = {i: n for n, i in enumerate(i for i in range(len(encoded.packs)) if i not in lost)}
    by_key = {s.key: s for s in sources}
    packer = Packer(store, config.pack_bytes)
    try:
        for t in encoded.tensors:
            source = by_key.get(key_of(t))
            width = dtypes.element_width(t.dtype)
            ranges = codec.chunk_ranges(t.nbytes, width)
            for idx, c in enumerate(t.chunks):
                if c.encoding == SAME:
                    continue
                if c.pack not in lost:
                    c.pack = renumber[c.pack]
                    continue
                if source is None:
                    raise StoreError(f"cannot store tensor {t.name!r} again: its source is not held here")
                off, length = ranges[idx]
                target = source.read(off, length)
                if digest(target) != c.target_digest:
                    raise CheckpointError(t.name, f"chunk {idx} changed while publishing; publish again")
                payload = codec.encode(target, None, width)
                c.encoding, c.base_digest = payload.encoding, b""
                index, c.offset = packer.add(payload.payload)
                c.pack, c.length = len(kept) + index, len(payload.payload)
        packer.finish()
    except BaseException:
        packer.abandon()
        raise
    lost_bytes = sum(encoded.packs[i].size for i in lost)
    return Encoded(encoded.tensors, kept + packer.packs, encoded.stored - lost_bytes + packer.stored, encoded.raw,
                   (encoded.created - missing) | packer.created)


def signing_policy(repo: Repository, parent: int | None) -> bool:
    """Whether the next version may be a delta against ``parent`` as far as signatures go.

    A repository that signs must not extend an unsigned chain: a subscriber with trusted keys
    refuses a delta whose chain back to its snapshot has an unsigned version, so the first
    signed version after unsigned ones is a snapshot (False). Publishing unsigned after signed
    versions is allowed but warned about: trusting subscribers will refuse it and every delta
    on top of it until the next signed snapshot."""
    if parent is None:
        return True
    if repo.signing_key is None:
        if repo.manifest(parent).pb.signature:
            log.warning("publishing an unsigned version after signed ones (version %d is signed): subscribers with "
                        "--trusted-key refuse it and the deltas on top of it until a signed snapshot", parent)
        return True
    unsigned = [info.version for info in repo.chain(parent) if not info.pb.signature]
    if unsigned:
        log.info("this version is stored as a snapshot: it starts a signed chain (version %d, on the chain it would "
                 "extend, is unsigned)", unsigned[-1])
        return False
    return True


def memory_bases(repo: Repository, bits: Mapping[str, Bits], parent: int | None) -> dict[str, BaseTensor]:
    """Bases for a delta against ``parent`` from bits held in memory (``bits`` by entry key),
    for every tensor whose size still matches the parent's."""
    if parent is None:
        return {}
    info = repo.manifest(parent)
    out: dict[str, BaseTensor] = {}
    for t in info.pb.tensors:
        key = key_of(t)
        arr = bits.get(key)
        if arr is not None and arr.nbytes == t.nbytes:
            out[key] = BaseTensor(
                dtypes.element_width(t.dtype), t.nbytes, [c.target_digest for c in t.chunks],
                array_reader(arr), verify=False,
            )
    return out

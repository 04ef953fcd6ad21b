"""Encoding versions: the step every producer of versions shares.

This is the publish side's internal API, called by :class:`~deltasync.publish.Publisher`,
:class:`~deltasync.publish.distributed.DistributedPublisher` (each rank encodes its own
tensors, rank 0 commits) and squashes (:mod:`~deltasync.publish.squash`):

* :class:`SourceTensor` is a tensor to encode, read through a :data:`Reader`;
  :class:`BaseTensor` the parent version's bits of it, with the parent's chunk digests.
* :func:`encode` diffs and encodes every chunk on a thread pool (zstd and numpy release the
  GIL) with a bounded window of chunks in flight, appends payloads in order to packs that
  upload in the background (:class:`Packer`), and returns :class:`Encoded`: the tensor
  records and the packs, all durable. Memory stays O(chunk size * workers + pack size).
* :func:`abandon` removes the packs of an attempt that will not be committed; committing
  is :mod:`~deltasync.publish.commit`.

"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..errors import CheckpointError, UsageError
from ..format import dtypes
from ..format.checkpoint import FileReader
from ..format.codec import FULL, SAME, EncodedChunk, PlanesZstdCodec
from ..format.digest import StreamDigest, digest
from ..format.manifest import ManifestInfo, key_of
from ..format.slices import Slice, entry_key
from ..format.tensors import tensor_bits
from ..progress import Progress
from ..repo.repository import Repository
from ..storage import Store
from ..v1 import manifest_pb2 as pb
from .config import PublisherConfig
from .packs import Packer

if TYPE_CHECKING:
    import torch

Bits = npt.NDArray[np.uint8]
log = logging.getLogger("deltasync.publish")
#: Reads ``length`` bytes at ``offset`` of one tensor's data.
Reader = Callable[[int, int], Bits]


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
    uploading: list[Future[None]] = field(default_factory=list)
    """Uploads of its packs still going (encode's ``overlap_commit``); :func:`settle` waits."""


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
    overlap_commit: bool = False,
) -> Encoded:
    r"""Encode every chunk of ``sources`` (against ``bases`` where present) into durable packs.

    With ``overlap_commit``, where the store orders a manifest after the uploads it is
    receiving (``store.orders_references``), the last uploads may still be going on return
    (``Encoded.uploading``): the caller commits meanwhile, then :func:`settle`\ s them.

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
        # The chunk in its tensor (not a copy): the packer may write its place again (finish).
        chunk = t.chunks.add(encoding=enc.encoding, target_digest=target_digest, base_digest=base_digest)
        if enc.encoding != SAME:
            packer.place(enc.payload, chunk)
            stored += len(enc.payload)
            if limit is not None and stored > limit:
                raise DeltaTooLarge
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
        uploading = packer.finish(settle=not (overlap_commit and store.orders_references))
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
    # The packer's own set while uploads go on: they add the keys they write to it.
    return Encoded(tensors, packer.packs, packer.stored, raw_total,
                   packer.created if uploading else set(packer.created), uploading)


def settle(encoded: Encoded) -> None:
    """Wait for the uploads ``encoded`` has still going (see :class:`Encoded`), raising the
    first failure; afterwards it has none."""
    going, encoded.uploading = encoded.uploading, []
    error: BaseException | None = None
    for future in going:
        try:
            future.result()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


def abandon(store: Store, encoded: Encoded) -> None:
    """Remove the packs this attempt created (a committed version may share the others),
    once its uploads still going have ended."""
    with contextlib.suppress(Exception):
        settle(encoded)
    for key in encoded.created:
        with contextlib.suppress(Exception):
            store.delete(key)


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

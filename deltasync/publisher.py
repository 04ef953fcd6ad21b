"""The publisher: turns a state (dict of tensors, or a checkpoint directory) into a version.

Chunks are encoded on a thread pool (zstd and numpy release the GIL) with a bounded window
of chunks in flight, appended in order to packs that upload in the background, and the
manifest is committed last. Memory stays O(chunk size * workers + pack size).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from . import dtypes
from .checkpoint import CheckpointDir, FileReader, scan_checkpoint
from .codec import FULL, SAME, EncodedChunk, PlanesZstdCodec
from .digest import StreamDigest, digest, version_digest
from .errors import CheckpointError, ObjectExistsError, UsageError
from .manifest import FORMAT, ManifestInfo, key_of
from .progress import Progress
from .repository import BLOB_PART_BYTES, Repository, open_repository
from .signing import PrivateKeyLike
from .slices import Slice, entry_key
from .storage import Store
from .tensors import tensor_bits
from .v1 import manifest_pb2 as pb

if TYPE_CHECKING:
    import torch

    from .squash import SquashResult

Bits = npt.NDArray[np.uint8]
Reader = Callable[[int, int], Bits]


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """How versions are encoded and stored."""

    codec: PlanesZstdCodec = field(default_factory=PlanesZstdCodec)
    """Chunk codec and its parameters (recorded in every manifest)."""
    workers: int = 0
    """Encoding threads; 0 means one per CPU core."""
    snapshot_every: int = 20
    """Store every K-th version of a chain as a snapshot (the first version always is)."""
    max_delta_fraction: float = 0.5
    """A delta larger than this fraction of the last snapshot is stored as a snapshot instead."""
    pack_bytes: int = 64 << 20
    """Target size of one pack (the unit of upload and download)."""
    progress: bool | None = None
    """Show a progress line; None: only when stderr is a terminal."""
    skip_unchanged: bool = False
    """When the tensors, files and metadata equal the latest version's, commit nothing and
    return a result of kind ``unchanged`` naming that version (the command line's default)."""
    squash_strides: tuple[int, ...] = ()
    """After committing version C, also store C as one delta from C - s for each stride s
    dividing C (a squash, see squash.py), when that is smaller than what a subscriber at
    C - s would fetch: far-behind subscribers then skip the versions in between. Each
    squash rebuilds the changed chunks of C - s from the repository, after the commit."""

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise UsageError(f"workers must be >= 0, got {self.workers}")
        if self.snapshot_every < 1:
            raise UsageError(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        if not 0 < self.max_delta_fraction <= 10:
            raise UsageError(f"max_delta_fraction must be in (0, 10], got {self.max_delta_fraction}")
        if self.pack_bytes < 1 << 16:
            raise UsageError(f"pack_bytes must be at least 64 KiB, got {self.pack_bytes}")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 2 for s in self.squash_strides):
            raise UsageError(f"squash_strides must be integers >= 2, got {self.squash_strides!r}")

    @property
    def threads(self) -> int:
        return self.workers or os.cpu_count() or 1


@dataclass(frozen=True)
class PublishResult:
    version: int
    kind: str  # "snapshot" | "delta" | "unchanged" (nothing committed: ``version`` is the latest)
    parent: int | None
    raw_bytes: int
    stored_bytes: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else float("inf")


@dataclass
class _SourceTensor:
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
class _Encoded:
    """One rank's (or the whole) encoded tensors, with the packs already durable."""

    tensors: list[pb.Tensor]
    packs: list[pb.Pack]
    stored: int
    raw: int
    created: set[str]  # pack keys this attempt wrote (the only ones an abandon may delete)


@dataclass
class _BaseTensor:
    """The parent version's bits of one tensor, and its chunk digests from the parent manifest."""

    width: int
    nbytes: int
    digests: list[bytes]
    read: Reader
    verify: bool  # digest what we read (bits from disk); in-memory bits are our own copy


class _DeltaTooLarge(Exception):
    pass


class _Packer:
    """Appends payloads to a pack; full packs upload on a background thread."""

    def __init__(self, store: Store, pack_bytes: int) -> None:
        self.store = store
        self.pack_bytes = pack_bytes
        self.packs: list[pb.Pack] = []
        self._parts: list[bytes] = []
        self._size = 0
        self._uploads: deque[Future[None]] = deque()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="deltasync-upload")
        self.created: set[str] = set()  # keys this attempt wrote, the only ones abandon() may delete
        self.stored = 0

    def add(self, payload: bytes) -> tuple[int, int]:
        offset = self._size
        self._parts.append(payload)
        self._size += len(payload)
        index = len(self.packs)
        if self._size >= self.pack_bytes:
            self.flush()
        return index, offset

    def flush(self) -> None:
        if not self._parts:
            return
        data = b"".join(self._parts)
        self._parts, self._size = [], 0
        key = f"packs/{digest(data).hex()}.pack"
        self.packs.append(pb.Pack(key=key, size=len(data)))
        self.stored += len(data)
        while len(self._uploads) >= 2:  # bound memory: at most two packs waiting to upload
            self._uploads.popleft().result()
        self._uploads.append(self._pool.submit(self._upload, key, data))

    def _upload(self, key: str, data: bytes) -> None:
        try:
            self.store.put(key, data, if_absent=True)
        except ObjectExistsError:
            return  # content-addressed: these very bytes are stored, maybe for a committed version
        self.created.add(key)

    def finish(self) -> None:
        self.flush()
        try:
            while self._uploads:
                self._uploads.popleft().result()
        finally:
            self._pool.shutdown(wait=True)

    def abandon(self) -> None:
        """Stop and remove what this attempt uploaded (it is referenced by nothing)."""
        for f in self._uploads:
            f.cancel()
        self._pool.shutdown(wait=True)
        for key in self.created:
            with contextlib.suppress(Exception):
                self.store.delete(key)


class Publisher:
    """Publishes versions to a repository.

    >>> pub = Publisher("./repo")
    >>> v = pub.publish(model.state_dict())

    For the library, the previous version's bits are kept in memory, so diffing needs no
    download. A new Publisher (or one whose last attempt failed) starts with a snapshot.
    """

    def __init__(
        self,
        repo: str | Store | Repository,
        config: PublisherConfig | None = None,
        *,
        signing_key: PrivateKeyLike | None = None,
    ) -> None:
        """``signing_key``: an ed25519 key (or its PEM file) that signs every manifest."""
        self.repo = open_repository(repo, signing_key=signing_key)
        self.config = config or PublisherConfig()
        self._bits: dict[str, Bits] = {}
        self._bits_version: int | None = None
        self.last_result: PublishResult | None = None
        self.last_squashes: list[SquashResult] = []

    # -- library entry point -------------------------------------------------------------------

    def publish(
        self,
        state: Mapping[str, torch.Tensor | Slice],
        *,
        version: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> int:
        """Commit ``state`` as a new version and return its id."""
        sources = state_sources(state)
        parent = self._bits_version
        bases = self._memory_bases(parent)
        new_bits: dict[str, Bits] = {}
        self._bits_version = None  # the in-memory copy is rewritten in place below
        result = self._publish(sources, [], bases, parent, version, metadata, keep=new_bits, base_arrays=self._bits)
        self._bits = new_bits
        self._bits_version = result.version
        self._squash(result.version, {key: _array_reader(arr) for key, arr in new_bits.items()})
        return result.version

    def _squash(self, version: int, target: Mapping[str, Reader]) -> None:
        """After the commit: the squashes into ``version`` that ``squash_strides`` ask for."""
        self.last_squashes = []
        if self.config.squash_strides:
            from .squash import squash_after_commit

            self.last_squashes = squash_after_commit(self, version, target)

    def _memory_bases(self, parent: int | None) -> dict[str, _BaseTensor]:
        if parent is None:
            return {}
        info = self.repo.manifest(parent)
        out: dict[str, _BaseTensor] = {}
        for t in info.pb.tensors:
            key = key_of(t)
            arr = self._bits.get(key)
            if arr is not None and arr.nbytes == t.nbytes:
                out[key] = _BaseTensor(
                    dtypes.element_width(t.dtype), t.nbytes, [c.target_digest for c in t.chunks],
                    _array_reader(arr), verify=False,
                )
        return out

    # -- checkpoint directories ----------------------------------------------------------------

    def publish_dir(
        self,
        path: str | os.PathLike[str],
        *,
        base_dir: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        version: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> int:
        """Commit a checkpoint directory of safetensors files (plus any other files).

        The previous version's bits come from ``base_dir`` (a directory holding the latest
        version, e.g. the previous checkpoint) or ``cache_dir`` (a local copy deltasync keeps
        current: it is brought to the latest version if stale, and refreshed after the
        commit). Every base chunk read is checked against the parent manifest's digest.
        Without either, the version is a snapshot.
        """
        ckpt = scan_checkpoint(path)
        self.repo.create()
        parent = self.repo.latest()
        base_root: Path | None = None
        if parent is not None and base_dir is not None:
            base_root = Path(base_dir)
        elif parent is not None and cache_dir is not None:
            base_root = self._refresh_cache(Path(cache_dir), parent)
        with FileReader() as reader:
            sources = [
                _SourceTensor(
                    t.name, t.dtype, t.shape, t.nbytes, st.relpath, t.data_offset,
                    _file_reader(reader, st.path, st.data_start + t.data_offset),
                )
                for st in ckpt.safetensors.values()
                for t in st.tensors
            ]
            bases: dict[str, _BaseTensor] = {}
            if base_root is not None and parent is not None:
                bases = self._dir_bases(reader, base_root, self.repo.manifest(parent))
            result = self._publish(
                sources, self._dir_files(ckpt), bases, parent, version, metadata, blob_root=ckpt.root
            )
            if result.kind == "unchanged":
                return result.version
            self._squash(result.version, {s.key: s.read for s in sources})
        if cache_dir is not None:
            _replace_cache(Path(cache_dir), ckpt, self.repo.manifest(result.version))
        return result.version

    def _refresh_cache(self, cache: Path, latest: int) -> Path:
        from .subscriber import Subscriber, read_local_state

        state = read_local_state(cache)
        if state is None or state.version != latest:
            # The cache is deltasync's own: files found in it that are not the version's go aside.
            Subscriber(self.repo, progress=self.config.progress).pull_to_dir(cache, latest, move_aside=True)
        return cache

    def _dir_bases(self, reader: FileReader, root: Path, parent: ManifestInfo) -> dict[str, _BaseTensor]:
        files = {f.path: f for f in parent.pb.files}
        out: dict[str, _BaseTensor] = {}
        codec = self.config.codec
        for t in parent.pb.tensors:
            width = dtypes.element_width(t.dtype)
            steps = (parent.codec.chunk_step(width), codec.chunk_step(width))
            if steps[0] != steps[1] and t.nbytes > min(steps):
                continue  # another chunk size: the parent's digests are of other byte ranges
            if t.file:
                header_len = len(files[t.file].header)
                path = root / t.file
            else:  # a library version pulled to a directory lands in model.safetensors
                continue
            if not path.is_file():
                raise CheckpointError(str(path), f"base directory lacks {t.file} of version {parent.version}")
            out[t.name] = _BaseTensor(
                dtypes.element_width(t.dtype), t.nbytes, [c.target_digest for c in t.chunks],
                _file_reader(reader, path, header_len + t.data_offset), verify=True,
            )
        return out

    def _dir_files(self, ckpt: CheckpointDir) -> list[pb.File]:
        files: list[pb.File] = []
        for rel in ckpt.files:
            st = ckpt.safetensors.get(rel)
            if st is not None:
                files.append(pb.File(path=rel, kind=pb.File.SAFETENSORS, size=st.size, header=st.header))
            else:
                files.append(pb.File(path=rel, kind=pb.File.BLOB))
        return files

    def _store_blobs(self, root: Path, files: list[pb.File]) -> int:
        stored = 0
        for f in files:
            if f.kind != pb.File.BLOB:
                continue
            d = StreamDigest()
            size = 0
            with open(root / f.path, "rb") as fh:
                while part := fh.read(BLOB_PART_BYTES):
                    d.update(part)
                    size += len(part)
                    part_digest, written = self.repo.put_blob(part)
                    f.blob_parts.append(part_digest)
                    stored += written
            f.size = size
            f.digest = d.digest()
        return stored

    # -- the shared path -----------------------------------------------------------------------

    def _publish(
        self,
        sources: list[_SourceTensor],
        files: list[pb.File],
        bases: dict[str, _BaseTensor],
        parent: int | None,
        version: int | None,
        metadata: Mapping[str, str] | None,
        *,
        blob_root: Path | None = None,
        keep: dict[str, Bits] | None = None,
        base_arrays: dict[str, Bits] | None = None,
    ) -> PublishResult:
        start = time.monotonic()
        self.repo.create()
        latest = self.repo.latest()
        if version is None:
            version = (latest or 0) + 1
        elif version < 1:
            raise UsageError(f"version ids start at 1, got {version}")
        elif latest is not None and version <= latest:
            raise UsageError(f"version {version} is not newer than the latest version {latest}")
        if parent is not None and parent != latest:
            # Another publisher committed since our base: our bits are not the parent's.
            bases, parent = {}, latest

        limit: int | None = None
        if parent is not None and bases:
            chain = self.repo.chain(parent)
            if len(chain) < self.config.snapshot_every:
                limit = int(self.config.max_delta_fraction * chain[0].pb.stored_bytes)
        blob_bytes = self._store_blobs(blob_root, files) if blob_root is not None else 0
        if limit is not None:
            try:
                return self._attempt(sources, files, bases, parent, version, metadata, keep, base_arrays,
                                     limit, blob_bytes, start)
            except _DeltaTooLarge:
                pass  # store this version as a snapshot instead
        return self._attempt(sources, files, {}, parent, version, metadata, keep, base_arrays,
                             None, blob_bytes, start)

    def _attempt(
        self,
        sources: list[_SourceTensor],
        files: list[pb.File],
        bases: dict[str, _BaseTensor],
        parent: int | None,
        version: int,
        metadata: Mapping[str, str] | None,
        keep: dict[str, Bits] | None,
        base_arrays: dict[str, Bits] | None,
        limit: int | None,
        blob_bytes: int,
        start: float,
    ) -> PublishResult:
        encoded = self._encode(sources, files, bases, keep, base_arrays, limit, f"publish v{version}")
        return self._commit(version, parent, not bases, files, encoded, blob_bytes, metadata, start)

    def _encode(
        self,
        sources: list[_SourceTensor],
        files: list[pb.File],
        bases: dict[str, _BaseTensor],
        keep: dict[str, Bits] | None,
        base_arrays: dict[str, Bits] | None,
        limit: int | None,
        label: str,
    ) -> _Encoded:
        """Encode every chunk (against ``bases`` where present) into durable packs.

        Raises _DeltaTooLarge once the payload passes ``limit``; whatever it uploaded is removed.
        With ``keep``, each tensor's bits are copied into ``keep[key]`` (reusing
        ``base_arrays[key]`` in place when the size allows) to be the next version's base.
        """
        codec = self.config.codec
        raw_total = sum(s.nbytes for s in sources)
        progress = Progress(label, raw_total, enabled=self.config.progress)
        packer = _Packer(self.repo.store, self.config.pack_bytes)
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
                    yield t, _encode_job(codec, s, base, idx, off, length, width, dest)

        pool = ThreadPoolExecutor(max_workers=self.config.threads, thread_name_prefix="deltasync-encode")
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
                    raise _DeltaTooLarge
            t.chunks.append(chunk)
            if t.file:
                file_digests[t.file].update(target)
            progress.advance(len(target))

        try:
            for t, job in jobs():
                window.append((t, pool.submit(job)))
                if len(window) >= 2 * self.config.threads:
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
        return _Encoded(tensors, packer.packs, packer.stored, raw_total, set(packer.created))

    def _abandon(self, encoded: _Encoded) -> None:
        for key in encoded.created:
            with contextlib.suppress(Exception):
                self.repo.store.delete(key)

    def _commit(
        self,
        version: int,
        parent: int | None,
        is_snapshot: bool,
        files: list[pb.File],
        encoded: _Encoded,
        blob_bytes: int,
        metadata: Mapping[str, str] | None,
        start: float,
    ) -> PublishResult:
        if self.config.skip_unchanged and parent is not None and _same_version(
            self.repo.manifest(parent), files, encoded.tensors, metadata
        ):
            self._abandon(encoded)
            result = PublishResult(version=parent, kind="unchanged", parent=parent, raw_bytes=encoded.raw,
                                   stored_bytes=0, seconds=time.monotonic() - start)
            self.last_result = result
            return result
        codec = self.config.codec
        manifest = pb.Manifest(
            format=FORMAT,
            version=version,
            kind=pb.SNAPSHOT if is_snapshot else pb.DELTA,
            parent=parent or 0,
            has_parent=parent is not None,
            snapshot=version if is_snapshot else self.repo.manifest(parent or 0).pb.snapshot,
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
        self.repo.commit(manifest)
        result = PublishResult(
            version=version,
            kind="snapshot" if is_snapshot else "delta",
            parent=parent,
            raw_bytes=encoded.raw,
            stored_bytes=manifest.stored_bytes,
            seconds=time.monotonic() - start,
        )
        self.last_result = result
        return result


def _same_version(parent: ManifestInfo, files: list[pb.File], tensors: Sequence[pb.Tensor],
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


def _encode_job(
    codec: PlanesZstdCodec,
    s: _SourceTensor,
    base: _BaseTensor | None,
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


def _array_reader(arr: Bits) -> Reader:
    def read(off: int, length: int) -> Bits:
        return arr[off : off + length]

    return read


def _file_reader(reader: FileReader, path: Path, start: int) -> Reader:
    def read(off: int, length: int) -> Bits:
        return reader.read(path, start + off, length)

    return read


def _replace_cache(cache: Path, ckpt: CheckpointDir, info: ManifestInfo) -> None:
    """Make ``cache`` a local copy of the version just published from ``ckpt``."""
    from .subscriber import write_local_state

    staging = cache / ".deltasync" / "incoming"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for rel in ckpt.files:
        dest = staging / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ckpt.root / rel, dest)
    from .subscriber import install_staged

    install_staged(cache, staging, info)
    write_local_state(cache, info)


def state_sources(state: Mapping[str, torch.Tensor | Slice]) -> list[_SourceTensor]:
    """A state dict as tensors to encode: whole tensors, or ``Slice``s of larger ones."""
    out: list[_SourceTensor] = []
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
        out.append(_SourceTensor(
            name, dtypes.from_torch(t.dtype), tuple(t.shape), bits.nbytes, "", 0, _array_reader(bits), offsets, full
        ))
    return out

"""The publisher: turns a state (dict of tensors, or a checkpoint directory) into a version.

Chunks are encoded on a thread pool (zstd and numpy release the GIL) with a bounded window
of chunks in flight, appended in order to packs that upload in the background, and the
manifest is committed last. Memory stays O(chunk size * workers + pack size).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError, DeltasyncError, UsageError
from ..format import dtypes
from ..format.checkpoint import CheckpointDir, FileReader, scan_checkpoint
from ..format.digest import StreamDigest, digest
from ..format.manifest import ManifestInfo
from ..format.signing import PrivateKeyLike
from ..format.slices import Slice
from ..repo.leases import Lease
from ..repo.repository import BLOB_PART_BYTES, Repository, blob_key, open_repository
from ..storage import Store
from ..v1 import manifest_pb2 as pb
from .commit import Draft, commit, restore_packs, signing_policy
from .config import PublisherConfig
from .encode import (
    BaseTensor,
    Bits,
    DeltaTooLarge,
    Encoded,
    Reader,
    SourceTensor,
    abandon,
    array_reader,
    encode,
    file_reader,
    log,
    memory_bases,
    state_sources,
)

if TYPE_CHECKING:
    import torch

from .result import PublishResult

__all__ = ["PublishResult", "Publisher", "PublisherConfig"]


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
        self._warned_snapshots = False  # publish_dir without a base says so once

    # -- library entry point -------------------------------------------------------------------

    def publish(
        self,
        state: Mapping[str, torch.Tensor | Slice],
        *,
        version: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> PublishResult:
        """Commit ``state`` as a new version; the result is its id (an ``int``) with the details."""
        sources = state_sources(state)
        parent = self._bits_version
        bases = memory_bases(self.repo, self._bits, parent)
        new_bits: dict[str, Bits] = {}
        self._bits_version = None  # the in-memory copy is rewritten in place below
        result = self._publish(sources, [], bases, parent, version, metadata, keep=new_bits, base_arrays=self._bits,
                               speculate=True)
        self._bits = new_bits
        self._bits_version = result.version
        return self._squash(result, {key: array_reader(arr) for key, arr in new_bits.items()})

    def _squash(self, result: PublishResult, target: Mapping[str, Reader]) -> PublishResult:
        """After the commit: the squashes into the new version that ``squash_strides`` ask for."""
        if not self.config.squash_strides or result.kind == "unchanged":
            return result
        from .squash import squash_after_commit

        return result.with_squashes(squash_after_commit(self, result.version, target))

    def publish_dir(
        self,
        path: str | os.PathLike[str],
        *,
        base_dir: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        version: int | None = None,
        metadata: Mapping[str, str] | None = None,
        snapshots: bool = False,
    ) -> PublishResult:
        """Commit a checkpoint directory of safetensors files (plus any other files).

        The previous version's bits come from ``base_dir`` (a directory holding the latest
        version, e.g. the previous checkpoint) or ``cache_dir`` (a local copy deltasync keeps
        current: it is brought to the latest version if stale, and refreshed after the
        commit). Every base chunk read is checked against the parent manifest's digest.
        Without either, every version is a snapshot: logged as a warning once per publisher
        (the command line keeps a cache by default, see ``deltasync cache``), unless
        ``snapshots`` says that is meant.
        """
        ckpt = scan_checkpoint(path, follow_symlinks=self.config.follow_symlinks)
        self.repo.create()
        parent = self.repo.latest()
        base_root: Path | None = None
        if parent is not None and base_dir is not None:
            base_root = Path(base_dir)
        elif parent is not None and cache_dir is not None:
            base_root = self._refresh_cache(Path(cache_dir), parent)
        elif parent is not None and not snapshots and not self._warned_snapshots:
            self._warned_snapshots = True
            log.warning("publish_dir without base_dir or cache_dir: version %d and every later one are stored as full "
                        "snapshots; pass cache_dir= (a local copy deltasync keeps current, as the command line "
                        "does) or base_dir= (the previous checkpoint) to store deltas", (version or parent + 1))
        with FileReader() as reader:
            sources = [
                SourceTensor(
                    t.name, t.dtype, t.shape, t.nbytes, st.relpath, t.data_offset,
                    file_reader(reader, st.path, st.data_start + t.data_offset),
                )
                for st in ckpt.safetensors.values()
                for t in st.tensors
            ]
            bases: dict[str, BaseTensor] = {}
            if base_root is not None and parent is not None:
                bases = self._dir_bases(reader, base_root, self.repo.manifest(parent))
            result = self._publish(
                sources, self._dir_files(ckpt), bases, parent, version, metadata, blob_root=ckpt.root,
            )  # latest is read again beside the lease: a commit during the base reads makes this a snapshot
            if result.kind == "unchanged":
                return result
            result = self._squash(result, {s.key: s.read for s in sources})
        if cache_dir is not None:
            # The version is committed: from here on nothing may turn the publish into a
            # failure, or a retry would publish it a second time. A cache left stale is
            # brought to the latest version by the next publish (_refresh_cache).
            try:
                _replace_cache(Path(cache_dir), ckpt, self.repo.manifest(result.version))
            except (OSError, DeltasyncError) as e:
                detail = e.strerror or str(e) if isinstance(e, OSError) else str(e)
                warning = (f"version {result.version} is published, but the publish cache {cache_dir} could not be "
                           f"refreshed ({detail}); the next publish brings it up to date")
                log.warning("%s", warning)
                result = result.with_warning(warning)
        return result

    def _refresh_cache(self, cache: Path, latest: int) -> Path:
        from ..local.state import read_local_state
        from ..pull.subscriber import Subscriber

        state = read_local_state(cache)
        if state is None or state.version != latest:
            # The cache is deltasync's own: files found in it that are not the version's go aside.
            Subscriber(self.repo, progress=self.config.progress).update_dir(cache, latest, move_aside=True)
        return cache

    def _dir_bases(self, reader: FileReader, root: Path, parent: ManifestInfo) -> dict[str, BaseTensor]:
        files = {f.path: f for f in parent.pb.files}
        out: dict[str, BaseTensor] = {}
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
            out[t.name] = BaseTensor(
                dtypes.element_width(t.dtype), t.nbytes, [c.target_digest for c in t.chunks],
                file_reader(reader, path, header_len + t.data_offset), verify=True,
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
        sources: list[SourceTensor],
        files: list[pb.File],
        bases: dict[str, BaseTensor],
        parent: int | None,
        version: int | None,
        metadata: Mapping[str, str] | None,
        *,
        blob_root: Path | None = None,
        keep: dict[str, Bits] | None = None,
        base_arrays: dict[str, Bits] | None = None,
        speculate: bool = False,
    ) -> PublishResult:
        """Round 1 of the commit order (docs/DESIGN.md): the repository marker (a first publish),
        then the lease put beside the read of the latest version; then encode and commit.

        With ``speculate`` (a state held in memory) round 1 runs *beside* the encoding instead
        of before it, so its round trips cost nothing over a long link: the encoding assumes
        the latest version is the publisher's own last one (``parent``; a publisher without
        one encodes a snapshot, which any latest version fits) and the commit waits for round
        1 and checks the assumption (:meth:`_confirm`). Wrong (another publisher committed
        meanwhile), what was uploaded is removed and the version is encoded again as a
        snapshot on the latest, as it would have been. Packs uploaded before the lease is
        written are unreferenced objects like any other: gc keeps them for its grace period,
        and the commit's check that every pack still exists (commit.py) stores again any it
        deleted."""
        start = time.monotonic()
        # A gc reads the lease and deletes no pack or blob until the commit (repo/leases.py).
        # It is written while the latest version is read (one round trip for both), and
        # released beside the commit's last requests (publish/commit.py).
        lease = Lease(self.repo.store, "publish of the next version")
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-round1") as pool:
            prepared = pool.submit(self._round1, lease)
            try:
                if speculate:
                    try:
                        return self._publish_leased(
                            lease, start, parent, sources, files, bases, parent, version, metadata,
                            blob_root=blob_root, keep=keep, base_arrays=base_arrays,
                            confirm=lambda draft, encoded: self._confirm(prepared, draft, encoded, version, parent))
                    except _Stale:
                        bases = {}  # the in-memory base is rewritten by now: a snapshot on the latest
                latest = prepared.result()
                return self._publish_leased(lease, start, latest, sources, files, bases, parent, version, metadata,
                                            blob_root=blob_root, keep=keep, base_arrays=base_arrays)
            finally:
                wait([prepared])  # the lease is released only once it is written (or failed)
                lease.release()

    def _round1(self, lease: Lease) -> int | None:
        """The repository marker (a first publish makes the store a repository; later: no
        request), then the lease written while the latest version is read: that version."""
        self.repo.create()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-lease") as pool:
            leased = pool.submit(lease.__enter__)
            try:
                return self.repo.latest()
            finally:
                leased.result()

    def _confirm(self, prepared: Future[int | None], draft: Draft, encoded: Encoded, version: int | None,
                 parent: int | None) -> Draft:
        """After a speculative encoding (see :meth:`_publish`): the draft to commit, once round 1
        is in. A snapshot without a base takes its id from the latest version read; a version
        encoded against ``parent`` needs ``parent`` to be the latest (else :class:`_Stale`).
        Either way what this attempt uploaded is removed when it cannot be committed."""
        try:
            latest = prepared.result()
            if parent is None:
                return replace(draft, version=_next_version(latest, version), latest=(latest,))
        except BaseException:
            abandon(self.repo.store, encoded)
            raise
        if latest != parent:
            abandon(self.repo.store, encoded)
            raise _Stale(latest)
        return draft

    def _publish_leased(
        self,
        lease: Lease,
        start: float,
        latest: int | None,
        sources: list[SourceTensor],
        files: list[pb.File],
        bases: dict[str, BaseTensor],
        parent: int | None,
        version: int | None,
        metadata: Mapping[str, str] | None,
        *,
        blob_root: Path | None = None,
        keep: dict[str, Bits] | None = None,
        base_arrays: dict[str, Bits] | None = None,
        confirm: _Confirm | None = None,
    ) -> PublishResult:
        # A speculative snapshot takes its id once the latest version is read (_confirm).
        version = _next_version(None if confirm is not None and parent is None else latest, version)
        if parent is not None and parent != latest:
            # Another publisher committed since our base: our bits are not the parent's.
            bases, parent = {}, latest
        if not signing_policy(self.repo, parent):
            bases = {}  # the first signed version after unsigned ones starts a signed chain

        limit: int | None = None
        if parent is not None and bases:
            chain = self.repo.chain(parent)
            if len(chain) < self.config.snapshot_every:
                limit = int(self.config.max_delta_fraction * chain[0].pb.stored_bytes)
        lease.what = f"publish of version {version}"  # in the lease from its next renewal
        blob_bytes = self._store_blobs(blob_root, files) if blob_root is not None else 0
        draft = Draft(version=version, parent=parent, snapshot=not bases, files=files, metadata=metadata,
                      blob_bytes=blob_bytes, start=start, latest=(latest,))
        source = _Source(sources, bases, keep, base_arrays, blob_root)
        if limit is not None:
            try:
                return self._attempt(draft, source, limit, lease, confirm)
            except DeltaTooLarge:
                pass  # store this version as a snapshot instead
        return self._attempt(replace(draft, snapshot=True), replace(source, bases={}), None, lease, confirm)

    def _attempt(self, draft: Draft, source: _Source, limit: int | None, lease: Lease,
                 confirm: _Confirm | None = None) -> PublishResult:
        # Over a writable relay that orders a manifest after the uploads it is receiving, the
        # last packs are still on their way when the commit sends the manifest (commit.py).
        encoded = encode(self.repo.store, self.config, source.tensors, draft.files, source.bases,
                         label=f"publish v{draft.version}", limit=limit, keep=source.keep, base_arrays=source.base_arrays,
                         overlap_commit=True)
        if confirm is not None:
            draft = confirm(draft, encoded)
            lease.what = f"publish of version {draft.version}"

        def restore(current: Encoded, missing: set[str]) -> Encoded:
            # Objects a concurrent gc deleted before the commit (commit.py docstring).
            if source.blob_root is not None:
                self._restore_blobs(source.blob_root, draft.files, missing)
            return restore_packs(self.repo.store, self.config, current, source.tensors, missing)

        return commit(self.repo, self.config, draft, encoded, restore=restore, lease=lease)

    def _restore_blobs(self, root: Path, files: list[pb.File], missing: set[str]) -> None:
        """Upload again the parts in ``missing`` of the blob ``files`` under ``root``."""
        for f in files:
            if f.kind != pb.File.BLOB or not any(blob_key(part) in missing for part in f.blob_parts):
                continue
            with open(root / f.path, "rb") as fh:
                for want in f.blob_parts:
                    part = fh.read(BLOB_PART_BYTES)
                    if digest(part) != want:
                        raise CheckpointError(str(root / f.path), "changed while publishing; publish again")
                    if blob_key(want) in missing:
                        self.repo.put_blob(part)


def _next_version(latest: int | None, version: int | None) -> int:
    """The id a publish commits: ``version`` (checked newer than ``latest``) or the next one."""
    if version is None:
        return (latest or 0) + 1
    if version < 1:
        raise UsageError(f"version ids start at 1, got {version}")
    if latest is not None and version <= latest:
        raise UsageError(f"version {version} is not newer than the latest version {latest}")
    return version


class _Stale(Exception):
    """A speculative encoding's parent is not the latest version (another publisher committed)."""

    def __init__(self, latest: int | None) -> None:
        super().__init__(f"the latest version is {latest}")
        self.latest = latest


#: Given a speculatively encoded draft and what it encoded: the draft to commit (Publisher._confirm).
_Confirm = Callable[[Draft, Encoded], Draft]


@dataclass(frozen=True)
class _Source:
    """Where one publish attempt reads from: the tensors, their bases (none: a snapshot), the
    in-memory copies it keeps and reads, and the directory holding its blob files."""

    tensors: list[SourceTensor]
    bases: dict[str, BaseTensor]
    keep: dict[str, Bits] | None
    base_arrays: dict[str, Bits] | None
    blob_root: Path | None


def _replace_cache(cache: Path, ckpt: CheckpointDir, info: ManifestInfo) -> None:
    """Make ``cache`` a local copy of the version just published from ``ckpt``."""
    from ..local.slots import install_staged
    from ..local.state import state_dir, write_local_state

    staging = state_dir(cache) / "incoming"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        for rel in ckpt.files:
            dest = staging / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ckpt.root / rel, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a partial copy only takes space (a full disk, say)
        raise
    install_staged(cache, staging, info)
    write_local_state(cache, info)



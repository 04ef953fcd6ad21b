"""Committing a version: the manifest last, after checking that what it names still exists.

Every producer of versions ends here: :class:`~deltasync.publish.Publisher`,
:class:`~deltasync.publish.distributed.DistributedPublisher` (rank 0 commits) and squashes
(which build manifests only). A version about to be committed is a :class:`Draft`;
:func:`build_manifest` turns it and its :class:`~deltasync.publish.encode.Encoded` tensors
into a manifest, :func:`commit` writes it (its presence is the commit), then the latest ref.
:func:`signing_policy` says whether a signing repository may extend a chain with a delta.

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

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, CommittedError, MissingReferencesError, StoreError
from ..format import dtypes
from ..format.codec import SAME, PlanesZstdCodec
from ..format.digest import digest, version_digest
from ..format.manifest import FORMAT, key_of, manifest_key
from ..repo.leases import Lease
from ..repo.repository import Repository, blob_key
from ..storage import Store
from ..v1 import manifest_pb2 as pb
from .config import PublisherConfig
from .encode import Encoded, SourceTensor, abandon, same_version, settle
from .packs import Packer
from .result import PublishResult

log = logging.getLogger("deltasync.publish")

#: How many times :func:`commit` checks for deleted objects (and stores them again) before
#: it gives up with nothing committed.
COMMIT_ATTEMPTS = 3
#: Given the version to commit and the keys of its missing objects, store them again;
#: returns the version to commit now.
Restore = Callable[[Encoded, set[str]], Encoded]


@dataclass(frozen=True, kw_only=True)
class Draft:
    """A version about to be committed: what its manifest says besides the encoded tensors."""

    version: int
    """The id it will have."""
    parent: int | None
    """The version it is a delta against (None: none; a snapshot may still name one)."""
    snapshot: bool
    """Stored self-contained (only full chunks)."""
    files: list[pb.File]
    """Its files (safetensors layouts and blobs); empty for a version of a state dict."""
    metadata: Mapping[str, str] | None
    """The producer's key/values."""
    blob_bytes: int
    """Bytes of blobs stored for it (added to the manifest's stored bytes)."""
    start: float
    """``time.monotonic()`` when its publish began (the result's ``seconds``)."""
    latest: tuple[int | None] | None = None
    """(the latest version,) as the publish listed it before encoding; None: not known. When
    the version is the one after it, the commit takes its history parent from it instead of
    listing the manifests again (Repository.commit)."""


def encoded_manifest(encoded: Encoded, *, stored_extra: int = 0, **fields: Any) -> pb.Manifest:
    """A manifest in the current format, created now, holding ``encoded`` (its tensors and packs,
    raw bytes, stored bytes plus ``stored_extra``); ``fields`` say the rest (version, kind,
    parent, snapshot, codec, files, metadata…). Commits and squashes both build theirs here."""
    return pb.Manifest(format=FORMAT, tensors=encoded.tensors, packs=encoded.packs, raw_bytes=encoded.raw,
                       stored_bytes=encoded.stored + stored_extra, created_unix=time.time(), **fields)


def build_manifest(repo: Repository, codec: PlanesZstdCodec, draft: Draft, encoded: Encoded) -> pb.Manifest:
    """The manifest of ``draft`` made of ``encoded``, version digest included."""
    version, parent, is_snapshot = draft.version, draft.parent, draft.snapshot
    manifest = encoded_manifest(
        encoded,
        version=version,
        kind=pb.SNAPSHOT if is_snapshot else pb.DELTA,
        parent=parent or 0,
        has_parent=parent is not None,
        snapshot=version if is_snapshot else repo.manifest(parent or 0).pb.snapshot,
        codec=pb.CodecSpec(name=codec.name, codec_version=codec.codec_version,
                           zstd_level=codec.zstd_level, chunk_bytes=codec.chunk_bytes,
                           full_zstd_level=codec.full_zstd_level),
        files=draft.files,
        stored_extra=draft.blob_bytes,
        metadata=dict(draft.metadata or {}),
    )
    manifest.version_digest = version_digest(c.target_digest for t in encoded.tensors for c in t.chunks)
    return manifest


def commit(repo: Repository, config: PublisherConfig, draft: Draft, encoded: Encoded,
           restore: Restore | None = None, lease: Lease | None = None) -> PublishResult:
    """Commit ``encoded`` as ``draft.version`` (manifest, then the latest ref), or, with
    ``config.skip_unchanged`` and nothing different from the parent, commit nothing.

    Every object the version names must still exist (module docstring): ``restore`` stores
    missing ones again; without it, or after :data:`COMMIT_ATTEMPTS` checks, StoreError.
    ``lease`` (the publish's) is released once the manifest is written, beside the ref update
    and the check after the commit (one round trip for the three), or by a writable relay that
    does all three itself as it writes the manifest (Repository.commit: no round trip after)."""
    version, parent, files, start = draft.version, draft.parent, draft.files, draft.start
    if config.skip_unchanged and parent is not None and same_version(
        repo.manifest(parent), files, encoded.tensors, draft.metadata
    ):
        abandon(repo.store, encoded)
        return PublishResult(parent, kind="unchanged", parent=parent, raw_bytes=encoded.raw, stored_bytes=0,
                             seconds=time.monotonic() - start)
    # Where the store itself refuses a manifest naming a missing object or parent (a writable
    # relay checks them beside the write: Store.checks_references), the check before the
    # commit is its manifest put: one round trip less. A refused put is followed by the check
    # here, which stores missing objects again (or fails naming them), and the put once more.
    by_store = repo.store.checks_references
    checked: list[list[str] | BaseException] = []
    while True:
        if not by_store:
            _settle_or_abandon(repo, encoded)
            encoded = _check_before_commit(repo, draft, encoded, restore)
        manifest = build_manifest(repo, config.codec, draft, encoded)

        # Once the manifest is written, the check that nothing it names was deleted at that
        # moment and the caller's after-commit work run beside the ref update
        # (Repository.commit's alongside).
        def check_after(encoded: Encoded = encoded) -> None:
            try:
                checked.append(missing_objects(repo.store, files, encoded))
            except BaseException as e:  # raised below, on the publisher's thread
                checked.append(e)

        renewals = lease.renewals if lease is not None else 0  # before the relay deletes it

        def checked_at_store(gone: list[str], renewals: int = renewals) -> None:  # the relay did all three
            checked.append(gone)
            if lease is not None:
                lease.forget(renewals)

        try:
            repo.commit(manifest, alongside=[check_after, *([lease.release] if lease is not None else [])],
                        known_latest=draft.latest, release=lease.key if lease is not None else None,
                        checked_at_store=checked_at_store)
        except MissingReferencesError as e:
            if not by_store:
                raise
            if encoded.uploading:
                # Sent while the last packs were on their way (Store.orders_references): one
                # whose upload had not begun at the relay was missing to its check. Once they
                # are all stored (or one failed: raised here), the put goes again.
                log.debug("version %d: the manifest went ahead of a pack (%s); again once they are stored", version, e)
                _settle_or_abandon(repo, encoded)
                continue
            log.info("version %d: the manifest put was refused (%s); checking what it names", version, e)
            by_store = False
            continue
        except BaseException:
            _settle_or_abandon(repo, encoded)  # a failed upload is the cause to report, if there is one
            raise
        break
    try:
        settle(encoded)  # stored: the relay found every pack it names there
    except Exception as e:  # (an upload whose answer was lost, say): the version is committed as checked
        log.debug("version %d: an upload failed after its pack was found stored: %s", version, e)
    result = checked[0] if checked else missing_objects(repo.store, files, encoded)
    if isinstance(result, BaseException):
        raise result
    gone = result
    if gone:
        # gc deleted it between the check above and the manifest write: say so, loudly.
        raise CommittedError(version, f"version {version} was committed but {_some(gone)} was deleted by a concurrent gc at that "
                         "moment: it cannot be pulled; `deltasync verify` names it, and the next version should be "
                         "published as a snapshot (--no-cache)")
    return PublishResult(version, kind="snapshot" if draft.snapshot else "delta", parent=parent, raw_bytes=encoded.raw,
                         stored_bytes=manifest.stored_bytes, seconds=time.monotonic() - start)


def _settle_or_abandon(repo: Repository, encoded: Encoded) -> None:
    """Wait for the uploads ``encoded`` has still going; one failed: what it uploaded is
    removed (nothing is committed) and the failure raised, as when encoding waited for them."""
    try:
        settle(encoded)
    except BaseException:
        abandon(repo.store, encoded)
        raise


def _check_before_commit(repo: Repository, draft: Draft, encoded: Encoded, restore: Restore | None) -> Encoded:
    """Round 2 of the commit order: every pack and blob ``encoded`` names, and the parent's
    manifest, still exist (one round trip for all); missing objects are stored again
    (``restore``) and checked again, up to :data:`COMMIT_ATTEMPTS` times. The version to commit."""
    version, parent = draft.version, draft.parent
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-check-parent") as pool:
        parent_there = pool.submit(repo.store.exists, manifest_key(parent)) if not draft.snapshot and parent else None
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            missing = missing_objects(repo.store, draft.files, encoded)
            if not missing:
                break
            if restore is None or attempt == COMMIT_ATTEMPTS:
                raise deleted_error(version, missing, attempt)
            log.warning("version %d: %s deleted before the commit (a gc with a --grace shorter than this publish?); "
                        "storing it again (attempt %d of %d)", version, _some(missing), attempt + 1, COMMIT_ATTEMPTS)
            encoded = restore(encoded, set(missing))
            if parent_there is not None:
                parent_there = pool.submit(repo.store.exists, manifest_key(parent or 0))  # after the restore
        if parent_there is not None and not parent_there.result():
            raise StoreError(f"version {version} not committed: its parent version {parent} was deleted while "
                             "publishing (gc); nothing of it is visible, publish again (it will be a snapshot)")
    return encoded


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
    with ThreadPoolExecutor(max_workers=min(64, len(keys)), thread_name_prefix="deltasync-check") as pool:
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
    packer = Packer(store, config.pack_bytes, first_pack=len(kept))
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
                packer.place(payload.payload, c)
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
    signed version after unsigned ones is a snapshot (False); likewise the first signed version
    naming the repository's identity after versions that name none. Publishing unsigned after signed
    versions is allowed but warned about: trusting subscribers will refuse it and every delta
    on top of it until the next signed snapshot."""
    if parent is None:
        return True
    if repo.signing_key is None:
        if repo.manifest(parent).pb.signature:
            log.warning("publishing an unsigned version after signed ones (version %d is signed): subscribers with "
                        "--trusted-key refuse it and the deltas on top of it until a signed snapshot", parent)
        return True
    chain = repo.chain(parent)
    unsigned = [info.version for info in chain if not info.pb.signature]
    if unsigned:
        log.info("this version is stored as a snapshot: it starts a signed chain (version %d, on the chain it would "
                 "extend, is unsigned)", unsigned[-1])
        return False
    # Nor a chain of versions that name no repository (committed before identities): a chain
    # is of one repository throughout (repo/repository.py, Identity).
    nameless = [info.version for info in chain if not info.pb.repository_id]
    if nameless and repo.identity() is not None:
        log.info("this version is stored as a snapshot: it starts a chain bound to the repository's identity "
                 "(version %d, on the chain it would extend, was committed before identities)", nameless[-1])
        return False
    return True

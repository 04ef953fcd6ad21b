"""A repository: the layout of versions inside a Store, and the commit protocol.

Layout (all keys relative to the store root)::

    deltasync.json                  format marker, written once
    packs/<xxh3-128>.pack           immutable, content-addressed encoded chunks
    blobs/<xxh3-128>                zstd of one part of a non-tensor file, content-addressed
    manifests/<version:020d>.pb     one per committed version: its presence is the commit
    squashes/<C:020d>-<A:020d>.pb   optional: version C as a delta against version A (see squash.py)
    refs/latest                     the newest committed version id (a hint; manifests rule)
    refs/pin                        optional: the version subscribers should serve instead (see pin)

Commit order (DESIGN.md invariant 2): packs and blobs, then the manifest with a conditional
put, then ``refs/latest``. A reader only trusts versions whose manifest exists.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable

import zstandard

from ..errors import (
    CorruptObjectError,
    EmptyRepositoryError,
    ObjectExistsError,
    ObjectNotFoundError,
    RepositoryFormatError,
    RepositoryNotFoundError,
    SignatureError,
    UsageError,
    VersionConflictError,
    VersionNotFoundError,
)
from ..format.codec import FULL
from ..format.digest import digest
from ..format.manifest import (
    BLOB_PART_SIZE,
    MAX_MANIFEST_BYTES,
    ManifestInfo,
    key_of,
    manifest_key,
    parse_manifest,
    serialize,
    version_from_key,
)
from ..format.signing import PrivateKeyLike, PublicKeyLike, TrustedKeys, load_signing_key, sign_manifest
from ..storage import Store, open_store
from ..v1 import manifest_pb2 as pb

REPO_FORMAT = 1
MARKER = "deltasync.json"
LATEST = "refs/latest"
PIN = "refs/pin"
BLOB_PART_BYTES = BLOB_PART_SIZE  # bytes of every part of a non-tensor file but its last
MAX_MARKER_BYTES = 4096  # deltasync.json is '{"format": 1}': anything much larger is not one


def blob_key(d: bytes) -> str:
    return f"blobs/{d.hex()}"


SQUASHES = "squashes/"


def squash_key(a: int, c: int) -> str:
    """Key of the squash that takes version ``a`` to version ``c``."""
    return f"{SQUASHES}{c:020d}-{a:020d}.pb"


def squash_from_key(key: str) -> tuple[int, int] | None:
    """(a, c) of a squash key, or None for any other key."""
    m = re.fullmatch(r"squashes/(\d{20})-(\d{20})\.pb", key)
    return (int(m.group(2)), int(m.group(1))) if m else None


def open_repository(
    repo: Store | str | Repository,
    *,
    signing_key: PrivateKeyLike | None = None,
    trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
) -> Repository:
    """``repo`` as a Repository with these keys (a Repository passed in keeps its own)."""
    if isinstance(repo, Repository):
        if signing_key is not None or trusted_keys is not None:
            raise UsageError("give signing_key / trusted_keys to the Repository, not alongside it")
        return repo
    return Repository(repo, signing_key=signing_key, trusted_keys=trusted_keys)


class Repository:
    """Versions in a store. Safe for one publisher and many concurrent readers."""

    def __init__(
        self,
        store: Store | str,
        *,
        signing_key: PrivateKeyLike | None = None,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
    ) -> None:
        """``signing_key`` (an ed25519 key or its PEM file) signs every manifest committed here.
        With ``trusted_keys`` (one or several: key rotation; none or empty: no check) a manifest
        is refused with SignatureError unless one of them signed it, before it is used."""
        self.store = open_store(store) if isinstance(store, str) else store
        self.url = self.store.url
        self.signing_key = load_signing_key(signing_key) if signing_key is not None else None
        trusted = TrustedKeys.of(trusted_keys) if trusted_keys is not None else None
        self.trusted_keys = trusted or None
        self._manifests: dict[int, ManifestInfo] = {}
        self._squashes: dict[tuple[int, int], ManifestInfo] = {}
        self._lock = threading.Lock()

    # -- existence ---------------------------------------------------------------------------

    def exists(self) -> bool:
        return self.store.exists(MARKER)

    def ensure_exists(self) -> None:
        """Raise RepositoryNotFoundError / RepositoryFormatError unless this is a repository."""
        try:
            raw = self.store.get(MARKER, max_bytes=MAX_MARKER_BYTES)
        except ObjectNotFoundError:
            raise RepositoryNotFoundError(self.url) from None
        try:
            fmt = json.loads(raw)["format"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise CorruptObjectError(MARKER, "not a deltasync repository marker") from None
        if fmt != REPO_FORMAT:
            raise RepositoryFormatError(f"repository {self.url} has format {fmt}; this deltasync reads {REPO_FORMAT}")

    def create(self) -> None:
        """Mark the store as a repository (idempotent)."""
        try:
            self.store.put(MARKER, json.dumps({"format": REPO_FORMAT}).encode(), if_absent=True)
        except ObjectExistsError:
            self.ensure_exists()

    # -- versions ----------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Committed version ids, ascending."""
        out = [v for k in self.store.list("manifests/") if (v := version_from_key(k)) is not None]
        return sorted(out)

    def latest(self) -> int | None:
        """The newest committed version, or None for an empty repository."""
        try:
            hint = int(self.store.get(LATEST).decode().strip())
        except (ObjectNotFoundError, ValueError, UnicodeDecodeError):
            hint = 0
        # The ref is a hint: a publisher may die between manifest and ref. Manifests rule.
        versions = self.versions()
        newest = versions[-1] if versions else None
        if newest is None:
            return None
        return max(newest, hint) if hint in versions else newest

    # -- the pin: which version following subscribers serve ---------------------------------

    def pinned(self) -> int | None:
        """The pinned version, or None when subscribers follow the latest."""
        try:
            raw = self.store.get(PIN)
        except ObjectNotFoundError:
            return None
        try:
            text = raw.decode().strip()
            return int(text) if text else None
        except (UnicodeDecodeError, ValueError):
            raise CorruptObjectError(PIN, f"not a version id: {raw[:40]!r}") from None

    def pin(self, version: int | None) -> None:
        """Make following subscribers serve ``version`` (a committed one), forward or back,
        e.g. after an evaluation gate failed; None clears the pin: they follow the latest again."""
        if version is None:
            self.store.delete(PIN)
            return
        self.ensure_exists()
        self.manifest(version)  # only a committed version can be pinned
        self.store.put(PIN, f"{version}\n".encode())

    def manifest(self, version: int) -> ManifestInfo:
        """The validated manifest of ``version`` (cached: versions are immutable)."""
        with self._lock:
            cached = self._manifests.get(version)
        if cached is not None:
            return cached
        try:
            raw = self.store.get(manifest_key(version), max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            if not self.exists():
                raise RepositoryNotFoundError(self.url) from None
            raise VersionNotFoundError(version, self.url) from None
        info = parse_manifest(raw, expect_version=version, authenticate=self._authenticator(version))
        with self._lock:
            self._manifests[version] = info
        return info

    def _authenticator(self, version: int) -> Callable[[pb.Manifest], None] | None:
        trusted = self.trusted_keys
        if trusted is None:
            return None
        return lambda m: trusted.verify(m, version)

    def resolve(self, version: int | None) -> int:
        """``version``, or the latest when None; raises if there is none."""
        self.ensure_exists()
        if version is None:
            latest = self.latest()
            if latest is None:
                raise EmptyRepositoryError(self.url)
            return latest
        self.manifest(version)
        return version

    def chain(self, version: int, *, stop_at: int | None = None) -> list[ManifestInfo]:
        """Manifests from the nearest snapshot (or ``stop_at``) up to ``version``, oldest first."""
        out: list[ManifestInfo] = []
        v: int | None = version
        while v is not None:
            try:
                info = self.manifest(v)
            except SignatureError as e:
                if v == version:
                    raise
                raise SignatureError(
                    version, f"its delta chain goes through version {v}: {e.detail}; a signed chain starts at a signed "
                    "snapshot (the first version published with a signing key after unsigned ones is one)"
                ) from None
            out.append(info)
            if info.is_snapshot or v == stop_at:
                break
            v = info.parent
            if v is None:
                raise CorruptObjectError(f"manifest {info.version}", "delta chain ends without a snapshot")
        out.reverse()
        return out

    def commit(self, manifest: pb.Manifest) -> ManifestInfo:
        """Commit a version whose packs and blobs are already durable.

        Of racing publishers of the same id exactly one succeeds; the others get
        VersionConflictError and nothing of theirs becomes visible.
        """
        if self.signing_key is not None:
            sign_manifest(manifest, self.signing_key)
        data = serialize(manifest)
        # Never commit what we can't read (a signer not among our own trusted keys included).
        info = parse_manifest(data, expect_version=manifest.version, authenticate=self._authenticator(manifest.version))
        try:
            self.store.put(manifest_key(manifest.version), data, if_absent=True)
        except ObjectExistsError:
            raise VersionConflictError(manifest.version) from None
        with self._lock:
            self._manifests[manifest.version] = info
        latest = self.latest()
        if latest is None or manifest.version >= latest:
            self.store.put(LATEST, f"{manifest.version}\n".encode())
        return info

    # -- squashes: extra edges A -> C of the version graph, never commits ---------------------

    def squashes(self) -> list[tuple[int, int]]:
        """(a, c) of every stored squash, by c then a (endpoints may since have been deleted)."""
        found = [ac for k in self.store.list(SQUASHES) if (ac := squash_from_key(k)) is not None and ac[0] < ac[1]]
        return sorted(found, key=lambda ac: (ac[1], ac[0]))

    def squash(self, a: int, c: int) -> ManifestInfo:
        """The validated squash ``a`` -> ``c`` (cached). Besides what every manifest is checked
        for (and its signature, with trusted keys), it must be a delta from ``a`` whose tensors
        and chunk digests are exactly those of committed version ``c``, and whose every chunk
        stored against a base names the digest of that chunk in committed version ``a``."""
        with self._lock:
            cached = self._squashes.get((a, c))
        if cached is not None:
            return cached
        key = squash_key(a, c)
        try:
            raw = self.store.get(key, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            raise CorruptObjectError(f"squash {a}->{c}", f"{key} is missing") from None
        try:
            info = parse_manifest(raw, expect_version=c, authenticate=self._authenticator(c))
        except CorruptObjectError as e:
            raise CorruptObjectError(f"squash {a}->{c}", e.detail) from None
        except SignatureError as e:
            raise SignatureError(c, f"squash {a}->{c}: {e.detail}") from None
        _check_squash(info, self.manifest(a), self.manifest(c))
        with self._lock:
            self._squashes[(a, c)] = info
        return info

    def put_squash(self, manifest: pb.Manifest) -> ManifestInfo:
        """Store a squash whose packs are already durable (signed like a commit). Raises
        ObjectExistsError when one is stored for the same pair already (it stays: any valid
        one serves)."""
        a, c = manifest.parent, manifest.version
        if self.signing_key is not None:
            sign_manifest(manifest, self.signing_key)
        data = serialize(manifest)
        info = parse_manifest(data, expect_version=c, authenticate=self._authenticator(c))
        _check_squash(info, self.manifest(a), self.manifest(c))
        self.store.put(squash_key(a, c), data, if_absent=True)
        with self._lock:
            self._squashes[(a, c)] = info
        return info

    # -- blobs -------------------------------------------------------------------------------

    def put_blob(self, data: bytes) -> tuple[bytes, int]:
        """Store one part of a non-tensor file; returns (digest, stored bytes written)."""
        d = digest(data)
        key = blob_key(d)
        if self.store.exists(key):
            return d, 0  # deduplicated across versions
        packed = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)
        self.store.put(key, packed)
        return d, len(packed)

    def get_blob(self, d: bytes, *, max_size: int = BLOB_PART_BYTES) -> bytes:
        key = blob_key(d)
        # Read no more than a part of max_size bytes compresses to at worst.
        packed = self.store.get(key, max_bytes=_zstd_bound(max_size))
        try:
            size = zstandard.frame_content_size(packed)
            if size < 0 or size > max_size:
                raise CorruptObjectError(key, f"blob claims {size} bytes (at most {max_size} expected)")
            data = zstandard.ZstdDecompressor().decompress(packed, max_output_size=max_size)
        except zstandard.ZstdError as e:
            raise CorruptObjectError(key, f"cannot decompress ({e})") from None
        if digest(data) != d:
            raise CorruptObjectError(key, "blob content does not match its digest")
        return data


def _zstd_bound(size: int) -> int:
    """The most bytes a zstd frame of ``size`` content bytes takes (ZSTD_COMPRESSBOUND plus
    the frame header), so a stored blob part is never read beyond what it can hold."""
    return size + (size >> 7) + (64 << 10)


def _check_squash(info: ManifestInfo, base: ManifestInfo, target: ManifestInfo) -> None:
    """A squash must rebuild exactly ``target`` (same entries, same chunk digests) from
    ``base``: every chunk not stored in full is a change of ``base``'s chunk."""
    a = base.version
    what = f"squash {a}->{target.version}"
    if info.is_snapshot or info.parent != a:
        raise CorruptObjectError(what, f"is not a delta from version {a}")
    base_entries = base.entries()
    if info.pb.version_digest != target.pb.version_digest or len(info.pb.tensors) != len(target.pb.tensors):
        raise CorruptObjectError(what, f"does not describe the chunks of version {target.version}")
    for mine, theirs in zip(info.pb.tensors, target.pb.tensors, strict=True):
        if (
            (mine.name, mine.dtype, mine.nbytes) != (theirs.name, theirs.dtype, theirs.nbytes)
            or list(mine.shape) != list(theirs.shape)
            or list(mine.slice_offsets) != list(theirs.slice_offsets)
            or [c.target_digest for c in mine.chunks] != [c.target_digest for c in theirs.chunks]
        ):
            raise CorruptObjectError(what, f"tensor {mine.name!r} differs from version {target.version}")
        held = base_entries.get(key_of(mine))
        held_digests = [c.target_digest for c in held.chunks] if held is not None else []
        for idx, c in enumerate(mine.chunks):
            if c.encoding != FULL and (idx >= len(held_digests) or held_digests[idx] != c.base_digest):
                raise CorruptObjectError(what, f"tensor {mine.name!r} chunk {idx} has a base that version {a} does not hold")

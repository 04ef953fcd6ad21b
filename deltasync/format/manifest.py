"""Manifests: (de)serialisation and validation of everything read from a store.

A manifest from a store or the network is untrusted: :func:`parse_manifest` checks sizes,
counts, shapes, dtypes, chunk layout, digests and file names before anything uses it, so a
hostile manifest cannot exhaust memory or name a path outside the output directory.

Every byte of a stored manifest is covered by its ``manifest_digest`` (xxh3-128 of the
manifest serialized deterministically with that field cleared, set by :func:`seal` last,
after signing). Only the fields numbered above it follow it in the stored bytes
(``repository_id`` and the history fields, which this reader serializes alone to know them:
``_after_digest``): a reader hashes every stored byte before it, as stored (a changed byte
that would parse to the same message is still a changed byte), and those after it, before
validating, so a flipped byte cannot rename a file or a tensor unnoticed. (Fields a newer
writer added would follow too: then the reader's own serialization must equal the stored
bytes, and the digest is checked over it.)
A manifest without the digest is refused: every deltasync that ever released wrote it, so
one without it is damaged or forged (cutting the field off must not turn the check off).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from ..errors import CorruptObjectError
from ..v1 import manifest_pb2 as v1pb
from . import dtypes
from .codec import DENSE, FULL, SAME, SPARSE, PlanesZstdCodec, codec_from_spec
from .digest import DIGEST_SIZE, StreamDigest, digest, version_digest
from .slices import entry_key, intersect

FORMAT = 1

#: Upper bounds that a valid manifest stays under; anything larger is refused as hostile.
#: Together they bound what reading and validating one manifest costs (time and memory in
#: proportion to its bytes, which are read only up to MAX_MANIFEST_BYTES) and what pulling it
#: may allocate, read and write (chunk and payload sizes, pack ranges, file sizes).
MAX_MANIFEST_BYTES = 64 << 20  # about 900k chunks: 3.5 TiB of weights in 4 MiB chunks
MAX_TENSORS = 1 << 18  # the largest MoE checkpoints hold ~150k; a pull costs ~1 kB per tensor
MAX_CHUNKS = 2_000_000
MAX_PACKS = 1_000_000
MAX_PACK_BYTES = 1 << 36  # 64 GiB; packs close at pack_bytes (64 MiB by default)
MAX_TENSOR_BYTES = 1 << 44  # 16 TiB
MAX_VERSION_BYTES = 1 << 46  # 64 TiB: all tensors, and all files, of one version
MAX_DIMS = 64
MAX_HEADER_BYTES = 100 << 20
MAX_FILES = 100_000
BLOB_PART_SIZE = 64 << 20
"""Most bytes of one blob part of a non-tensor file (the publisher's split)."""

_SEGMENT = re.compile(r"^[^/\\\x00]+$")
_PACK_KEY = re.compile(r"packs/[0-9a-f]{32}\.pack")


def manifest_key(version: int) -> str:
    return f"manifests/{version:020d}.pb"


def version_from_key(key: str) -> int | None:
    m = re.fullmatch(r"manifests/(\d{20})\.pb", key)
    return int(m.group(1)) if m else None


def check_relpath(path: str) -> str:
    """A relative '/'-separated path that stays inside its directory."""
    if not path or path.startswith("/") or len(path) > 4096:
        raise CorruptObjectError("manifest", f"unsafe file path {path!r}")
    for seg in path.split("/"):
        if seg in ("", ".", "..") or not _SEGMENT.match(seg) or seg.startswith(".deltasync"):
            raise CorruptObjectError("manifest", f"unsafe file path {path!r}")
    return path


@dataclass(frozen=True)
class ManifestInfo:
    """Validated manifest plus the codec it names."""

    pb: v1pb.Manifest
    codec: PlanesZstdCodec

    @property
    def version(self) -> int:
        return self.pb.version

    @property
    def parent(self) -> int | None:
        return self.pb.parent if self.pb.has_parent else None

    @property
    def is_snapshot(self) -> bool:
        return self.pb.kind == v1pb.SNAPSHOT

    def entries(self) -> dict[str, v1pb.Tensor]:
        """Tensor entries by key: the name, or name and offsets for slices (see ``key_of``)."""
        return {key_of(t): t for t in self.pb.tensors}

    def chunk_digests(self) -> list[bytes]:
        return [c.target_digest for t in self.pb.tensors for c in t.chunks]


def key_of(t: v1pb.Tensor) -> str:
    return entry_key(t.name, t.slice_offsets)


def serialize(manifest: v1pb.Manifest) -> bytes:
    return manifest.SerializeToString(deterministic=True)


def _digest_payload(manifest: v1pb.Manifest) -> bytes:
    """The bytes ``manifest_digest`` covers: the deterministic serialization without it."""
    whole = manifest.manifest_digest
    manifest.ClearField("manifest_digest")
    try:
        return serialize(manifest)
    finally:
        if whole:
            manifest.manifest_digest = whole


def seal(manifest: v1pb.Manifest) -> bytes:
    """Set ``manifest_digest`` (after any signature: it covers the signature too) and return
    the bytes to store. Anything that changes the manifest afterwards must seal it again."""
    manifest.manifest_digest = digest(_digest_payload(manifest))
    return serialize(manifest)


#: How field 18 (manifest_digest, 16 bytes) is encoded: tag, length, digest.
_DIGEST_FIELD = b"\x92\x01\x10"


def _after_digest(m: v1pb.Manifest) -> bytes:
    """The bytes a deterministic serialization of ``m`` puts after ``manifest_digest``: the
    fields numbered above it that this reader knows (repository_id and the history fields),
    serialized alone, which encodes them exactly as they follow it in the whole message."""
    return serialize(v1pb.Manifest(repository_id=m.repository_id, history_parent=m.history_parent,
                                   history_parent_digest=m.history_parent_digest, history_digest=m.history_digest))


_HISTORY_PERSON = b"deltasync-hist1"


def history_digest(parent_history: bytes, version: int, version_digest: bytes, repository_id: bytes) -> bytes:
    """A version's history digest: BLAKE2b-128 over the history digest of the version committed
    before it (empty: none, or one without), its id, version digest and repository identity.
    Cumulative, so equal history digests mean equal histories back to where they began; and
    cryptographic, not xxh3, because gc's records of deleted versions (repo/history.py) are
    not signed: a follower recomputes each link, and a store writer must not be able to make
    one up that lands on a signed value."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_HISTORY_PERSON)
    for part in (parent_history, version.to_bytes(8, "little"), version_digest, repository_id):
        h.update(len(part).to_bytes(1, "little"))
        h.update(part)
    return h.digest()


def seal_history(manifest: v1pb.Manifest, parent: int | None, parent_history: bytes) -> None:
    """Set ``manifest``'s history fields: it follows version ``parent`` (None: the first),
    whose history digest is ``parent_history``. After ``version_digest`` and
    ``repository_id``, before signing."""
    manifest.history_parent = parent or 0
    manifest.history_parent_digest = parent_history if parent is not None else b""
    manifest.history_digest = history_digest(manifest.history_parent_digest, manifest.version,
                                             manifest.version_digest, manifest.repository_id)


def _check_whole(m: v1pb.Manifest, data: bytes) -> None:
    """Every stored byte is what the digest covers (see the module doc): one digest pass over
    ``data``, no copy of the message (manifests run to tens of MiB)."""
    whole = m.manifest_digest
    if not whole:
        raise _fail("it has no whole-manifest digest (cut off, or never sealed)")
    if len(whole) != DIGEST_SIZE:
        raise _fail("bad whole-manifest digest length")
    view = memoryview(data)
    # Fields numbered above it come after it in a deterministic serialization: of those this
    # reader knows, repository_id (19) and the history fields (20-22).
    after = _after_digest(m)
    tail = len(_DIGEST_FIELD) + DIGEST_SIZE + len(after)
    if len(view) >= tail and view[len(view) - tail:] == _DIGEST_FIELD + whole + after:
        # What it covers is every stored byte but its own: hashed as stored, no re-serialization.
        h = StreamDigest()
        h.update(view[: len(view) - tail])
        h.update(after)
        covered = h.digest()
    else:
        # Fields this reader does not know follow it (a newer writer): what it covers is
        # then our serialization without it, which must be exactly the stored bytes.
        if serialize(m) != data:
            raise _fail("stored bytes are not the manifest's canonical serialization (altered)")
        covered = digest(_digest_payload(m))
    if covered != whole:
        raise _fail("whole-manifest digest does not match its bytes (altered)")


def parse_manifest(
    data: bytes,
    *,
    expect_version: int | None = None,
    authenticate: Callable[[v1pb.Manifest], None] | None = None,
) -> ManifestInfo:
    """Parse and validate; raises CorruptObjectError naming the first problem found.

    ``authenticate`` (a signature check) sees the parsed message before any validation, so
    with a trusted key configured only manifests from that key are ever looked at further.
    Then the stored bytes are checked against the whole-manifest digest (module doc), then
    everything else.
    """
    what = f"manifest {expect_version}" if expect_version is not None else "manifest"
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptObjectError(what, f"{len(data)} bytes is larger than any valid manifest")
    m = v1pb.Manifest()
    try:
        m.ParseFromString(data)
    except DecodeError as e:
        raise CorruptObjectError(what, f"cannot parse ({e})") from None
    if authenticate is not None:
        authenticate(m)
    try:
        _check_whole(m, data)
        return _validate(m, expect_version)
    except CorruptObjectError as e:
        raise CorruptObjectError(what, e.detail) from None


def _fail(detail: str) -> CorruptObjectError:
    return CorruptObjectError("manifest", detail)


def _validate(m: v1pb.Manifest, expect_version: int | None) -> ManifestInfo:
    if m.format == 0 or m.format > FORMAT:
        raise _fail(f"format {m.format} is not supported by this deltasync (supports {FORMAT})")
    if expect_version is not None and m.version != expect_version:
        raise _fail(f"claims version {m.version}")
    if m.version == 0:
        raise _fail("version 0 is not a valid version id")
    if m.kind not in (v1pb.SNAPSHOT, v1pb.DELTA):
        raise _fail(f"unknown version kind {m.kind}")
    if m.has_parent and m.parent >= m.version:
        raise _fail(f"parent {m.parent} is not older than version {m.version}")
    if m.kind == v1pb.DELTA and not m.has_parent:
        raise _fail("delta without a parent")
    if m.snapshot > m.version or (m.kind == v1pb.SNAPSHOT and m.snapshot != m.version):
        raise _fail(f"bad nearest snapshot {m.snapshot}")
    if len(m.signature) not in (0, 64) or len(m.signing_key_id) not in (0, 8):  # ed25519; see signing.py
        raise _fail("bad signature or signing key id length")
    _validate_history(m)
    c = m.codec
    codec = codec_from_spec(c.name, c.codec_version, c.zstd_level, c.chunk_bytes, c.full_zstd_level)
    if len(m.tensors) > MAX_TENSORS or len(m.files) > MAX_FILES or len(m.packs) > MAX_PACKS:
        raise _fail(
            f"{len(m.tensors)} tensors, {len(m.files)} files and {len(m.packs)} packs: more than a manifest may hold "
            f"({MAX_TENSORS}, {MAX_FILES}, {MAX_PACKS})"
        )
    pack_sizes = [p.size for p in m.packs]
    for p in m.packs:
        if not _PACK_KEY.fullmatch(p.key):
            raise _fail(f"bad pack key {p.key!r}")
        if p.size > MAX_PACK_BYTES:
            raise _fail(f"pack {p.key} claims {p.size} bytes, more than any pack holds ({MAX_PACK_BYTES})")
    file_bytes = 0
    files: dict[str, v1pb.File] = {}
    for f in m.files:
        check_relpath(f.path)
        if f.path in files:
            raise _fail(f"file {f.path!r} listed twice")
        files[f.path] = f
        if len(f.digest) != DIGEST_SIZE:
            raise _fail(f"file {f.path!r} has a bad digest")
        if f.kind == v1pb.File.SAFETENSORS:
            if not 8 <= len(f.header) <= MAX_HEADER_BYTES or int.from_bytes(f.header[:8], "little") != len(f.header) - 8:
                raise _fail(f"file {f.path!r} has a bad header size")
        elif f.kind == v1pb.File.BLOB:
            # Parts hold 1 to BLOB_PART_SIZE bytes each, so the size bounds how many there can
            # be; a pull checks each part against what is left of the size before writing it.
            if not -(-f.size // BLOB_PART_SIZE) <= len(f.blob_parts) <= f.size:
                raise _fail(f"file {f.path!r} of {f.size} bytes lists {len(f.blob_parts)} blob parts")
            if any(len(d) != DIGEST_SIZE for d in f.blob_parts):
                raise _fail(f"file {f.path!r} has a bad blob digest")
        else:
            raise _fail(f"file {f.path!r} has unknown kind {f.kind}")
        file_bytes += f.size
        if file_bytes > MAX_VERSION_BYTES:
            raise _fail(f"files of more than {MAX_VERSION_BYTES} bytes in all")
    raw = 0
    chunks = 0
    names: set[str] = set()
    for t in m.tensors:
        chunks += _validate_tensor(t, codec, files, pack_sizes, names, is_snapshot=m.kind == v1pb.SNAPSHOT)
        raw += t.nbytes
        if chunks > MAX_CHUNKS or raw > MAX_VERSION_BYTES:
            raise _fail(f"more than {MAX_CHUNKS} chunks or {MAX_VERSION_BYTES} bytes of tensors")
    if raw != m.raw_bytes:
        raise _fail(f"raw_bytes {m.raw_bytes} does not match the tensors ({raw})")
    _validate_layout(m, files)
    _validate_headers(m)
    _validate_slice_sets(m)
    info = ManifestInfo(m, codec)
    if version_digest(info.chunk_digests()) != m.version_digest:
        raise _fail("version digest does not match its chunk digests")
    return info


def _validate_history(m: v1pb.Manifest) -> None:
    """The history fields are absent (a version from before them) or consistent: a parent
    older than the version, digests of the right size, and the version's history digest
    recomputed from the others (a follower compares digests it did not compute)."""
    if not m.history_digest:
        if m.history_parent or m.history_parent_digest:
            raise _fail("history fields without a history digest")
        return
    if len(m.history_digest) != DIGEST_SIZE or len(m.history_parent_digest) not in (0, DIGEST_SIZE):
        raise _fail("bad history digest length")
    if m.history_parent >= m.version or (not m.history_parent and m.history_parent_digest):
        raise _fail(f"history parent {m.history_parent} is not an older version")
    if history_digest(m.history_parent_digest, m.version, m.version_digest, m.repository_id) != m.history_digest:
        raise _fail("history digest does not match its fields")


def _validate_layout(m: v1pb.Manifest, files: dict[str, v1pb.File]) -> None:
    """Files and directories do not collide; in a version of files every tensor is in one,
    and the tensors of each file tile its data section in manifest order (the order a pull
    streams the file's digest in), so a file written as described matches its digest."""
    paths = sorted(p.split("/") for p in files)  # the files under a directory follow it
    for a, b in itertools.pairwise(paths):
        if b[: len(a)] == a:
            raise _fail(f"file {'/'.join(a)!r} is also a directory")
    ends: dict[str, int] = {}
    for t in m.tensors:
        if files and not t.file:
            raise _fail(f"tensor {t.name!r} is in no file")
        if t.file:
            end = ends.get(t.file, 0)
            if t.data_offset != end:
                raise _fail(f"tensor {t.name!r} is at {t.data_offset} in {t.file!r}, expected {end}")
            ends[t.file] = end + t.nbytes
    for f in m.files:
        if f.kind == v1pb.File.SAFETENSORS and f.size != len(f.header) + ends.get(f.path, 0):
            raise _fail(f"file {f.path!r} has size {f.size}, its header and tensors make {len(f.header) + ends.get(f.path, 0)}")


def _validate_headers(m: v1pb.Manifest) -> None:
    by_file: dict[str, list[v1pb.Tensor]] = {}
    for t in m.tensors:
        if t.file:
            by_file.setdefault(t.file, []).append(t)
    for f in m.files:
        if f.kind == v1pb.File.SAFETENSORS:
            check_header(f, by_file.get(f.path, ()))


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key is listed twice")  # loaders disagree on which one wins
    return out


def check_header(f: v1pb.File, tensors: Iterable[v1pb.Tensor]) -> None:
    """Raise CorruptObjectError unless safetensors file ``f``'s verbatim header describes
    exactly ``tensors`` (its manifest entries): same names, dtypes, shapes and data offsets.
    A pull writes the header as stored, so a header at odds with the chunk layout would
    make a loader read other tensors than the ones verified."""
    where = f"file {f.path!r}"
    try:
        meta = json.loads(f.header[8:], object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _fail(f"{where}: its safetensors header is not valid JSON") from None
    if not isinstance(meta, dict):
        raise _fail(f"{where}: its safetensors header is not a JSON object")
    entries = {k: v for k, v in meta.items() if k != "__metadata__"}
    mine = {t.name: t for t in tensors}
    if entries.keys() != mine.keys():
        odd = sorted(entries.keys() ^ mine.keys())[0]
        raise _fail(f"{where}: its safetensors header and the manifest disagree on tensor {odd!r}")
    for name, t in mine.items():
        e = entries[name]
        shape, offsets = (e.get("shape"), e.get("data_offsets")) if isinstance(e, dict) else (None, None)
        if (
            not isinstance(e, dict)
            or e.get("dtype") != t.dtype
            or not isinstance(shape, list) or any(type(d) is not int for d in shape) or shape != list(t.shape)
            or not isinstance(offsets, list) or any(type(o) is not int for o in offsets)
            or offsets != [t.data_offset, t.data_offset + t.nbytes]
        ):
            raise _fail(f"{where}: its safetensors header disagrees with the manifest on tensor {name!r}")


def _validate_slice_sets(m: v1pb.Manifest) -> None:
    sliced: dict[str, list[v1pb.Tensor]] = {}
    for t in m.tensors:
        if t.full_shape:
            sliced.setdefault(t.name, []).append(t)
    for name, parts in sliced.items():
        if len({tuple(p.full_shape) for p in parts}) > 1 or len({p.dtype for p in parts}) > 1:
            raise _fail(f"slices of tensor {name!r} disagree on shape or dtype")
        if sum(math.prod(p.shape) for p in parts) > math.prod(parts[0].full_shape):
            raise _fail(f"slices of tensor {name!r} overlap")
        if len(parts) <= 64:  # pairwise beyond that costs more than a hostile manifest deserves
            for i, a in enumerate(parts):
                for b in parts[i + 1 :]:
                    if math.prod(a.shape) and math.prod(b.shape) and intersect(
                        a.slice_offsets, a.shape, b.slice_offsets, b.shape
                    ):
                        raise _fail(f"slices of tensor {name!r} overlap")


def _validate_slice(t: v1pb.Tensor, where: str, names: set[str]) -> None:
    if t.file:
        raise _fail(f"{where}: slices cannot live in checkpoint files")
    if t.name in names:
        raise _fail(f"{where} is both whole and sliced")
    if not (len(t.full_shape) == len(t.slice_offsets) == len(t.shape)) or not t.shape:
        raise _fail(f"{where}: slice rank does not match its tensor")
    for full, off, ext in zip(t.full_shape, t.slice_offsets, t.shape, strict=True):
        if full > MAX_TENSOR_BYTES or off + ext > full:
            raise _fail(f"{where}: slice at {list(t.slice_offsets)} lies outside {list(t.full_shape)}")
    names.add(f"{t.name}@")  # marks the name as sliced, so a whole entry of it is refused


def _validate_tensor(
    t: v1pb.Tensor,
    codec: PlanesZstdCodec,
    files: dict[str, v1pb.File],
    pack_sizes: list[int],
    names: set[str],
    *,
    is_snapshot: bool,
) -> int:
    """Checks one tensor entry; returns its number of chunks. Runs once per tensor of
    manifests of up to a million tensors, so each field is read once (protobuf attribute
    access is what costs here)."""
    name = t.name
    if not name or len(name) > 4096 or "\x00" in name:
        raise _fail(f"bad tensor name {name!r}")
    offsets = t.slice_offsets
    key = entry_key(name, offsets)
    if key in names:
        raise _fail(f"tensor {name!r} listed twice")
    names.add(key)
    if offsets or t.full_shape:
        _validate_slice(t, f"tensor {name!r}", names)
    elif f"{name}@" in names:
        raise _fail(f"tensor {name!r} is both whole and sliced")
    dtype = t.dtype
    size = dtypes.ITEMSIZE.get(dtype)
    if size is None:
        raise _fail(f"tensor {name!r} has unknown dtype {dtype!r}")
    shape = t.shape
    if len(shape) > MAX_DIMS or any(d > MAX_TENSOR_BYTES for d in shape):
        raise _fail(f"tensor {name!r} has a bad shape")
    nbytes = math.prod(shape) * size
    declared = t.nbytes
    if nbytes != declared or nbytes > MAX_TENSOR_BYTES:
        raise _fail(f"tensor {name!r}: shape {list(shape)} of {dtype} is not {declared} bytes")
    file = t.file
    if file and (file not in files or files[file].kind != v1pb.File.SAFETENSORS):
        raise _fail(f"tensor {name!r} is in unknown file {file!r}")
    chunks = t.chunks
    if not nbytes:
        if chunks:
            raise _fail(f"tensor {name!r} has {len(chunks)} chunks, expected 0")
        return 0
    step = codec.chunk_step(min(size, 8))
    expected_chunks = -(-nbytes // step)
    if len(chunks) != expected_chunks:
        raise _fail(f"tensor {name!r} has {len(chunks)} chunks, expected {expected_chunks}")
    # Longest payload an encoder writes for a full-size chunk (the last may be shorter: its
    # own bound is checked only when a payload passes the common one).
    longest = PlanesZstdCodec.max_payload(step)
    for i, c in enumerate(chunks):
        encoding, target = c.encoding, c.target_digest
        if len(target) != DIGEST_SIZE:
            raise _fail(f"tensor {name!r} chunk {i} has a bad target digest")
        if encoding == SAME:
            if c.length or len(c.base_digest) != DIGEST_SIZE or c.base_digest != target:
                raise _fail(f"tensor {name!r} chunk {i}: bad same chunk")
        elif encoding in (SPARSE, DENSE, FULL):
            if encoding != FULL and len(c.base_digest) != DIGEST_SIZE:
                raise _fail(f"tensor {name!r} chunk {i} has a bad base digest")
            pack, offset, length = c.pack, c.offset, c.length
            if pack >= len(pack_sizes) or offset + length > pack_sizes[pack]:
                raise _fail(f"tensor {name!r} chunk {i} points outside its pack")
            if length > longest or (i == expected_chunks - 1 and length > PlanesZstdCodec.max_payload(nbytes - i * step)):
                raise _fail(f"tensor {name!r} chunk {i}: a {length}-byte payload is longer than any encoding of the chunk")
        else:
            raise _fail(f"tensor {name!r} chunk {i} has unknown encoding {encoding}")
        if is_snapshot and encoding != FULL:
            raise _fail(f"tensor {name!r} chunk {i}: a snapshot holds only full chunks")
    return expected_chunks


# The shape of the whole tensor a manifest entry (or a slice of it) belongs to.
def logical_shape(t: v1pb.Tensor) -> tuple[int, ...]:
    return tuple(t.full_shape) if t.full_shape else tuple(t.shape)

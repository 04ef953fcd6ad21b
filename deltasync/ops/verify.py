"""``deltasync verify``: every object, digest and chain of a repository."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ChecksumMismatchError, CorruptObjectError, ObjectNotFoundError
from ..format.digest import StreamDigest
from ..format.manifest import ManifestInfo
from ..local import Bits
from ..publish.squash import verify_squash
from ..pull.pipeline import blob_parts
from ..pull.subscriber import Subscriber
from ..repo.repository import MAX_REF_BYTES, REF_KEYS, Repository, parse_ref
from ..v1 import manifest_pb2 as pb
from .retention import (
    recorded_unreferenced,
    temp_files as temp_files,  # listed here too: verify reports them, gc removes them
)


@dataclass
class VerifyReport:
    versions: list[int] = field(default_factory=list)
    squashes: list[tuple[int, int]] = field(default_factory=list)
    chunks: int = 0
    packs: int = 0
    blobs: int = 0
    notes: list[str] = field(default_factory=list)


def verify_repository(
    url: str | Repository, *, version: int | None = None, workers: int = 0, progress: bool | None = None
) -> VerifyReport:
    """Raise the first problem found (naming version, tensor, chunk or object); else a report.

    Everything a pull checks, without writing a copy: each manifest against its whole-manifest
    digest and validation (safetensors headers against the tensor layout included;
    format/manifest.py) and its signature with trusted keys; each version rebuilt chunk by
    chunk from its snapshot (bounded memory, output discarded), so every stored chunk on
    every chain is decoded and digest-checked, and each safetensors file's digest computed
    from its header and those chunks; each non-tensor file read through the same
    ``blob_parts`` a pull writes it with (part sizes and digests), then its size and digest. So is every
    chunk of each squash between two present versions (only those into ``version`` when one
    is given). The refs must name committed versions (and, with trusted keys, be signed,
    fresh and bound to those manifests, as a following agent requires).
    """
    repo = url if isinstance(url, Repository) else Repository(url)
    repo.ensure_exists()
    _check_refs(repo)
    versions = [repo.resolve(version)] if version is not None else repo.versions()
    report = VerifyReport()
    referenced: set[str] = set()
    seen_packs: set[str] = set()
    seen_blobs: set[bytes] = set()
    seen_files: set[tuple[bytes, int, tuple[bytes, ...]]] = set()
    sub = Subscriber(repo, workers=workers, progress=progress)
    for v in versions:
        info = repo.manifest(v)
        chain = repo.chain(v)
        if chain[0].version != info.pb.snapshot:
            raise CorruptObjectError(f"manifest {v}", f"names snapshot {info.pb.snapshot}, chain starts at {chain[0].version}")
        for p in info.pb.packs:
            referenced.add(p.key)
            if p.key in seen_packs:
                continue
            try:
                size = repo.store.size(p.key)
            except ObjectNotFoundError:
                raise CorruptObjectError(f"version {v}", f"pack {p.key} is missing") from None
            if size != p.size:
                raise CorruptObjectError(f"version {v}", f"pack {p.key} has {size} bytes, manifest says {p.size}")
            seen_packs.add(p.key)
        for f in info.pb.files:
            if f.kind == pb.File.BLOB:
                _check_blob_file(repo, v, f, seen_files)
                seen_blobs.update(f.blob_parts)
        files = _FileDigests(info)
        sub.pipeline.run(info, None, files.add, squashes=False, label="verify")
        files.check()
        report.chunks += sum(len(t.chunks) for t in info.pb.tensors)
        report.versions.append(v)
    present = set(versions) if version is None else set(repo.versions())
    stale = 0
    for a, c in repo.squashes():
        if version is not None and c != versions[0]:
            continue
        if a not in present or c not in present:
            stale += 1
            continue
        report.chunks += verify_squash(repo, a, c, workers=workers)
        report.squashes.append((a, c))
        squash = repo.squash(a, c)
        for p in squash.pb.packs:
            referenced.add(p.key)
            seen_packs.add(p.key)
    if stale:
        report.notes.append(f"{stale} squash(es) connect a version that is gone (gc removes them)")
    report.packs = len(seen_packs)
    report.blobs = len(seen_blobs)
    if version is None:
        leftovers = temp_files(repo.store)
        if leftovers:
            # Not a fault of the repository: a writer killed mid-write; gc removes them.
            report.notes.append(
                f"{len(leftovers)} temp file(s) of interrupted writes ({sum(t.size for t in leftovers)} bytes, "
                f"e.g. {leftovers[0].path}; left by a killed publisher): gc removes them after its grace period"
            )
        # Packs gc recorded wait out its grace (versions it deleted, or a publish in flight):
        # gc's own business, not damage.
        waiting = recorded_unreferenced(repo.store)
        orphans = [k for k in repo.store.list("packs/") if k not in referenced and k not in waiting]
        if orphans:
            report.notes.append(
                f"{len(orphans)} pack(s) referenced by no version (left by an interrupted publish)"
            )
    return report


def _check_refs(repo: Repository) -> None:
    """The refs name committed versions: with trusted keys as a following agent checks them
    (signed, unexpired, bound to the manifest; RefError), else as hints. A ref naming a
    missing manifest is a newest version withheld or deleted."""
    if repo.trusted_keys is not None:
        repo.latest()
        repo.pinned()
        return
    versions = set(repo.versions())
    for name, key in REF_KEYS.items():
        try:
            ref = parse_ref(name, repo.store.get(key, max_bytes=MAX_REF_BYTES))
        except ObjectNotFoundError:
            continue
        if ref.version is not None and ref.version not in versions:
            raise CorruptObjectError(key, f"names version {ref.version}, whose manifest is missing (withheld or deleted)")


def _check_blob_file(repo: Repository, v: int, f: pb.File, seen: set[tuple[bytes, int, tuple[bytes, ...]]]) -> None:
    """Read non-tensor file ``f`` as a pull writes it (once per identical file: versions share them)."""
    key = (f.digest, f.size, tuple(f.blob_parts))
    if key in seen:
        return
    d, size = StreamDigest(), 0
    try:
        for data in blob_parts(repo, f):  # what pull's write_blob writes, part by checked part
            d.update(data)
            size += len(data)
        if size != f.size or d.digest() != f.digest:
            raise CorruptObjectError(f"file {f.path}", "rebuilt bytes do not match the manifest digest")
    except ObjectNotFoundError:
        raise CorruptObjectError(f"version {v}", f"blob of {f.path} is missing") from None
    except CorruptObjectError as e:
        raise CorruptObjectError(f"version {v}", f"{e.what}: {e.detail}") from None
    seen.add(key)


class _FileDigests:
    """Each safetensors file's digest, computed from its header and its chunks as the pipeline
    hands them over in order (the tensors of a file tile its data in manifest order), so a
    file digest is checked without writing the file."""

    def __init__(self, info: ManifestInfo) -> None:
        self.info = info
        self.digests: dict[str, StreamDigest] = {}
        self.sizes: dict[str, int] = {}
        for f in info.pb.files:
            if f.kind == pb.File.SAFETENSORS:
                self.digests[f.path] = StreamDigest()
                self.digests[f.path].update(f.header)
                self.sizes[f.path] = len(f.header)

    def add(self, t: pb.Tensor, off: int, data: Bits) -> None:
        d = self.digests.get(t.file)
        if d is not None:
            d.update(data)
            self.sizes[t.file] += len(data)

    def check(self) -> None:
        for f in self.info.pb.files:
            d = self.digests.get(f.path)
            if d is None:
                continue
            actual = d.digest()
            if self.sizes[f.path] != f.size or actual != f.digest:
                raise ChecksumMismatchError(
                    version=self.info.version, tensor=f"<file {f.path}>", chunk=-1,
                    expected=f.digest.hex(), actual=actual.hex(),
                )

"""``deltasync verify``: every object, digest and chain of a repository."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CorruptObjectError, ObjectNotFoundError
from ..publish.squash import verify_squash
from ..pull.subscriber import Subscriber
from ..v1 import manifest_pb2 as pb
from .repository import Repository
from .retention import temp_files as temp_files  # listed here too: verify reports them, gc removes them


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

    Each version is rebuilt chunk by chunk from its snapshot (bounded memory, output
    discarded), so every stored chunk on every chain is decoded and digest-checked. So is
    every chunk of each squash between two present versions (only those into ``version``
    when one is given).
    """
    repo = url if isinstance(url, Repository) else Repository(url)
    repo.ensure_exists()
    versions = [repo.resolve(version)] if version is not None else repo.versions()
    report = VerifyReport()
    referenced: set[str] = set()
    seen_packs: set[str] = set()
    seen_blobs: set[bytes] = set()
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
            if f.kind != pb.File.BLOB:
                continue
            for part in f.blob_parts:
                if part not in seen_blobs:
                    try:
                        repo.get_blob(part)
                    except ObjectNotFoundError:
                        raise CorruptObjectError(f"version {v}", f"blob of {f.path} is missing") from None
                    seen_blobs.add(part)
        Subscriber(repo, workers=workers, progress=progress).check(v)
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
        for p in repo.squash(a, c).pb.packs:
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
        orphans = [k for k in repo.store.list("packs/") if k not in referenced]
        if orphans:
            report.notes.append(
                f"{len(orphans)} pack(s) referenced by no version (left by an interrupted publish)"
            )
    return report

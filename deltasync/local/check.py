"""Checking and repairing a directory copy without a full pull.

``check_copy`` re-hashes every chunk of the served slot against the manifest of the version
it holds (recorded in the copy: it works offline) and names what drifted (file, tensor,
chunk); it also reports links of the version missing from ``DIR`` and files in ``DIR`` that
are not the version's (a loader would read them beside it). With ``repair`` it fetches only
the drifted chunks, rebuilt from the nearest snapshot and verified, and writes them in
place: a file is never copied for a repair, so repairing one chunk of a 5 GB shard writes
one chunk. At every moment each chunk of a file is either its old (drifted) bytes or its
verified repaired bytes, and a repair killed midway is finished by running it again.
(Readers mapping the file see repaired chunks appear; they were reading wrong bits.)

Moving a copy between versions (pulls, rollbacks) is slotfill.py's job.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ..errors import ChecksumMismatchError, DeltasyncError, UsageError
from ..format import dtypes
from ..format.checkpoint import FileReader
from ..format.digest import digest
from ..format.manifest import ManifestInfo, key_of
from ..format.signing import PublicKeyLike
from ..pull.pipeline import ordered_map, write_blob
from ..pull.plan import Want
from ..pull.subscriber import Subscriber
from ..repo.repository import Repository
from ..v1 import manifest_pb2 as pb
from .cache import CachedStore
from .placement import Placement, file_digest, placements, read_placed, version_files, write_placed
from .slots import ensure_slots, finish_install, foreign_files, link_target, make_link, settle_foreign, slot_dir
from .state import LocalState, StateDB, copy_lock, output_files

Bits = npt.NDArray[np.uint8]


# -- check and repair ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Drift:
    """One part of a copy that differs from its manifest: a chunk, or a whole-file matter."""

    file: str
    tensor: str  # "" for a file-level problem (missing, size, header, non-tensor file)
    chunk: int  # -1 for a file-level problem
    detail: str
    entry: str = ""  # the manifest entry's key (differs from the tensor name for slices)

    def __str__(self) -> str:
        where = f"{self.file}: tensor {self.tensor!r} chunk {self.chunk}" if self.tensor else self.file
        return f"{where}: {self.detail}"


@dataclass
class CheckReport:
    version: int
    files: int = 0
    chunks: int = 0
    drifted: list[Drift] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)  # files in DIR that are not the version's
    repaired: bool = False
    fetched_bytes: int = 0
    other_repository: str = ""
    """Why the copy does not hold this version of the repository asked about (``repo=`` given):
    another version digest or repository identity under the same number; "" when it does."""

    @property
    def ok(self) -> bool:
        return (not self.drifted or self.repaired) and not self.foreign and not self.other_repository


def check_copy(
    out: str | os.PathLike[str],
    *,
    repo: str | Repository | None = None,
    repair: bool = False,
    workers: int = 0,
    trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
    move_aside: bool = False,
) -> CheckReport:
    """Compare the copy at ``out`` with the manifest of the version it holds; with
    ``repair``, fetch exactly the drifted chunks (and non-tensor files) and fix them in place
    (and with ``move_aside`` also move files that are not the version's out of the way).

    ``repo`` defaults to the repository the copy was pulled from (needed only to repair, or
    when the copy predates the recorded manifest)."""
    root = Path(out)
    db = StateDB.open(root, create=False)
    state = db.state() if db is not None else None
    if db is None or state is None:
        raise UsageError(f"{root} holds no deltasync copy (pull or subscribe into it first)")
    if not repair:
        upstream = _repository(repo, state.repo, trusted_keys, required=False)
        info = held_manifest(db, state, upstream)
        if info is None:
            raise UsageError(f"the manifest of version {state.version} is unknown here; pass the repository")
        report = _check(root, _data_root(root, db), info, workers)
        if repo is not None and upstream is not None:
            # Asked about a repository: the copy is at version N of it only if it holds N's digest there.
            theirs = upstream.manifest(state.version)
            named = theirs.pb.repository_id.hex()
            if state.version_digest != theirs.pb.version_digest.hex() or (
                state.repository_id and named and state.repository_id != named
            ):
                report.other_repository = (
                    f"{root} holds another version {state.version} than {upstream.url}'s (version digest "
                    f"{state.version_digest[:16]}…, repository {state.repository_id or '-'}; {upstream.url} has "
                    f"{theirs.pb.version_digest.hex()[:16]}…, repository {theirs.pb.repository_id.hex() or '-'}): "
                    f"pull it from {upstream.url} to have that one")
        return report
    with copy_lock(root):
        finish_install(root)
        ensure_slots(root, db)
        state = db.state()
        assert state is not None
        upstream = _repository(repo, state.repo, trusted_keys, required=True)
        assert upstream is not None
        counting = CachedStore(upstream.store)
        repository = Repository(counting)
        repository.trusted_keys = upstream.trusted_keys
        info = repository.manifest(state.version)  # authenticated: repairs follow the repository
        data = _data_root(root, db)
        report = _check(root, data, info, workers)
        if report.foreign and move_aside:
            settle_foreign(root, output_files(info), move_aside=True)
            report.foreign = []
        if report.drifted:
            _repair(Subscriber(repository, workers=workers, progress=False), root, data, info, report.drifted)
            again = _check(root, data, info, workers)
            if again.drifted:
                d = again.drifted[0]
                raise ChecksumMismatchError(
                    version=info.version, tensor=d.tensor or f"<file {d.file}>", chunk=d.chunk,
                    expected="the manifest's digest", actual=f"still different after repair ({d.detail})",
                )
            report.repaired = True
        report.fetched_bytes = counting.fetched_bytes
        return report


def _repository(
    repo: str | Repository | None,
    recorded: str,
    trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None,
    *,
    required: bool,
) -> Repository | None:
    if isinstance(repo, Repository):
        return repo
    url = repo or recorded
    if not url:
        if required:
            raise UsageError("the copy records no repository; pass one")
        return None
    return Repository(url, trusted_keys=trusted_keys)


def held_manifest(db: StateDB, state: LocalState | None, repo: Repository | None) -> ManifestInfo | None:
    """The manifest of the version a copy holds: recorded in the copy (so it serves even
    after gc deleted that version upstream), else from the repository (older copies)."""
    if state is None:
        return None
    held = db.manifest()
    if held is not None and held.version == state.version:
        return held
    if repo is None:
        return None
    try:
        return repo.manifest(state.version)
    except DeltasyncError:
        return None


def _data_root(root: Path, db: StateDB) -> Path:
    """Where the served files are: the served slot, or ``root`` for a copy of older deltasync."""
    record = db.slots()
    return slot_dir(root, record.active) if record is not None and record.active is not None else root


def _check(root: Path, data: Path, info: ManifestInfo, workers: int) -> CheckReport:
    report = CheckReport(info.version)
    if data != root:
        for rel in output_files(info):
            link = root / rel
            if not os.path.lexists(link):
                report.drifted.append(Drift(rel, "", -1, "missing"))
            elif not (link.is_symlink() and os.readlink(link) == link_target(rel)):
                report.drifted.append(Drift(rel, "", -1, "replaced (not the link to the served version)"))
        report.foreign = foreign_files(root, output_files(info))
    places = placements(info)
    by_file: dict[str, list[Placement]] = {}
    for p in places.values():
        by_file.setdefault(p.file, []).append(p)
    items: list[tuple[Placement, int, int, int]] = []
    for f in version_files(info):
        report.files += 1
        path = data / f.path
        if f.kind == pb.File.BLOB:
            if file_digest(path) != f.digest:
                report.drifted.append(Drift(f.path, "", -1, "missing" if not path.is_file() else "content differs"))
            continue
        if path.is_symlink() or not path.is_file():
            report.drifted.append(Drift(f.path, "", -1, "missing"))
        else:
            size = path.stat().st_size
            if size != f.size:
                report.drifted.append(Drift(f.path, "", -1, f"size {size}, expected {f.size}"))
            with open(path, "rb") as fh:
                if fh.read(len(f.header)) != f.header:
                    report.drifted.append(Drift(f.path, "", -1, "safetensors header differs"))
        for p in by_file.get(f.path, []):
            width = dtypes.element_width(p.tensor.dtype)
            for idx, (off, length) in enumerate(info.codec.chunk_ranges(p.tensor.nbytes, width)):
                items.append((p, idx, off, length))
    report.chunks = len(items)

    with FileReader() as reader:

        def drifted(item: tuple[Placement, int, int, int]) -> Drift | None:
            p, idx, off, length = item
            try:
                bits = read_placed(reader, data, p, off, length)
            except DeltasyncError:
                return Drift(p.file, p.tensor.name, idx, "missing (file too short)", key_of(p.tensor))
            if digest(bits) != p.tensor.chunks[idx].target_digest:
                return Drift(p.file, p.tensor.name, idx, "bytes differ from the manifest", key_of(p.tensor))
            return None

        for d in ordered_map(items, drifted, workers or os.cpu_count() or 1):
            if d is not None:
                report.drifted.append(d)
    return report


def _repair(sub: Subscriber, root: Path, data: Path, info: ManifestInfo, drifted: list[Drift]) -> None:
    files = {f.path: f for f in version_files(info)}
    places = placements(info)
    want: Want = {}
    for d in drifted:
        if d.tensor:
            want.setdefault(d.entry, []).append(d.chunk)
    for rel in sorted({d.file for d in drifted if not d.tensor}):
        if data != root:
            make_link(root, rel)
        f = files[rel]
        path = data / rel
        if f.kind == pb.File.BLOB:
            tmp = path.with_name(f".{path.name}.deltasync-repair")
            write_blob(sub.repo, f, tmp)
            os.replace(tmp, path)
            continue
        if path.is_symlink() or not path.is_file():
            with contextlib.suppress(OSError):
                path.unlink()
            path.parent.mkdir(parents=True, exist_ok=True)
            # A missing file: every chunk of it is rebuilt (they were all reported).
        with open(path, "ab"):
            pass
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, f.header, 0)
            os.ftruncate(fd, f.size)
            os.fsync(fd)
        finally:
            os.close(fd)
    if not want:
        return
    fds: dict[str, int] = {}
    try:
        for key in want:
            rel = places[key].file
            if rel not in fds:
                fds[rel] = os.open(data / rel, os.O_RDWR)

        def sink(t: pb.Tensor, off: int, data: Bits) -> None:
            p = places[key_of(t)]
            write_placed(fds[p.file], p, off, data)  # verified bits, in place (see the module doc)

        sub.pipeline.run(info, None, sink, want={k: sorted(set(v)) for k, v in want.items()})
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)

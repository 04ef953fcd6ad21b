"""Bring the slot not served to a version, in place, in O(changed bytes); then switch to it.

The slot not served (slots.py) holds an older version M, recorded with its manifest; the
served slot holds N. For every chunk of the target T, cheapest first:

1. *skip*: M's digest of the chunk is T's. No read, no write: its bytes were verified when
   they were written, and nothing has written the slot since (it is marked dirty first).
2. *walk in place*: apply the chunk records from M to T (forwards with ``decode_into`` in
   place, which writes only the changed elements of a sparse chunk; backwards with
   ``decode_reverse`` for rollbacks) to the slot's memory-mapped bytes, then hash the chunk
   and compare it with T's digest. Payloads of M→N were fetched by the previous update and
   are kept by the agent's object cache.
3. *rebuild*: anything else (a chunk a walk cannot reach, a digest that does not match, a
   slot used for the first time, a file whose layout changed) runs the subscriber's chunk
   pipeline with the served slot as the local bits: an unchanged chunk is copied from it, a
   changed one decoded from it, or from a snapshot; the whole chunk is then written.

Every chunk written is checked against T's digest; unchanged chunks are covered by the
digests checked when they were written. A safetensors file is proven by its header, its
size and chunks that tile it (placement.py); only a file written whole is hashed whole.

A fill that stops (an error, a kill, ``stop``) leaves the slot marked dirty, with the
version it held before. The next fill hashes each chunk and takes whichever of M, N or T it
matches as its start (DESIGN.md invariant 3), so it resumes to the exact target.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..errors import ChecksumMismatchError, CorruptObjectError, DeltasyncError, RepositoryIdentityError
from ..format import dtypes
from ..format.checkpoint import FileReader
from ..format.codec import FULL, SAME, EncodedChunk, decode_reverse
from ..format.digest import StreamDigest, digest
from ..format.manifest import ManifestInfo, check_relpath, key_of
from ..progress import Progress
from ..pull.fetch import PackFetcher
from ..pull.pipeline import ordered_map
from ..v1 import manifest_pb2 as pb
from .placement import Placement, file_digest, placements, read_placed, tiles, version_files, write_placed
from .slots import (
    detach_readers,
    ensure_slots,
    finish_switch,
    fsync_files,
    other,
    refuse_symlinked_dirs,
    settle_foreign,
    slot_dir,
    switch,
    untouched,
)
from .state import (
    LocalState,
    ProgressRecorder,
    PullStopped,
    SlotInfo,
    SlotsRecord,
    StateDB,
    WorkInProgress,
    copy_lock,
    output_files,
)

if TYPE_CHECKING:
    from ..pull.plan import Chain, Want
    from ..pull.subscriber import Subscriber
    from ..repo.repository import Repository

Bits = npt.NDArray[np.uint8]
Step = tuple[ManifestInfo, pb.Chunk]
log = logging.getLogger(__name__)


@dataclass
class FillResult:
    """What bringing a copy to a version took."""

    version: int
    previous: int | None = None  # the version served before
    skipped: int = 0  # chunks the slot already held at the target: no I/O
    walked: int = 0  # chunks brought to the target in place from the slot's own bytes
    rebuilt: int = 0  # chunks written whole (copied from the served slot, or fetched and decoded)
    files_copied: int = 0  # files copied whole from the served slot (a slot's first use, a new layout)
    bytes_written: int = 0  # bytes of chunks written whole, and of files copied or written whole
    held: bool = False  # the copy already served the version: nothing was done
    plan_base: int | None = None  # the local version the fetch plan of the rebuilt chunks started from
    fetched_bytes: int = 0  # bytes read from the repository: deltas for the walk, the plan of the rebuild
    squashes: tuple[tuple[int, int], ...] = ()  # squashes the walk went through (from, to)

    def __str__(self) -> str:
        if self.held:
            return f"already at version {self.version}"
        if not self.rebuilt:
            how = "local"
        else:
            how = f"pull from version {self.plan_base}" if self.plan_base is not None else "pull from a snapshot"
        if self.squashes:
            how += " via squash " + ", ".join(f"{a}->{b}" for a, b in self.squashes)
        parts = [f"{self.walked} chunks updated in place", f"{self.skipped} unchanged", f"{self.rebuilt} rebuilt"]
        if self.files_copied:
            parts.append(f"{self.files_copied} files copied")
        return f"{how}: " + ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class FillOptions:
    """How :func:`update_copy` fills a copy."""

    stop: Callable[[], bool] | None = None
    """Asked between chunks; once it returns True the fill raises PullStopped."""
    move_aside: bool = False
    """Move files that are not the repository's into ``DIR/.deltasync/aside/`` (else refuse them)."""
    fsync: bool = False
    """Flush the slot to disk before the switch."""
    repo_url: str = ""
    """The repository's URL as the state records it ("": the one it records already)."""


def update_copy(sub: Subscriber, out: str | os.PathLike[str], info: ManifestInfo,
                options: FillOptions | None = None) -> FillResult:
    """Bring the copy at ``out`` to ``info``'s version: fill the slot not served, verify it,
    switch to it. See the module doc; on any error the copy keeps serving what it served."""
    o = options or FillOptions()
    root = Path(out)
    # A link where the version has a directory: refused before anything is written (the
    # switch checks again, under the lock), so DIR stays as it was.
    refuse_symlinked_dirs(root, output_files(info))
    with copy_lock(root):
        finish_switch(root)
        db = StateDB.open(root)
        assert db is not None
        record = ensure_slots(root, db)
        state = db.state()
        repo_url = o.repo_url or (state.repo if state is not None else "")
        _check_identity(sub, root, state, info, repo_url)
        _check_history(sub, state, info, repo_url)
        held = _held(db, sub, state)
        settle_foreign(root, output_files(held) if held is not None else (), output_files(info), move_aside=o.move_aside)
        record = _after_power_loss(sub, root, db, record)
        if held is not None and record.active is not None and state is not None and state.holds(info):
            if db.wip() is not None:
                db.set_wip(None)  # an interrupted move elsewhere: its slot stays marked dirty
            _repair_if_touched(sub, root, db, record, held)
            return FillResult(info.version, held.version, held=True)
        name = other(record.active)
        start, counted = time.monotonic(), getattr(sub.repo.store, "fetched_bytes", None)
        result = _Fill(sub, root, db, record, name, held, info, o.stop).run()
        switch(root, db, name, info, repo=repo_url, synced=o.fsync)
        # A counting store (the CLI's, an agent's) counts every byte, manifests too.
        now = getattr(sub.repo.store, "fetched_bytes", None)
        fetched = now - counted if isinstance(now, int) and isinstance(counted, int) else result.fetched_bytes
        _record_move(db, state.version if state is not None else None, result, fetched, time.monotonic() - start)
        return result


def _record_move(db: StateDB, previous: int | None, result: FillResult, fetched: int, seconds: float) -> None:
    """Say in the copy's figures that it moved (``deltasync status``): a pull or a library
    ``update_dir`` moves it without an agent, and the figures an agent left (its target, its
    last update) would otherwise describe a copy that no longer stands. An agent moving the
    copy writes its own figures over these right after."""
    with contextlib.suppress(DeltasyncError, OSError):
        stats = db.stats()
        latest = stats.get("latest_version")
        db.update_stats({
            "last_update": {"version": result.version, "previous": previous, "how": str(result),
                            "fetched_bytes": fetched, "seconds": round(seconds, 6),
                            "finished_unix": time.time()},
            # What an agent served (a pin, a rollback's version) is no longer known: lag is
            # against the newest version seen, which this one may be.
            "target_version": None, "stale_since_unix": None,
            "latest_version": max(latest, result.version) if isinstance(latest, int) else None,
        })


def _check_identity(sub: Subscriber, root: Path, state: LocalState | None, info: ManifestInfo, repo_url: str) -> None:
    """With trusted keys, the repository at the URL a copy was pulled from must be the one it
    recorded (repo/repository.py, Identity): another one there is refused, not followed.
    Pulling from another URL is the user's choice of another repository (rebuilt, not refused)."""
    if state is None or not state.repository_id or sub.repo.trusted_keys is None:
        return
    from ..pull.subscriber import state_url

    named = info.pb.repository_id.hex()
    if named == state.repository_id or state_url(state.repo) != state_url(repo_url):
        return
    raise RepositoryIdentityError(
        repo_url, f"version {info.version} is of repository {named or '(none named)'}, but {root} holds version "
        f"{state.version} of repository {state.repository_id} from this URL: another repository's objects, or one "
        "deleted and created again, refused; pull into a new directory to follow it")


def _check_history(sub: Subscriber, state: LocalState | None, info: ManifestInfo, repo_url: str) -> None:
    """A newer version of the repository the copy follows must extend the history of the one
    it holds (repo/history.py): a fork is refused. Another URL, or another identity at it
    (followed without trusted keys, refused with them above), is another history."""
    if state is None or state.repository_id != info.pb.repository_id.hex():
        return
    from ..pull.subscriber import state_url
    from ..repo.history import check_extends

    if state_url(state.repo) != state_url(repo_url):
        return
    check_extends(sub.repo.store, repo_url, state.version, state.history_digest, info,
                  strict=sub.repo.trusted_keys is not None)


def _held(db: StateDB, sub: Subscriber, state: LocalState | None) -> ManifestInfo | None:
    """The manifest of what the served slot holds (as recorded; the repository's only when it
    has the recorded version digest and identity)."""
    if state is None:
        return None
    held = db.manifest()
    if held is not None and held.version == state.version:
        return held
    with contextlib.suppress(DeltasyncError):
        found = sub.repo.manifest(state.version)
        if found.pb.version_digest.hex() == state.version_digest and (
            not state.repository_id or found.pb.repository_id.hex() == state.repository_id
        ):
            return found
    return None


def _repair_if_touched(sub: Subscriber, root: Path, db: StateDB, record: SlotsRecord, held: ManifestInfo) -> None:
    """Check and repair the served files written since they were verified (through a link,
    say): a pull to the version held costs a few stats, unless something changed them."""
    from .check import check_copy
    from .slots import slot_stats

    assert record.active is not None
    files = output_files(held)
    if all(untouched(root, record.active, record.info(record.active), rel) for rel in files):
        return
    log.warning("%s: files of the served version were written since they were verified; checking them", root)
    check_copy(root, repo=sub.repo, repair=True, workers=sub.workers)
    slots = {**record.slots, record.active: SlotInfo(held.version, files=slot_stats(root, record.active, files))}
    db.set_slots(record.replace(slots=slots))


def _after_power_loss(sub: Subscriber, root: Path, db: StateDB, record: SlotsRecord) -> SlotsRecord:
    """A slot switched to without a flush, in an earlier boot, may have lost writes: check
    (and repair) the served slot chunk by chunk, and trust nothing of the other one."""
    from .slots import boot_id

    now = boot_id()
    if record.active is None or record.synced or not record.boot_id or not now or record.boot_id == now:
        return record
    from .check import check_copy

    log.warning("%s: the machine restarted since the last update; checking the served version", root)
    report = check_copy(root, repo=sub.repo, repair=True, workers=sub.workers)
    if report.drifted:
        log.warning("%s: repaired %d part(s) lost at the restart", root, len(report.drifted))
    name = other(record.active)
    previous = record.info(name)
    slots = {**record.slots, name: SlotInfo(None, previous.version if previous.version is not None else previous.source)}
    fsync_files(p for p in slot_dir(root, record.active).rglob("*") if p.is_file())
    record = record.replace(slots=slots, synced=True, boot_id=now)
    db.set_slots(record)
    return record


class _Fill:
    """One fill of slot ``name`` (see the module doc)."""

    def __init__(
        self, sub: Subscriber, root: Path, db: StateDB, record: SlotsRecord, name: str,
        held: ManifestInfo | None, info: ManifestInfo, stop: Callable[[], bool] | None,
    ) -> None:
        self.sub, self.root, self.db, self.record, self.name = sub, root, db, record, name
        self.held, self.info, self.stop = held, info, stop
        self.slot = slot_dir(root, name)
        self.active = slot_dir(root, record.active) if record.active is not None else None
        self.result = FillResult(info.version, held.version if held is not None else None)
        mine = self.mine = record.info(name)
        recorded = db.slot_manifest()
        start = mine.version if mine.version is not None else mine.source
        self.own = recorded if recorded is not None and start is not None and recorded.version == start else None
        self.clean = mine.version is not None and self.own is not None
        self._paths: dict[int, list[ManifestInfo] | None] = {}
        self._squashed: dict[int, Chain | None] = {}
        self._lock = threading.Lock()

    # -- the whole fill ---------------------------------------------------------------------------

    def run(self) -> FillResult:
        info = self.info
        own_version = self.own.version if self.own is not None else None
        wip = WorkInProgress(info.version, "fetch", time.time(), 0, sum(len(t.chunks) for t in info.pb.tensors))
        # Dirty before the first write: from here the slot's bytes are only trusted by digest.
        self.db.set_slots(self.record.replace(slots={**self.record.slots, self.name: SlotInfo(None, own_version)}), wip=wip)
        self.slot.mkdir(parents=True, exist_ok=True)
        existing = [p for p in self.slot.rglob("*") if p.is_file() and not p.is_symlink()]
        detach_readers(existing)
        recorder = ProgressRecorder(self.db, wip)
        files = version_files(info)
        modes = {f.path: self._prepare_file(f) for f in files}
        self._drop_extra_files({f.path for f in files})
        maps = _Maps(self.slot, [f for f in files if f.kind == pb.File.SAFETENSORS])
        try:
            remaining = self._walk_all(maps, modes, recorder)
            maps.close()
            if remaining:
                self._rebuild(remaining, recorder)
        finally:
            maps.close()
        self._verify_files(files, modes)
        return self.result

    # -- files --------------------------------------------------------------------------------------

    def _prepare_file(self, f: pb.File) -> str:
        """Make the slot's file ready for its chunks; returns how its chunks start:
        ``own`` (the slot's recorded version), ``probe`` (unknown: hash each chunk),
        ``held`` (copied from the served slot) or ``fresh`` (zeros)."""
        path = self.slot / check_relpath(f.path)
        if f.kind == pb.File.BLOB:
            self._prepare_blob(f, path)
            return "blob"
        # Same size and header length: every entry of the data section can stay where it is
        # (chunk digests say which did); the header itself (its metadata) is rewritten in place.
        ok = _same_shape(path, f)
        # The slot's own version, unless no delta chain leads from it and one leads from the
        # version served (a rollback across a snapshot, say): then a copy of the served file.
        own_walks = self.own is not None and (self._path(self.own) is not None or self.held is None
                                              or self._path(self.held) is None)
        if ok and own_walks and self.clean and self.own is not None and _file_of(self.own, f.path) == (len(f.header), f.size):
            trusted = untouched(self.root, self.name, self.mine, f.path)
            _write_header(path, f)
            return "own" if trusted else "probe"  # written since it was verified: trust only digests
        if ok and not self.clean:
            _write_header(path, f)
            return "probe"
        if self.held is not None and self.active is not None and _file_of(self.held, f.path) == (len(f.header), f.size):
            src = self.active / f.path
            if _same_shape(src, f):
                assert self.record.active is not None
                trusted = untouched(self.root, self.record.active, self.record.info(self.record.active), f.path)
                _replace_with(path, partial(_copy_into, src))
                _write_header(path, f)
                self.result.files_copied += 1
                self.result.bytes_written += f.size
                return "held" if trusted else "probe"

        def fresh(tmp: Path) -> None:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.pwrite(fd, f.header, 0)
                os.ftruncate(fd, f.size)
            finally:
                os.close(fd)
        _replace_with(path, fresh)
        self.result.bytes_written += len(f.header)
        return "fresh"

    def _prepare_blob(self, f: pb.File, path: Path) -> None:
        own = self.own.pb.files if self.clean and self.own is not None else ()
        if any(o.path == f.path and o.digest == f.digest for o in own) and untouched(self.root, self.name, self.mine, f.path):
            return  # recorded as verified, untouched since
        if file_digest(path) == f.digest:
            return
        if self.active is not None and file_digest(self.active / f.path) == f.digest:
            _replace_with(path, partial(_copy_into, self.active / f.path))
            if file_digest(path) == f.digest:
                self.result.bytes_written += f.size
                return

        from ..pull.pipeline import blob_parts  # imported here as LocalBits is, below

        def download(tmp: Path) -> None:
            d = StreamDigest()
            with open(tmp, "wb") as fh:
                for data in blob_parts(self.sub.repo, f):  # never more than f.size bytes in all
                    d.update(data)
                    fh.write(data)
            if d.digest() != f.digest:
                raise CorruptObjectError(f"file {f.path}", "rebuilt bytes do not match the manifest digest")

        _replace_with(path, download)
        self.result.bytes_written += f.size

    def _drop_extra_files(self, keep: set[str]) -> None:
        for p in sorted(self.slot.rglob("*"), reverse=True):
            rel = p.relative_to(self.slot).as_posix()
            if p.is_dir() and not p.is_symlink():
                with contextlib.suppress(OSError):
                    p.rmdir()  # only when empty
            elif rel not in keep:
                p.unlink()

    def _verify_files(self, files: list[pb.File], modes: dict[str, str]) -> None:
        for f in files:
            if f.kind != pb.File.SAFETENSORS:
                continue
            path = self.slot / f.path
            if not _same_layout(path, f):
                raise ChecksumMismatchError(
                    version=self.info.version, tensor=f"<file {f.path}>", chunk=-1,
                    expected=f"{f.size} bytes and the manifest's header", actual="another size or header",
                )
            if tiles(self.info, f) or not f.digest:
                continue  # proven by its chunks (placement.py); library versions carry no file digest
            actual = file_digest(path) or b""
            if actual != f.digest:
                raise ChecksumMismatchError(
                    version=self.info.version, tensor=f"<file {f.path}>", chunk=-1,
                    expected=f.digest.hex(), actual=actual.hex(),
                )

    # -- walking in place -------------------------------------------------------------------------

    def _walk_all(self, maps: _Maps, modes: dict[str, str], recorder: ProgressRecorder) -> Want:
        info = self.info
        remaining: Want = {}
        fetcher = PackFetcher(self.sub.repo.store)
        starts = {"own": self.own, "held": self.held}
        entries = {m: (placements(i) if i is not None else {}) for m, i in starts.items()}
        jobs: list[tuple[Placement, int, int, int, list[tuple[ManifestInfo | None, bytes]]]] = []
        for key, p in placements(info).items():
            t, mode = p.tensor, modes[p.file]
            width = dtypes.element_width(t.dtype)
            for idx, (off, length) in enumerate(info.codec.chunk_ranges(t.nbytes, width)):
                target = t.chunks[idx].target_digest
                if mode in ("own", "held"):
                    start = starts[mode]
                    d = _chunk_digest(entries[mode].get(key), p, idx, start, info)
                    if d == target:
                        self.result.skipped += 1
                        recorder.advance()
                        continue
                    if d is not None and p.contiguous and start is not None:
                        # Ranged reads only (no expect()): kept payloads are ranges of packs.
                        jobs.append((p, idx, off, length, [(start, d)]))
                        continue
                elif mode == "probe" and p.contiguous:
                    candidates: list[tuple[ManifestInfo | None, bytes]] = [(None, target)]
                    for start in (self.own, self.held):
                        d = _chunk_digest(entries["own" if start is self.own else "held"].get(key), p, idx, start, info)
                        if start is not None and d is not None:
                            candidates.append((start, d))
                    jobs.append((p, idx, off, length, candidates))
                    continue
                remaining.setdefault(key, []).append(idx)
        if not jobs:
            return remaining
        progress = Progress(f"update v{info.version} in place", len(jobs), enabled=self.sub.progress)
        try:
            for (p, idx, _off, _length, _), how in zip(jobs, ordered_map(jobs, lambda j: self._walk(maps, fetcher, *j),
                                                                      self.sub.workers), strict=True):
                if self.stop is not None and self.stop():
                    raise PullStopped(info.version)
                recorder.advance()
                progress.advance(1)
                if how == "rebuild":
                    remaining.setdefault(key_of(p.tensor), []).append(idx)
                elif how == "kept":
                    self.result.skipped += 1
                else:
                    self.result.walked += 1
        finally:
            progress.finish()
            self.result.fetched_bytes += fetcher.bytes_read
        return remaining

    def _walk(
        self, maps: _Maps, fetcher: PackFetcher, p: Placement, idx: int, off: int, length: int,
        candidates: list[tuple[ManifestInfo | None, bytes]],
    ) -> str:
        """One chunk: "kept" (already the target), "walked", or "rebuild"."""
        t = p.tensor
        width = dtypes.element_width(t.dtype)
        with maps.view(p.file, p.start + off, length) as view:
            return self._walk_view(view, fetcher, t, idx, width, candidates)

    def _walk_view(
        self, view: Bits, fetcher: PackFetcher, t: pb.Tensor, idx: int, width: int,
        candidates: list[tuple[ManifestInfo | None, bytes]],
    ) -> str:
        target = t.chunks[idx].target_digest
        start: ManifestInfo | None = candidates[0][0]
        if len(candidates) > 1 or start is None:  # probe: which version do these bytes hold?
            found = digest(view)
            if found == target:
                return "kept"
            match = [s for s, d in candidates[1:] if d == found]
            if not match:
                return "rebuild"
            start = match[0]
        assert start is not None
        steps = self._steps(start, key_of(t), idx)
        if steps is None:
            return "rebuild"
        backward = start.version > self.info.version
        try:
            for s_info, c in steps:
                if c.encoding == SAME:
                    continue
                pack = s_info.pb.packs[c.pack]
                chunk = EncodedChunk(c.encoding, fetcher.get(pack.key, c.offset, c.length))
                if backward:
                    view[:] = decode_reverse(s_info.codec, chunk, view, width)
                else:
                    s_info.codec.decode_into(chunk, view, view, width)
        except DeltasyncError:
            return "rebuild"  # the slot's chunk is rewritten whole; nothing served is touched
        return "walked" if digest(view) == target else "rebuild"

    def _steps(self, start: ManifestInfo, key: str, idx: int) -> list[Step] | None:
        """Chunk records that take chunk ``idx`` of ``key`` from ``start`` to the target, in
        the order to apply them; None when a walk cannot (a full chunk going backwards, a
        version missing upstream, a resized entry)."""
        first = start.entries().get(key)
        if first is None or idx >= len(first.chunks):
            return None
        backward = start.version > self.info.version
        chain = self._squash_chain(start)
        if chain is not None:  # forward through squashes: fewer bytes than the deltas one by one
            try:
                records, _ = chain.steps(key, idx, start.version)
            except DeltasyncError:
                return None
            records.reverse()
        else:
            path = self._path(start)
            if path is None:
                return None
            records = [(path[i] if backward else path[i + 1], pb.Chunk()) for i in range(len(path) - 1)]
        out: list[Step] = []
        for s_info, _ in records:
            t = s_info.entries().get(key)
            if t is None or t.nbytes != first.nbytes or t.dtype != first.dtype or idx >= len(t.chunks):
                return None
            c = t.chunks[idx]
            if backward and c.encoding == FULL:
                return None
            out.append((s_info, c))
        return out

    def _squash_chain(self, start: ManifestInfo) -> Chain | None:
        """The planner's path from ``start`` forward when it is cheapest and uses squashes."""
        if start.version >= self.info.version:
            return None
        with self._lock:
            if start.version not in self._squashed:
                found = None
                with contextlib.suppress(DeltasyncError):
                    plan, chain = self.sub.plan(self.info.version, start.version)
                    if plan.squashes and plan.base == start.version and all(
                        i.codec.chunk_bytes == self.info.codec.chunk_bytes for i in chain.infos
                    ):
                        found = chain
                        self.result.squashes = plan.squashes
                self._squashed[start.version] = found
            return self._squashed[start.version]

    def _path(self, start: ManifestInfo) -> list[ManifestInfo] | None:
        with self._lock:
            if start.version not in self._paths:
                path = version_path(self.sub.repo, start.version, self.info.version)
                if path is not None:
                    path[0] = start  # the recorded manifest (its version may be gone upstream)
                    path[-1] = self.info
                    if any(i.codec.chunk_bytes != self.info.codec.chunk_bytes for i in path):
                        path = None
                self._paths[start.version] = path
            return self._paths[start.version]

    # -- rebuilding through the pipeline ------------------------------------------------------------

    def _rebuild(self, want: Want, recorder: ProgressRecorder) -> None:
        from ..pull.pipeline import LocalBits

        info, places = self.info, placements(self.info)
        held_places = placements(self.held) if self.held is not None else {}
        active = self.active
        reader = FileReader()

        def read(key: str, off: int, length: int) -> Bits | None:
            h = held_places.get(key)
            if h is None or active is None or off + length > h.tensor.nbytes:
                return None
            try:
                return read_placed(reader, active, h, off, length)
            except DeltasyncError:
                return None  # a damaged served file: repaired from the repository

        fds: dict[str, int] = {}
        try:
            for rel in {places[k].file for k in want}:
                fds[rel] = os.open(self.slot / rel, os.O_RDWR)

            def sink(t: pb.Tensor, off: int, data: Bits) -> None:
                if self.stop is not None and self.stop():
                    raise PullStopped(info.version)
                p = places[key_of(t)]
                write_placed(fds[p.file], p, off, data)
                self.result.rebuilt += 1
                self.result.bytes_written += len(data)
                recorder.advance()

            local = LocalBits(self.held.version, read) if self.held is not None else None
            plan = self.sub.pipeline.run(info, local, sink, want=want)
            self.result.plan_base = plan.base
            self.result.fetched_bytes += plan.fetch_bytes
        finally:
            reader.close()
            for fd in fds.values():
                os.close(fd)


# -- helpers ---------------------------------------------------------------------------------------


class _Maps:
    """Writable memory maps of chunks of a slot's files: one map per chunk, unmapped when
    the chunk is done, so resident memory holds the chunks in flight, not the model."""

    def __init__(self, slot: Path, files: list[pb.File]) -> None:
        self.slot = slot
        self.sizes = {f.path: f.size for f in files}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def view(self, rel: str, start: int, length: int) -> Iterator[Bits]:
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                fd = self._fds[rel] = os.open(self.slot / rel, os.O_RDWR)
        if start + length > self.sizes[rel]:
            raise CorruptObjectError(f"slot file {rel}", f"chunk at {start} runs past the file's {self.sizes[rel]} bytes")
        lead = start % mmap.ALLOCATIONGRANULARITY
        mm = mmap.mmap(fd, lead + length, offset=start - lead)
        arr = np.frombuffer(mm, dtype=np.uint8)
        try:
            yield arr[lead:]
        finally:
            del arr
            with contextlib.suppress(BufferError):  # a view still alive: the map closes when it goes
                mm.close()

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def _same_shape(path: Path, f: pb.File) -> bool:
    """Whether ``path`` is a regular file of ``f``'s size whose header has ``f``'s length."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size != f.size:
            return False
        with open(path, "rb") as fh:
            return fh.read(8) == f.header[:8]  # the u64 header length opens a safetensors file
    except OSError:
        return False


def _write_header(path: Path, f: pb.File) -> None:
    with open(path, "r+b") as fh:
        if fh.read(len(f.header)) != f.header:
            fh.seek(0)
            fh.write(f.header)


def _same_layout(path: Path, f: pb.File) -> bool:
    """Whether ``path`` is a regular file of ``f``'s size that starts with ``f``'s header."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size != f.size:
            return False
        with open(path, "rb") as fh:
            return fh.read(len(f.header)) == f.header
    except OSError:
        return False


def _file_of(info: ManifestInfo, rel: str) -> tuple[int, int] | None:
    """(header length, size) of safetensors file ``rel`` in ``info``'s version."""
    for f in version_files(info):
        if f.path == rel and f.kind == pb.File.SAFETENSORS:
            return len(f.header), f.size
    return None


def _chunk_digest(
    sp: Placement | None, p: Placement, idx: int, start: ManifestInfo | None, info: ManifestInfo
) -> bytes | None:
    """The digest of chunk ``idx`` in ``start``'s version of the entry, when that chunk is the
    same byte range at the same place in the same file (same size, width and chunking); else None."""
    if sp is None or start is None or sp.file != p.file or sp.start != p.start:
        return None
    entry, t = sp.tensor, p.tensor
    if entry.nbytes != t.nbytes or idx >= len(entry.chunks):
        return None
    width = dtypes.element_width(t.dtype)
    if dtypes.element_width(entry.dtype) != width or start.codec.chunk_step(width) != info.codec.chunk_step(width):
        return None
    if tuple(entry.slice_offsets) != tuple(t.slice_offsets) or tuple(entry.full_shape) != tuple(t.full_shape):
        return None
    return bytes(entry.chunks[idx].target_digest)


def _copy_into(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)


def _replace_with(path: Path, write: Callable[[Path], None]) -> None:
    """Write a file next to ``path`` and rename it over ``path`` (a new inode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    tmp = path.with_name(f".{path.name}.deltasync-tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def version_path(repo: Repository, held: int, target: int) -> list[ManifestInfo] | None:
    """Manifests from ``held`` to ``target`` along parent links (either direction), or None
    when a snapshot or a missing version lies between them."""
    newer, older = (held, target) if held > target else (target, held)
    path: list[ManifestInfo] = []
    v: int | None = newer
    try:
        while v is not None and v >= older:
            info = repo.manifest(v)
            path.append(info)
            if v == older:
                break
            v = None if info.is_snapshot else info.parent
    except DeltasyncError:
        return None
    if not path or path[-1].version != older:
        return None
    return path if held > target else path[::-1]

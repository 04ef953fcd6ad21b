"""``deltasync gc``: retention of versions and collection of unreferenced objects.

**What is kept.** Retained versions are the last ``keep_last``, every version whose id is a
multiple of ``keep_every`` (if given), always the latest, and the pinned version (``refs/pin``). Required versions are the
retained ones plus every ancestor on each retained version's chain back to its nearest
snapshot (:meth:`Repository.chain`), so every retained version stays pullable. Everything
else is deleted. A squash (see squash.py) is kept exactly while both versions it connects
are kept, and its packs count as referenced. gc only ever deletes under ``manifests/``,
``squashes/``, ``packs/`` and ``blobs/`` (plus its own ``gc/pending.json`` and, in a local
store, temp files of interrupted writes); ``refs/latest``, the marker and any other prefix
are left alone. Before it deletes a manifest it writes the version's history record
(``history/<version>.json``, repo/history.py): the few digests a follower that held an
older version needs to check that a newer one extends it. Records are kept.

**Order.** Readers must never see a broken committed version, so:

1. Squashes that touch an unrequired version go first (a planner skips a squash whose
   version is missing, and falls back to plain deltas when its packs are), then manifests
   of unrequired versions, newest first. A delta's ancestors are older
   than it, so at every instant each manifest still present has its whole chain present:
   a concurrent ``log``/``verify``/pull sees a smaller repository, never a delta whose
   snapshot is gone. A required version's chain is never touched.
2. Then packs and blobs referenced by no remaining manifest. The manifest list is read
   again just before each phase, so a version committed while gc runs keeps its chain and
   its objects.

**Orphans and publishers in flight.** A pack or blob that no manifest references is either
left by a publisher that died before committing, or the upload of a publisher that has not
committed *yet*. Stores have no modification times (local, memory and S3 all look alike
here), so gc uses two phases: each run records the unreferenced objects it sees, with the
time it first saw them, in ``gc/pending.json``; a later run deletes only those recorded at
least ``grace_seconds`` earlier and still unreferenced. An orphan therefore needs two runs
to go, even with a grace of 0. Objects that only versions deleted in this very run
referenced are no exception: they become unreferenced at that moment, so they are recorded
with that time and wait out the grace like any orphan (a later run deletes them). A publish
that started before gc deleted those versions may reuse them (content-addressed objects are
uploaded once: a publisher skips what exists), and deleting them at once could land after
that publisher's checks (issue 33). The grace must be longer than the slowest publish (and
than clock skew between the hosts running gc).

**Publishes in flight: leases.** A publish writes a lease (``leases/<id>.json``, repo/leases.py)
before its first upload, renews it while it runs and deletes it after its commit or abandon.
Right before deleting any pack or blob (and again before each batch of deletions) gc reads the
leases: while one is live it deletes no pack or blob at all, whatever the grace (those it would
have deleted are recorded as unreferenced, for a run without live leases). So a publish that
started before gc's last look at the leases loses nothing, however long it takes. Leases of
killed publishers expire (:data:`~deltasync.repo.leases.LEASE_TTL` after their last renewal,
plus :data:`~deltasync.repo.leases.LEASE_SKEW` for clocks), and gc removes them.

**A publish slower than the grace** (publishers of older deltasync, which write no lease).
With a grace shorter than a publish, gc can delete
packs and blobs a publisher uploaded and has not committed yet (or ones a publisher reuses
because they exist: content-addressed objects are uploaded once). The publisher is the one
that notices: right before its commit it checks that every object its version names still
exists, stores the missing ones again and checks again, a bounded number of times
(``publish/commit.py``, "Objects deleted before the commit"), else it fails with nothing
committed. gc, for its part, re-lists the manifests before each batch of
``_DELETE_BATCH`` deletions and keeps what a version committed meanwhile names, and it
deletes only objects that an earlier run already saw unreferenced. What is left is an
instant, and only for a publish slower than the grace: gc deleting an object after the
publisher's check and before its manifest write (and after gc's last re-list); the
publisher checks once more after the commit and fails naming the object, and ``verify``
reports it. A grace longer than the slowest publish (the default, an hour) avoids all of
this.

**Temp files.** A local store writes each object to a temp file (``.<name>.<uuid>.tmp-deltasync``
beside it) and renames it; a publisher killed in between leaves the temp file, which
``list`` never shows. gc records them in ``gc/pending.json`` like orphans and removes one
once an earlier run saw it at least ``grace_seconds`` ago and its modification time is that
old too (a write still in progress keeps touching it). ``verify`` reports them.

**Concurrent pulls.** A pull of a retained version reads only that version's chain (a plan
from a locally held version walks back from the target and stops at the held version or
the nearest snapshot, so it stays inside the chain), and gc never deletes those manifests
or any object they reference. A pull may also take a squash out of a version gc deletes;
a chunk whose squash pack is gone is then rebuilt from plain deltas or the snapshot
(DESIGN.md invariant 3), so such a pull costs more bytes but still completes.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import CorruptObjectError, DeltasyncError, ObjectNotFoundError, UsageError, VersionNotFoundError
from ..format.manifest import MAX_MANIFEST_BYTES, ManifestInfo, manifest_key, parse_manifest
from ..progress import human_bytes
from ..repo.history import history_key, record as history_record
from ..repo.leases import read_leases
from ..repo.repository import Repository, blob_key, squash_key
from ..storage import LocalStore, Store, TempFile, is_temp_name
from ..v1 import manifest_pb2 as pb

PENDING = "gc/pending.json"
#: Read no more of it (about 4M pending objects); a larger one counts as unreadable.
MAX_PENDING_BYTES = 256 << 20
DEFAULT_GRACE_SECONDS = 3600.0
_COLLECTED = ("packs/", "blobs/")
_OBJECT_KEY = re.compile(r"(packs/[0-9a-f]{32}\.pack|blobs/[0-9a-f]{32})")
_DELETE_THREADS = 16
#: Objects deleted between two re-reads of the manifest list (module docstring, "Orphans").
_DELETE_BATCH = 256


@dataclass
class GcReport:
    """What a gc run kept and deleted (or, with ``dry_run``, would delete)."""

    dry_run: bool
    versions_kept: list[int] = field(default_factory=list)
    versions_deleted: list[int] = field(default_factory=list)
    squashes_kept: list[tuple[int, int]] = field(default_factory=list)
    squashes_deleted: list[tuple[int, int]] = field(default_factory=list)
    packs_deleted: list[str] = field(default_factory=list)
    blobs_deleted: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    pending: list[str] = field(default_factory=list)
    """Unreferenced objects recorded (or still waiting) for a later run: maybe a publish in flight."""
    temp_files_deleted: list[str] = field(default_factory=list)
    """Temp files of interrupted writes (killed publishers) removed, by path in the store."""
    temp_files_pending: list[str] = field(default_factory=list)
    """Temp files seen, waiting out the grace period (maybe a write in progress)."""
    leases: list[str] = field(default_factory=list)
    """Live publish leases seen: publishes in flight, for which no pack or blob was deleted."""
    leases_removed: list[str] = field(default_factory=list)
    """Leases of killed publishers (expired) removed."""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        verb = "would delete" if self.dry_run else "deleted"
        line = (
            f"{'gc (dry run)' if self.dry_run else 'gc'}: kept {len(self.versions_kept)} version(s), "
            f"{verb} {len(self.versions_deleted)} version(s), "
            f"{f'{len(self.squashes_deleted)} squash(es), ' if self.squashes_deleted else ''}"
            f"{len(self.packs_deleted)} pack(s), "
            f"{len(self.blobs_deleted)} blob(s), {human_bytes(self.bytes_freed)} "
            f"{'to free' if self.dry_run else 'freed'}"
        )
        if self.leases:
            line += f"; {len(self.leases)} publish(es) in flight (leases): no pack or blob deleted"
        if self.leases_removed:
            line += f"; {'would remove' if self.dry_run else 'removed'} {len(self.leases_removed)} expired lease(s)"
        if self.pending:
            line += f"; {len(self.pending)} unreferenced object(s) wait for the grace period"
        if self.temp_files_deleted:
            line += f"; {'would remove' if self.dry_run else 'removed'} {len(self.temp_files_deleted)} temp file(s) " \
                    "of interrupted writes"
        if self.temp_files_pending:
            line += f"; {len(self.temp_files_pending)} temp file(s) wait for the grace period"
        return line


def collect(
    repo: str | Store | Repository,
    *,
    keep_last: int,
    keep_every: int | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    dry_run: bool = False,
    clock: Callable[[], float] = time.time,
) -> GcReport:
    """Delete versions outside the retention policy and objects nothing references.

    ``keep_last`` (>= 1) newest versions, every version whose id is a multiple of
    ``keep_every`` and the latest are kept, with the chains they need. Unreferenced objects
    (those of the versions this run deletes included) are deleted only once an earlier run
    recorded them unreferenced at least ``grace_seconds`` ago. ``clock`` gives the wall-clock time (seconds since the epoch).
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise UsageError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    if keep_every is not None and (isinstance(keep_every, bool) or not isinstance(keep_every, int) or keep_every < 1):
        raise UsageError(f"keep_every must be an integer >= 1, got {keep_every!r}")
    if not isinstance(grace_seconds, int | float) or not math.isfinite(grace_seconds) or grace_seconds < 0:
        raise UsageError(f"grace_seconds must be a finite number >= 0, got {grace_seconds!r}")
    r = repo if isinstance(repo, Repository) else Repository(repo)
    r.ensure_exists()
    return _Collector(r, dry_run).run(keep_last, keep_every, float(grace_seconds), clock)


class _Collector:
    def __init__(self, repo: Repository, dry_run: bool) -> None:
        self.repo = repo
        self.store = repo.store
        self.report = GcReport(dry_run=dry_run)
        self.required: set[int] = set()
        self.seen: set[int] = set()  # every version listed so far

    def run(self, keep_last: int, keep_every: int | None, grace: float, clock: Callable[[], float]) -> GcReport:
        report = self.report
        versions = self.repo.versions()
        self.seen.update(versions)
        retained = set(versions[-keep_last:])
        if keep_every is not None:
            retained.update(v for v in versions if v % keep_every == 0)
        pinned = self.repo.pinned()
        if pinned is not None and pinned in versions:
            retained.add(pinned)  # the version agents are told to serve stays, with its chain
        # Nothing is deleted before every retained chain is known to be whole.
        for v in sorted(retained):
            self._require(v)
        doomed = sorted(set(versions) - self.required, reverse=True)  # newest first: see module docstring

        # Objects of the doomed versions, read before their manifests go: they start a grace
        # period now (module docstring, "Orphans").
        freed: set[str] = set()
        records: dict[int, bytes] = {}  # what followers need of them to check history (repo/history.py)
        for v in doomed:
            try:
                info = self.repo.manifest(v)
            except CorruptObjectError as e:
                report.notes.append(f"{e}; its objects are collected as orphans")
                continue
            freed.update(_references(info))
            body = history_record(info.pb)
            if body is not None:
                records[v] = body

        # Phase 1: squashes touching a doomed version, then manifests. Squashes are listed
        # first: a squash is written after its versions, so both are among those refreshed.
        squashes = self.repo.squashes()
        self._refresh()
        doomed = [v for v in doomed if v not in self.required]
        deleted = set(doomed)
        doomed_squashes = [(a, c) for a, c in squashes if {a, c} & deleted or not {a, c} <= self.seen]
        for a, c in doomed_squashes:
            refs = self._squash_references(a, c)
            if refs is not None:
                freed.update(refs)
        for a, c in doomed_squashes:
            report.bytes_freed += self._object_bytes(squash_key(a, c))
            if not report.dry_run:
                self.store.delete(squash_key(a, c))
            report.squashes_deleted.append((a, c))
        for v in doomed:
            key = manifest_key(v)
            report.bytes_freed += self._manifest_bytes(v)
            if not report.dry_run:
                if v in records:  # first: a follower walking back through v finds one or the other
                    self.store.put(history_key(v), records[v])
                self.store.delete(key)
            report.versions_deleted.append(v)

        # Phase 2: objects. List them before the manifests: an object uploaded after this
        # listing is not a candidate; one listed before is referenced by every manifest
        # committed by the time the manifests are read below.
        listed = [k for prefix in _COLLECTED for k in self.store.list(prefix) if _OBJECT_KEY.fullmatch(k)]
        remaining = sorted(set(self._refresh()) - deleted)
        referenced: set[str] = set()
        for v in remaining:
            try:
                referenced.update(_references(self.repo.manifest(v)))
            except VersionNotFoundError:
                continue  # deleted meanwhile (another gc): what it named is no longer needed
        report.versions_kept = remaining
        kept, gone = set(remaining), set(report.squashes_deleted)
        for a, c in self.repo.squashes():
            if (a, c) in gone or a not in kept or c not in kept:
                continue  # one the next run deletes (its versions went meanwhile): keep nothing for it
            refs = self._squash_references(a, c)
            if refs is not None:
                referenced.update(refs)
                report.squashes_kept.append((a, c))

        now = clock()
        pending = self._load_pending()
        to_delete: dict[str, int | None] = {}  # key -> size if known
        new_pending: dict[str, float] = {}
        for key in listed:
            if key in referenced:
                continue
            if key in freed:
                # Unreferenced from this run on: a publish that started before this run's
                # deletes may reuse it (it exists), so it waits out the grace like an orphan.
                new_pending[key] = now
                continue
            first_seen = pending.get(key)
            if first_seen is not None and now - first_seen >= grace:
                to_delete[key] = None
            else:
                new_pending[key] = now if first_seen is None else first_seen
        report.pending = sorted(new_pending)
        new_pending.update(self._temp_files(pending, now, grace))

        items = sorted(to_delete.items())
        known, late = set(remaining) | deleted, set[str]()
        if not items:
            self._publishing(clock())  # nothing to delete: only removes expired leases
        for begin in range(0, len(items), _DELETE_BATCH):
            if self._publishing(clock()):
                # A publish in flight may commit any of them (its uploads, or objects it reuses):
                # none goes; they wait, recorded, for a run without live leases.
                for key, _size in items[begin:]:
                    new_pending[key] = pending.get(key, now)
                report.pending = sorted(set(report.pending) | {k for k, _ in items[begin:]})
                break
            # A version committed since the manifests were read keeps what it names: its
            # publisher checked that these objects exist just before committing (encode.py).
            late |= self._late_references(known)
            batch = [item for item in items[begin : begin + _DELETE_BATCH] if item[0] not in late]
            for key, size in _map(lambda item: self._delete_object(*item), batch):
                if size is None:
                    continue  # already gone (another gc, or an abandoned publish cleaning up)
                report.bytes_freed += size
                (report.packs_deleted if key.startswith("packs/") else report.blobs_deleted).append(key)
        if not report.dry_run and (new_pending or pending):
            self._save_pending(new_pending)
        return report

    # -- helpers -----------------------------------------------------------------------------

    def _publishing(self, now: float) -> bool:
        """Whether a live publish lease exists (module doc); removes expired ones (once)."""
        found, bad = read_leases(self.store)
        live = [lease for lease in found if lease.live(now)]
        for key in [lease.key for lease in found if not lease.live(now)] + bad:
            if key in self.report.leases_removed:
                continue
            if not self.report.dry_run:
                with contextlib.suppress(ObjectNotFoundError):
                    self.store.delete(key)
            self.report.leases_removed.append(key)
        self.report.leases = sorted(set(self.report.leases) | {lease.key for lease in live})
        return bool(live)

    def _require(self, version: int) -> None:
        for info in self.repo.chain(version):
            self.required.add(info.version)

    def _refresh(self) -> list[int]:
        """The versions now committed; keeps the chains of those committed since gc started."""
        versions = self.repo.versions()
        for v in versions:
            if v not in self.seen:
                self.seen.add(v)
                try:
                    self._require(v)
                except DeltasyncError:
                    # Its chain already lacks a deleted manifest (committed on top of a
                    # version gc deleted): nothing left to protect but its own objects.
                    self.required.add(v)
        return versions

    def _late_references(self, known: set[int]) -> set[str]:
        """Objects named by versions committed since ``known`` was listed (added to it)."""
        out: set[str] = set()
        for v in self.repo.versions():
            if v in known:
                continue
            known.add(v)
            try:
                out.update(_references(self.repo.manifest(v)))
            except DeltasyncError:
                continue  # deleted meanwhile, or unreadable: it protects nothing
        return out

    def _manifest_bytes(self, version: int) -> int:
        return self._object_bytes(manifest_key(version))

    def _object_bytes(self, key: str) -> int:
        try:
            return self.store.size(key)
        except ObjectNotFoundError:
            return 0

    def _squash_references(self, a: int, c: int) -> dict[str, int | None] | None:
        """Objects a squash names; None (with a note) when it is gone or unreadable."""
        key = squash_key(a, c)
        try:
            return _references(parse_manifest(self.store.get(key, max_bytes=MAX_MANIFEST_BYTES), expect_version=c))
        except ObjectNotFoundError:
            return None
        except CorruptObjectError as e:
            self.report.notes.append(f"squash {a}->{c}: {e}; its objects are collected as orphans")
            return None

    def _delete_object(self, key: str, size: int | None) -> tuple[str, int | None]:
        try:
            actual = self.store.size(key) if size is None else size
        except ObjectNotFoundError:
            return key, None
        if not self.report.dry_run:
            self.store.delete(key)
        return key, actual

    def _load_pending(self) -> dict[str, float]:
        return _read_pending(self.store, self.report.notes)

    def _temp_files(self, pending: dict[str, float], now: float, grace: float) -> dict[str, float]:
        """Remove temp files of interrupted writes (local stores) seen by an earlier run at
        least ``grace`` ago and untouched that long; returns the others, to record."""
        local = local_store(self.store)
        if local is None:
            return {}
        waiting: dict[str, float] = {}
        for t in local.temp_files():
            first_seen = pending.get(t.path)
            # Two runs, like objects; the mtime also guards a write slower than the grace.
            if first_seen is None or now - first_seen < grace or now - t.mtime < grace:
                waiting[t.path] = now if first_seen is None else first_seen
                continue
            if not self.report.dry_run and not local.remove_temp_file(t.path):
                continue  # its writer finished or removed it meanwhile
            self.report.temp_files_deleted.append(t.path)
            self.report.bytes_freed += t.size
        self.report.temp_files_pending = sorted(waiting)
        return waiting

    def _save_pending(self, pending: dict[str, float]) -> None:
        if not pending:
            self.store.delete(PENDING)
            return
        body = {"format": 1, "objects": dict(sorted(pending.items()))}
        self.store.put(PENDING, json.dumps(body, indent=0).encode())


def recorded_unreferenced(store: Store) -> set[str]:
    """Objects gc's record (``gc/pending.json``) holds: unreferenced, waiting out the grace.
    An unreadable record holds none."""
    return set(_read_pending(store, []))


def _read_pending(store: Store, notes: list[str]) -> dict[str, float]:
    """Objects earlier runs saw unreferenced, with when first seen. Damage resets the clock."""
    try:
        raw = json.loads(store.get(PENDING, max_bytes=MAX_PENDING_BYTES))
        objects = raw["objects"]
        if raw.get("format") != 1 or not isinstance(objects, dict):
            raise ValueError
    except ObjectNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError, RecursionError, CorruptObjectError):  # too large included
        notes.append(f"{PENDING} was unreadable; unreferenced objects start a new grace period")
        return {}
    return {
        k: float(t)
        for k, t in objects.items()
        if isinstance(k, str) and (_OBJECT_KEY.fullmatch(k) or _is_temp_path(k))
        and isinstance(t, int | float) and math.isfinite(t)
    }


def local_store(store: Store) -> LocalStore | None:
    """The local store under ``store`` (through wrappers such as a throttle), or None."""
    while not isinstance(store, LocalStore):
        inner = getattr(store, "inner", None)
        if not isinstance(inner, Store):
            return None
        store = inner
    return store


def temp_files(store: Store) -> list[TempFile]:
    """Temp files of interrupted writes in a local store: a publisher killed between writing a
    temp file and renaming it leaves one, invisible to ``list``. Other stores have none to
    list (an S3 multipart upload a killed writer leaves is not an object: a bucket
    lifecycle rule aborts those)."""
    local = local_store(store)
    return local.temp_files() if local is not None else []


def _is_temp_path(path: str) -> bool:
    parts = path.split("/")
    return is_temp_name(parts[-1]) and not any(p in ("", ".", "..") for p in parts)


def _references(info: ManifestInfo) -> dict[str, int | None]:
    """Object keys a manifest names, with their size where the manifest records it (packs)."""
    out: dict[str, int | None] = {p.key: p.size for p in info.pb.packs}
    for f in info.pb.files:
        if f.kind == pb.File.BLOB:
            for part in f.blob_parts:
                out[blob_key(part)] = None
    return out


def _map(fn: Callable[[tuple[str, int | None]], tuple[str, int | None]],
         items: Iterable[tuple[str, int | None]]) -> list[tuple[str, int | None]]:
    with ThreadPoolExecutor(max_workers=_DELETE_THREADS, thread_name_prefix="deltasync-gc") as pool:
        return list(pool.map(fn, items))

"""Two slots per directory copy, and the atomic switch between them.

A copy at ``DIR`` keeps the files of two versions in ``DIR/.deltasync/slots/0`` and
``.../slots/1``. ``DIR/.deltasync/current`` is a symbolic link to the slot served, and every
file of the served version appears in ``DIR`` as a relative link through it::

    DIR/model.safetensors -> .deltasync/current/model.safetensors
    DIR/.deltasync/current -> slots/1

A pull brings the *other* slot forward to the target in place, touching only what changed
(slotfill.py), verifies it, and then switches: one ``rename`` of ``current``, which is
atomic, so a path opened in ``DIR`` resolves either wholly to the old version or wholly to
the new one; the served slot is never written. Links of files that only the new version has
are made before the switch (dangling until it), links of files it lacks are dropped after.

What a reader may see: a file opened (or mapped) from version N keeps N's bytes while N is
served and while the next version N+1 is. Only when N+2 is written into N's slot could its
bytes change under a reader, and before that write every file of the slot still open or
mapped by another process (found in ``/proc``) is first copied to a new inode, which the
rewrite then changes instead; the reader keeps the old one. So no reader is ever shown new
bytes under a file it opened, on Linux; elsewhere (no ``/proc``), a reader must re-open
files within one version.

Durability: a switch is recorded in the copy's LMDB state with the boot it happened in. By
default the slot is not flushed before the switch (the rewrite dirties pages all over the
file when changes are spread out, and flushing them costs as much as writing the model);
after a power loss, i.e. a later boot, a copy whose served slot was not flushed is checked
chunk by chunk and repaired before it is used again. ``fsync=True`` flushes before the
switch instead. A killed process loses nothing either way: the page cache survives it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from ..durable import fsync_dir
from ..errors import CheckpointError, DeltasyncError, UsageError
from ..format.manifest import ManifestInfo, check_relpath, serialize
from .state import (
    STATE_DIR,
    SlotInfo,
    SlotsRecord,
    StateDB,
    WorkInProgress,
    apply_legacy_journal,
    copy_lock,
    output_files,
)

log = logging.getLogger(__name__)

SLOTS_DIR = "slots"
CURRENT = "current"
ASIDE = "aside"
SLOT_NAMES = ("0", "1")


def slot_dir(root: Path, name: str) -> Path:
    return root / STATE_DIR / SLOTS_DIR / name


def other(name: str | None) -> str:
    return "1" if name == "0" else "0"


def link_target(rel: str) -> str:
    """What ``DIR/rel`` links to: the file in the served slot, relative to the link."""
    depth = rel.count("/")
    return "../" * depth + f"{STATE_DIR}/{CURRENT}/{rel}"


def boot_id() -> str:
    """This boot's id (Linux), or "" where there is none: then no power loss is detected."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def file_stat(path: Path) -> tuple[int, ...] | None:
    """What tells a file was written since it was verified: (size, mtime, ctime, inode)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def slot_stats(root: Path, name: str, files: Iterable[str]) -> dict[str, tuple[int, ...]]:
    found = {rel: file_stat(slot_dir(root, name) / rel) for rel in files}
    return {rel: st for rel, st in found.items() if st is not None}


def untouched(root: Path, name: str, info: SlotInfo, rel: str) -> bool:
    """Whether file ``rel`` of slot ``name`` is as it was when the slot was verified."""
    recorded = info.files.get(rel)
    return recorded is not None and tuple(recorded) == file_stat(slot_dir(root, name) / rel)


def fsync_files(paths: Iterable[Path]) -> None:
    dirs: set[Path] = set()
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(p.parent)
    for d in dirs:
        fsync_dir(d)


# -- the layout -----------------------------------------------------------------------------------


def ensure_slots(root: Path, db: StateDB) -> SlotsRecord:
    """The slots record of the copy at ``root``, moving a copy of older deltasync (files in
    ``DIR`` itself) into slot 0 first: each file is hard-linked into the slot (copied where
    links fail) and then replaced by its link, so every path keeps resolving to the same bytes."""
    record = db.slots()
    if record is not None:
        return record
    state = db.state()
    if state is None:
        return SlotsRecord(None)
    slot = slot_dir(root, "0")
    for rel in state.files:
        src, dest = root / check_relpath(rel), slot / rel
        if src.is_symlink() or not src.is_file() or dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dest)
        except OSError:
            tmp = dest.with_name(f".{dest.name}.deltasync-tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
    point_current(root, "0")
    for rel in state.files:
        make_link(root, rel)
    record = SlotsRecord("0", {"0": SlotInfo(state.version)}, boot_id(), synced=True)
    db.set_slots(record)
    log.info("%s: moved version %d into slot 0 (two-slot layout)", root, state.version)
    return record


def point_current(root: Path, name: str) -> None:
    """Atomically make ``current`` point at slot ``name``."""
    state_dir = root / STATE_DIR
    tmp = state_dir / f".{CURRENT}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(f"{SLOTS_DIR}/{name}", tmp)
    os.replace(tmp, state_dir / CURRENT)
    fsync_dir(state_dir)


def make_link(root: Path, rel: str) -> None:
    """Make ``DIR/rel`` the link to the served slot's file (replacing what is there, atomically)."""
    path = root / check_relpath(rel)
    want = link_target(rel)
    if path.is_symlink() and os.readlink(path) == want:
        return
    parts = rel.split("/")
    for i in range(1, len(parts)):  # a file in the old version, a directory in the new one
        drop_link(root, "/".join(parts[:i]))
    _refuse_symlinked_dirs(root, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():  # a directory in the old version, a file in the new one
        for p in sorted(path.rglob("*"), reverse=True):
            sub = p.relative_to(root).as_posix()
            if p.is_symlink() and os.readlink(p) == link_target(sub):
                p.unlink()
            elif p.is_dir() and not p.is_symlink():
                with contextlib.suppress(OSError):
                    p.rmdir()
        try:
            path.rmdir()
        except OSError:
            raise CheckpointError(str(path), "is a directory holding files that are not the repository's, "
                                  f"where the version has the file {rel}") from None
    tmp = path.with_name(f".{path.name}.deltasync-link")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(want, tmp)
    os.replace(tmp, path)


def drop_link(root: Path, rel: str) -> None:
    path = root / rel
    with contextlib.suppress(OSError, DeltasyncError):
        check_relpath(rel)
        if path.is_symlink() and os.readlink(path) == link_target(rel):
            path.unlink()
            _prune_empty_dirs(root, path.parent)


def refuse_symlinked_dirs(root: Path, files: Iterable[str]) -> None:
    """CheckpointError when a directory on the way to any of ``files`` in ``root`` is a
    symbolic link: checked for all of them before anything is written, so a refused pull or
    switch leaves ``root`` as it was (no link made for some files and not the others). Our
    own link to a file of the version served is no obstacle: the switch replaces it."""
    for rel in files:
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            d = root / sub
            if d.is_symlink() and os.readlink(d) != link_target(sub):
                raise CheckpointError(str(d), "is a symbolic link; deltasync does not write through links")


def _refuse_symlinked_dirs(root: Path, rel: str) -> None:
    parts = rel.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        d = root / "/".join(parts[:i])
        if d.is_symlink():
            raise CheckpointError(str(d), "is a symbolic link; deltasync does not write through links")


def _prune_empty_dirs(out: Path, d: Path) -> None:
    while d != out and out in d.parents:
        try:
            d.rmdir()
        except OSError:
            return
        d = d.parent


# -- the switch -----------------------------------------------------------------------------------


def switch(root: Path, db: StateDB, name: str, info: ManifestInfo, *, repo: str, synced: bool) -> None:
    """Serve slot ``name``, whose files are ``info``'s, complete and verified. Journaled: a
    process killed at any point leaves a copy that :func:`finish_switch` completes."""
    old = db.state()
    new_files = output_files(info)
    refuse_symlinked_dirs(root, new_files)  # before the journal: a refused switch changes nothing
    remove = sorted(set(old.files if old is not None else ()) - set(new_files))
    wip = WorkInProgress(info.version, "install", time.time(), install=tuple(new_files), remove=tuple(remove), slot=name)
    db.set_wip(wip, manifest=serialize(info.pb))
    record = db.slots() or SlotsRecord(None)
    db.set_slots(record.replace(synced=synced))
    _apply_switch(root, db, info, wip, repo)


def finish_switch(root: Path) -> int | None:
    """Complete a switch that a crash interrupted; returns its version, or None if none was."""
    db = StateDB.open(root, create=False)
    if db is None:
        return None
    wip = db.wip()
    if wip is None or wip.phase != "install":
        return None
    info = db.wip_manifest()
    if info is None or info.version != wip.target:  # pragma: no cover - written in one transaction
        db.set_wip(None)
        return None
    held = db.state()
    repo = held.repo if held is not None else ""
    if not wip.slot:  # a journal of older deltasync: files moved from incoming/ into DIR
        apply_legacy_journal(root, root / STATE_DIR / "incoming", info, wip, db, repo)
        return info.version
    _apply_switch(root, db, info, wip, repo)
    return info.version


def _apply_switch(root: Path, db: StateDB, info: ManifestInfo, wip: WorkInProgress, repo: str) -> None:
    for rel in wip.install:
        make_link(root, rel)
    point_current(root, wip.slot)
    for rel in wip.remove:
        drop_link(root, rel)
    record = db.slots() or SlotsRecord(None)
    held = db.manifest()
    previous = record.active
    slots = {wip.slot: SlotInfo(info.version, files=slot_stats(root, wip.slot, output_files(info)))}
    raw_previous: bytes | None = None
    if previous is not None and previous != wip.slot and held is not None:
        slots[previous] = SlotInfo(held.version, files=record.info(previous).files)
        raw_previous = serialize(held.pb)
    db.record_switch(
        info, SlotsRecord(wip.slot, slots, boot_id(), record.synced), repo=repo, slot_manifest=raw_previous,
    )


def finish_install(out: str | os.PathLike[str]) -> int | None:
    """Complete a switch (or an older deltasync's install) that a crash interrupted; returns
    its version, or None if none was."""
    return finish_switch(Path(out))


def install_staged(out: str | os.PathLike[str], staging: Path, info: ManifestInfo, *, repo: str = "") -> None:
    """Serve the verified files of ``info`` in directory ``staging`` (moved, whole, into the
    slot not served) as the copy's version, with the same journaled switch as a pull."""
    root = Path(out)
    with copy_lock(root):
        finish_switch(root)
        db = StateDB.open(root)
        assert db is not None
        record = ensure_slots(root, db)
        name = other(record.active)
        dest = slot_dir(root, name)
        db.set_slots(record.replace(slots={**record.slots, name: SlotInfo(None)}))
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, dest)
        fsync_files(dest / rel for rel in output_files(info))
        old = db.state()
        switch(root, db, name, info, repo=repo or (old.repo if old is not None else ""), synced=True)


# -- files that are not the version's ---------------------------------------------------------------


#: Files a model loader may read from a directory: weights, configs, tokenizers.
LOADER_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".npz", ".onnx", ".json",
    ".model", ".tiktoken",
)
LOADER_NAMES = ("vocab.txt", "merges.txt")


def loader_reads(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.endswith(LOADER_SUFFIXES) or name in LOADER_NAMES


def foreign_files(root: Path, owned: Iterable[str], also: Iterable[str] = ()) -> list[str]:
    """Files and links in ``root`` that a loader may read (weights, configs, tokenizers; see
    :data:`LOADER_SUFFIXES`) and that are not the links of ``owned`` files, plus any that
    sit where the version to install (``also``) has a file. Hidden entries (names starting
    with a dot) and other files (notes, READMEs) are left alone."""
    mine = set(owned)
    wanted = set(also)
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") or (here / d).is_symlink())
        names = filenames + [d for d in dirnames if (here / d).is_symlink()]
        dirnames[:] = [d for d in dirnames if not (here / d).is_symlink()]
        for name in sorted(names):
            if name.startswith("."):
                continue
            rel = (here / name).relative_to(root).as_posix()
            path = here / name
            if path.is_symlink() and os.readlink(path) == link_target(rel) and (rel in mine or rel in wanted):
                continue
            if loader_reads(rel) or rel in wanted:
                found.append(rel)
    return sorted(found)


def settle_foreign(root: Path, owned: Iterable[str], also: Iterable[str] = (), *, move_aside: bool) -> list[str]:
    """Refuse (UsageError naming them) or move into ``DIR/.deltasync/aside/<time>/`` the
    files of ``root`` that are not the copy's: a loader would read them beside the version."""
    found = foreign_files(root, owned, also)
    if not found:
        return []
    if not move_aside:
        shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
        raise UsageError(
            f"{root} holds files that are not the repository's: {shown}; a loader would read them beside the "
            f"version. Remove them, or pass --move-aside (library: move_aside=True) to move them into "
            f"{root / STATE_DIR / ASIDE}/"
        )
    dest_root = root / STATE_DIR / ASIDE / time.strftime("%Y%m%d-%H%M%S")
    for rel in found:
        dest = dest_root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(root / rel, dest)
        _prune_empty_dirs(root, (root / rel).parent)
    log.warning("moved %d file(s) that were not the repository's into %s", len(found), dest_root)
    return found


# -- readers of a slot about to be rewritten -------------------------------------------------------


def open_elsewhere(paths: Iterable[Path]) -> set[Path]:
    """Those of ``paths`` that another process has open or mapped (from ``/proc``; empty
    where there is none, or for processes this one may not inspect)."""
    by_inode: dict[int, list[tuple[int, Path]]] = {}
    for p in paths:
        with contextlib.suppress(OSError):
            st = os.stat(p)
            by_inode.setdefault(st.st_ino, []).append((st.st_dev, p))
    if not by_inode:
        return set()
    found: set[Path] = set()
    me = str(os.getpid())
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit() and d != me]
    except OSError:
        return set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    for dev, p in by_inode.get(st.st_ino, ()):
                        if dev == st.st_dev:
                            found.add(p)
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) < 6 or fields[4] == "0":
                    continue
                for dev, p in by_inode.get(int(fields[4]), ()):
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    if os.major(dev) == major and os.minor(dev) == minor:
                        found.add(p)
    return found


def detach_readers(paths: Iterable[Path]) -> list[Path]:
    """Give every file of ``paths`` that another process holds open a new inode (a copy
    renamed over it), so that rewriting the file in place leaves that reader's bytes alone."""
    held = sorted(open_elsewhere(paths))
    for p in held:
        tmp = p.with_name(f".{p.name}.deltasync-detach")
        shutil.copyfile(p, tmp)
        os.replace(tmp, p)
    if held:
        log.warning("%d file(s) of an older version are still open elsewhere; copied before the rewrite: %s",
                    len(held), ", ".join(str(p) for p in held[:4]))
    return held

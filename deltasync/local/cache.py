"""Objects of recent versions kept inside a local copy, and the store view that uses them.

Manifests, blob parts and packs never change once committed, so a copy can keep the ones it
read and serve them to itself later. ``DIR/.deltasync/objects/`` holds them under their
store keys: manifests and blob parts whole, packs as the pieces that were read
(``packs/<name>/<offset>-<length>``, or ``packs/<name>/whole`` when the pack was read whole).
With the payloads of the deltas it applied at hand, a
copy rolls back a few versions (reversing the deltas, see local/slotfill.py), or returns to a
version it held, without reading anything from the repository.

Only packs named in :attr:`CachedStore.capture` are kept (what a reader names through
:class:`~deltasync.local.kept.KeptObjects`: the deltas a copy's agent applies, the chain an
engine agent or a worker follows): a plain pull keeps nothing of its packs. :meth:`LocalCache.prune` keeps what a set of
versions references and deletes the rest. A damaged cached object costs a download, never a
wrong bit: payloads are checked by the digests of the chunks they decode to, manifests by
parsing them, blob parts by their digests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path

import zstandard

from ..durable import fsync_file
from ..errors import DeltasyncError
from ..format.digest import digest
from ..format.manifest import ManifestInfo, manifest_key, parse_manifest, version_from_key
from ..repo.repository import BLOB_PART_BYTES, blob_key
from ..storage import Store, WrappingStore

_WHOLE_PREFIXES = ("manifests/", "blobs/")
_WHOLE = "whole"  # a pack kept whole (read whole by the pull)


def kind_of(key: str) -> str:
    """What a store key holds, for counting: packs, blobs, manifests, refs or other."""
    head = key.split("/", 1)[0]
    return head if head in ("packs", "blobs", "manifests", "refs") else "other"


class LocalCache:
    """Immutable store objects under ``root``. Thread-safe."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._pieces: dict[str, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.root / key

    def _pieces_of(self, key: str) -> list[tuple[int, int]]:
        with self._lock:
            found = self._pieces.get(key)
            if found is None:
                found = []
                with contextlib.suppress(OSError):
                    for name in os.listdir(self._path(key)):
                        off, sep, length = name.partition("-")
                        if sep and off.isdigit() and length.isdigit():
                            found.append((int(off), int(length)))
                self._pieces[key] = found
            return list(found)

    def _piece(self, key: str, byte_range: tuple[int, int]) -> tuple[int, int] | None:
        off, length = byte_range
        for p_off, p_len in self._pieces_of(key):
            if p_off <= off and off + length <= p_off + p_len:
                return p_off, p_len
        return None

    def has(self, key: str, byte_range: tuple[int, int] | None) -> bool:
        if key.startswith(_WHOLE_PREFIXES):
            return self._path(key).is_file()
        if (self._path(key) / _WHOLE).is_file():
            return True
        return byte_range is not None and self._piece(key, byte_range) is not None

    def get(self, key: str, byte_range: tuple[int, int] | None) -> bytes | None:
        try:
            if key.startswith(_WHOLE_PREFIXES):
                data = self._path(key).read_bytes()
                if byte_range is None:
                    return data
                off, length = byte_range
                return data[off : off + length] if off + length <= len(data) else None
            whole = self._path(key) / _WHOLE
            if byte_range is None:
                return whole.read_bytes() if whole.is_file() else None
            piece = self._piece(key, byte_range)
            name, start = (f"{piece[0]}-{piece[1]}", piece[0]) if piece is not None else (_WHOLE, 0)
            if piece is None and not whole.is_file():
                return None
            with open(self._path(key) / name, "rb") as f:
                data = os.pread(f.fileno(), byte_range[1], byte_range[0] - start)
            return data if len(data) == byte_range[1] else None
        except OSError:
            return None

    def put(self, key: str, byte_range: tuple[int, int] | None, data: bytes) -> None:
        """Keep ``data`` (best effort: a cache that cannot be written is only a cache)."""
        if key.startswith(_WHOLE_PREFIXES):
            if byte_range is not None:
                return
            path = self._path(key)
        elif byte_range is None:
            path = self._path(key) / _WHOLE
        else:
            path = self._path(key) / f"{byte_range[0]}-{len(data)}"
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                fsync_file(f)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        if not key.startswith(_WHOLE_PREFIXES) and byte_range is not None:
            with self._lock:
                self._pieces.setdefault(key, []).append((byte_range[0], len(data)))

    def forget(self, key: str) -> None:
        """Drop a damaged object; the next read fetches it again."""
        with self._lock:
            self._pieces.pop(key, None)
        path = self._path(key)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()

    def bound(self) -> tuple[bytes | None] | None:
        """The identity :meth:`bind` kept objects for, as a 1-tuple (None: not bound yet)."""
        try:
            name = (self.root / "repository").read_text().strip()
        except OSError:
            return None
        if name == "-":
            return (None,)
        try:
            return (bytes.fromhex(name),)
        except ValueError:
            return None

    def bind(self, identity: bytes | None) -> bool:
        """Keep objects of the repository with ``identity`` only (its ``deltasync.json`` id;
        None: one without): kept objects of another one (deleted and created again at the
        same URL, say, whose version N is another) are all dropped. Returns whether they were."""
        mark = self.root / "repository"
        name = identity.hex() if identity is not None else "-"
        try:
            held: str | None = mark.read_text().strip()
        except OSError:
            held = None
        if held == name:
            return False
        dropped = held is not None or (self.root.is_dir() and any(self.root.iterdir()))
        with self._lock:
            self._pieces.clear()
        for sub in ("manifests", "blobs", "packs"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)
        mark.write_text(name + "\n")
        return dropped

    def forget_packs(self) -> None:
        """Drop every kept pack piece."""
        with self._lock:
            self._pieces.clear()
        shutil.rmtree(self.root / "packs", ignore_errors=True)

    def manifest(self, version: int) -> ManifestInfo | None:
        """A kept manifest, parsed (not authenticated: callers use it to decide, never to apply)."""
        data = self.get(manifest_key(version), None)
        if data is None:
            return None
        try:
            return parse_manifest(data, expect_version=version)
        except DeltasyncError:
            return None

    def versions(self) -> list[int]:
        try:
            names = os.listdir(self.root / "manifests")
        except OSError:
            return []
        return sorted(v for n in names if (v := version_from_key(f"manifests/{n}")) is not None)

    def prune(self, keep: Iterable[int], *, snapshots: Iterable[int] = ()) -> None:
        """Keep the manifests of ``keep``, the blob parts they name and the packs of those
        of them that are deltas (and of those in ``snapshots``, snapshots too: an engine-first
        agent keeps the chain it restarts from); delete everything else."""
        keys: set[str] = set()
        whole = set(snapshots)
        for v in set(keep) | whole:
            info = self.manifest(v)
            if info is None:
                continue
            keys.add(manifest_key(v))
            keys.update(blob_key(d) for f in info.pb.files for d in f.blob_parts)
            if not info.is_snapshot or v in whole:
                keys.update(p.key for p in info.pb.packs)
        for kind in ("manifests", "blobs", "packs"):
            try:
                names = os.listdir(self.root / kind)
            except OSError:
                continue
            for name in names:
                key = f"{kind}/{name}"
                if key not in keys:
                    self.forget(key)


class CachedStore(WrappingStore):
    """A repository's store as a local copy sees it: reads count what they download, and
    are served from the copy's :class:`LocalCache` when it holds the object."""

    def __init__(self, inner: Store, cache: LocalCache | None = None) -> None:
        super().__init__(inner)
        self.cache = cache
        self.capture: set[str] = set()
        """Pack keys whose pieces are kept when read (the deltas being applied)."""
        self.fetched: dict[str, int] = {}
        """Bytes downloaded, by kind of key (see :func:`kind_of`)."""
        self.served_locally = 0
        self._lock = threading.Lock()

    @property
    def fetched_bytes(self) -> int:
        with self._lock:
            return sum(self.fetched.values())

    def fetched_by_kind(self) -> dict[str, int]:
        """A consistent snapshot of :attr:`fetched` (safe while other threads read)."""
        with self._lock:
            return dict(self.fetched)

    def _keeps(self, key: str) -> bool:
        return self.cache is not None and (key.startswith(_WHOLE_PREFIXES) or key in self.capture)

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        if self.cache is not None:
            data = self.cache.get(key, byte_range)
            if data is not None and not _intact(data, key):
                self.cache.forget(key)
                data = None
            if data is not None:
                with self._lock:
                    self.served_locally += len(data)
                return data
        data = self.inner.get(key, byte_range)
        with self._lock:
            kind = kind_of(key)
            self.fetched[kind] = self.fetched.get(kind, 0) + len(data)
        if self.cache is not None and self._keeps(key):
            self.cache.put(key, byte_range, data)
        return data


def _intact(data: bytes, key: str) -> bool:
    """Whether a kept manifest parses and a kept blob part matches its digest (pack pieces
    are checked by the chunk digests of what they decode to)."""
    try:
        if key.startswith("manifests/"):
            parse_manifest(data, expect_version=version_from_key(key))
        elif key.startswith("blobs/"):
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=BLOB_PART_BYTES)
            return digest(raw).hex() == key.removeprefix("blobs/")
    except (DeltasyncError, zstandard.ZstdError):
        return False
    return True

"""Local filesystem store: one file per key, atomic writes (temp file, fsync, rename)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from ..durable import fsync_dir, fsync_file
from ..errors import ObjectExistsError, ObjectNotFoundError, ObjectRangeError, StoreError
from . import _base
from ._base import Store, listing_too_long, read_limit, too_large

_TMP_SUFFIX = ".tmp-deltasync"


class TempFile(NamedTuple):
    """A temp file of an interrupted write (a writer killed between its write and its rename)."""

    path: str  # relative to the store's root, '/'-separated
    size: int
    mtime: float  # seconds since the epoch, from the file system


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of this store's temp files (never a key :meth:`list` shows)."""
    return name.startswith(".") and name.endswith(_TMP_SUFFIX)


class LocalStore(Store):
    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.fsync = fsync

    def _path(self, key: str) -> Path:
        return self.root / key

    def _open(self, key: str) -> int:
        """A descriptor of ``key``'s regular file, reached without following a symbolic link
        anywhere below the root: a link would let the store (and a relay serving it) hand out
        files from outside its root. Links, directories and special files are not objects."""
        dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            *dirs, name = key.split("/")
            for seg in dirs:
                inner = os.open(seg, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                os.close(dir_fd)
                dir_fd = inner
            # O_NONBLOCK: opening a FIFO planted in the store must not hang the reader.
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FileNotFoundError(errno.ENOENT, "not a regular file")
        return fd

    def _linked_dir(self, key: str) -> Path | None:
        """The first directory on the way to ``key`` that is a symbolic link, if any."""
        path = self.root
        for seg in key.split("/")[:-1]:
            path = path / seg
            if path.is_symlink():
                return path
        return None

    def _link_error(self, key: str, link: Path, action: str) -> StoreError:
        return StoreError(
            f"cannot {action} {key}: {link} is a symbolic link, and a local repository reads nothing through links "
            f"below its root (so that it, and a relay serving it, never hand out files from elsewhere): make it a real "
            f"directory (mount the other disk there) or put the whole repository on the other disk"
        )

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        limit = read_limit()
        try:
            fd = self._open(key)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            link = self._linked_dir(key)  # O_NOFOLLOW | O_DIRECTORY on a link: ENOTDIR
            if link is not None:
                raise self._link_error(key, link, "read") from None
            raise ObjectNotFoundError(key) from None
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symbolic link: not an object of this store
                link = self._linked_dir(key)
                if link is not None:
                    raise self._link_error(key, link, "read") from None
                raise ObjectNotFoundError(key) from None
            raise StoreError(f"cannot read {self._path(key)}: {e.strerror}") from None
        try:
            with open(fd, "rb", closefd=True) as f:
                size = os.fstat(fd).st_size
                if byte_range is None:
                    if limit is None:
                        return f.read()
                    if size > limit:
                        raise too_large(key, size, limit)
                    data = f.read(limit + 1)  # the file may grow after the fstat
                    if len(data) > limit:
                        raise too_large(key, None, limit)
                    return data
                offset, length = byte_range
                # Checked before reading: a hostile length must not become a huge buffer.
                if offset + length > size:
                    raise ObjectRangeError(key, f"range {offset}+{length} past end of {size}-byte object")
                data = os.pread(fd, length, offset)
        except OSError as e:
            raise StoreError(f"cannot read {self._path(key)}: {e.strerror}") from None
        if len(data) != length:
            raise ObjectRangeError(key, f"range {offset}+{length} past end of object (got {len(data)} bytes)")
        return data

    def _put(self, key: str, data: bytes | bytearray | memoryview, if_absent: bool) -> None:
        link = self._linked_dir(key)
        if link is not None:  # reads would not follow it: refuse to write what could not be read back
            raise self._link_error(key, link, "write")
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    fsync_file(f)
            if if_absent:
                # link() fails if the name exists: of racing writers exactly one wins.
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise ObjectExistsError(key) from None
                finally:
                    tmp.unlink(missing_ok=True)
            else:
                os.replace(tmp, path)
            if self.fsync:
                fsync_dir(path.parent, strict=True)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            if e.errno == errno.ENOSPC:
                raise StoreError(f"no space left writing {path}") from None
            raise StoreError(f"cannot write {path}: {e.strerror}") from None

    def _list(self, prefix: str) -> Iterator[str]:
        # Walk only the directory the prefix names, not the whole tree.
        head, _, _ = prefix.rpartition("/")
        start = self.root / head if head else self.root
        if not start.is_dir():
            return iter(())
        keys: list[str] = []
        for dirpath, _dirnames, filenames in os.walk(start):
            rel = os.path.relpath(dirpath, self.root)
            for name in filenames:
                if is_temp_name(name) or not _regular(os.path.join(dirpath, name)):
                    continue  # links and special files are no objects of this store (see _open)
                key = name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
                    if len(keys) > _base.MAX_LIST_KEYS:
                        raise listing_too_long(prefix, self.root)
        keys.sort()
        return iter(keys)

    def temp_files(self) -> list[TempFile]:
        """Temp files left under the root by writers that died before their rename (a killed
        publisher): invisible to :meth:`list`, so only ``verify`` and ``gc`` look for them."""
        out: list[TempFile] = []
        if not self.root.is_dir():
            return out
        for dirpath, _dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if not is_temp_name(name):
                    continue
                full = os.path.join(dirpath, name)
                try:
                    st = os.lstat(full)
                except OSError:
                    continue  # renamed or removed by its writer meanwhile
                out.append(TempFile(os.path.relpath(full, self.root).replace(os.sep, "/"), st.st_size, st.st_mtime))
        out.sort()
        return out

    def remove_temp_file(self, path: str) -> bool:
        """Remove one temp file named by :meth:`temp_files`; False if it was gone already."""
        full = self.root / path
        if not is_temp_name(full.name) or ".." in path.split("/"):
            raise StoreError(f"not a temp file of this store: {path}")
        try:
            full.unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StoreError(f"cannot delete {full}: {e.strerror}") from None
        return True

    def _delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as e:
            raise StoreError(f"cannot delete {self._path(key)}: {e.strerror}") from None

    def _size(self, key: str) -> int:
        try:
            fd = self._open(key)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFoundError(key) from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ObjectNotFoundError(key) from None
            raise StoreError(f"cannot stat {self._path(key)}: {e.strerror}") from None
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)


def _regular(path: str) -> bool:
    """A regular file, not a link to one (lstat: one call per listed name)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False  # removed meanwhile

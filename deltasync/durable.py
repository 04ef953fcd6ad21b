"""Making writes durable: the fsync endings every writer of files shares.

A file's bytes are durable once the file is flushed and fsynced; its name (a rename, a link,
a new entry) once its directory is. Writers that must not lose a committed object (the local
store, the kept objects of a chain, a copy's state and slots) end their writes here.
"""

from __future__ import annotations

import os
from typing import IO


def fsync_file(f: IO[bytes]) -> None:
    """Flush ``f``'s buffer and its bytes to disk."""
    f.flush()
    os.fsync(f.fileno())


def fsync_dir(path: str | os.PathLike[str], *, strict: bool = False) -> None:
    """Flush a directory's entries (renames, links, new files) to disk. Best effort unless
    ``strict``: a filesystem that cannot fsync a directory then raises its OSError."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if strict:
            raise
        return
    try:
        os.fsync(fd)
    except OSError:
        if strict:
            raise
    finally:
        os.close(fd)


__all__ = ["fsync_dir", "fsync_file"]

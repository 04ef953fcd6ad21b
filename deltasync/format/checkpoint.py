"""Checkpoint directories: safetensors files (single or sharded) plus any other files.

Safetensors files are parsed by hand rather than loaded, because a rebuild must be byte
for byte: the header is kept verbatim and tensor bytes are read and written as ranges with
pread/pwrite, a chunk at a time, so no file is ever held in memory.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import CheckpointError
from . import dtypes
from .manifest import MAX_DIMS, MAX_HEADER_BYTES

INDEX_NAME = "model.safetensors.index.json"
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorLayout:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    data_offset: int  # inside the data section, which starts right after the header


@dataclass(frozen=True)
class SafetensorsFile:
    path: Path
    relpath: str
    header: bytes  # 8-byte length prefix + JSON, verbatim
    tensors: tuple[TensorLayout, ...]  # ordered by data_offset
    size: int

    @property
    def data_start(self) -> int:
        return len(self.header)


@dataclass(frozen=True)
class CheckpointDir:
    root: Path
    files: tuple[str, ...]  # every regular file, relative, '/'-separated, sorted
    safetensors: dict[str, SafetensorsFile]


def read_safetensors(path: Path, relpath: str) -> SafetensorsFile:
    """Parse and validate a safetensors header; raises CheckpointError naming the file."""
    name = str(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(name, "not a safetensors file (shorter than its 8-byte header length)")
            (hlen,) = _U64.unpack(prefix)
            if hlen > MAX_HEADER_BYTES or hlen > size - 8:
                raise CheckpointError(name, f"corrupt safetensors header (claims {hlen} bytes in a {size}-byte file)")
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(name, f"cannot read ({e.strerror})") from None
    try:
        meta: Any = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(name, "corrupt safetensors header (not JSON)") from None
    except RecursionError:  # JSON nested thousands deep: no header is
        raise CheckpointError(name, "corrupt safetensors header (JSON nested too deeply)") from None
    if not isinstance(meta, dict):
        raise CheckpointError(name, "corrupt safetensors header (not a JSON object)")
    tensors: list[TensorLayout] = []
    for key, entry in meta.items():
        if key == "__metadata__":
            continue
        tensors.append(_parse_entry(name, key, entry))
    tensors.sort(key=lambda t: (t.data_offset, t.nbytes))
    end = 0
    for t in tensors:
        if t.data_offset != end:
            raise CheckpointError(name, f"corrupt safetensors header (tensor {t.name!r} does not start at {end})")
        end += t.nbytes
    if 8 + hlen + end != size:
        raise CheckpointError(
            name, f"truncated or padded safetensors file ({size} bytes, header says {8 + hlen + end})"
        )
    return SafetensorsFile(path, relpath, prefix + raw, tuple(tensors), size)


def _parse_entry(name: str, key: str, entry: Any) -> TensorLayout:
    bad = CheckpointError(name, f"corrupt safetensors header (entry {key!r})")
    if not isinstance(entry, dict):
        raise bad
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in dtypes.ITEMSIZE:
        raise CheckpointError(name, f"unsupported dtype {dtype!r} for tensor {key!r}")
    # ``type(...) is int``: JSON true/false are Python bools, which isinstance takes for ints.
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(type(d) is int and d >= 0 for d in shape)):
        raise bad
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise bad
    begin, stop = offsets
    nbytes = math.prod(shape) * dtypes.itemsize(dtype)
    if begin < 0 or stop - begin != nbytes:
        raise CheckpointError(name, f"corrupt safetensors header (tensor {key!r} has {stop - begin} bytes, shape says {nbytes})")
    return TensorLayout(key, dtype, tuple(shape), nbytes, begin)


def scan_checkpoint(path: str | os.PathLike[str], *, follow_symlinks: bool = False) -> CheckpointDir:
    """A checkpoint directory (or a single .safetensors file) ready to publish.

    Every file published must be a regular file that resolves inside the directory: a
    symbolic link whose target lies outside it, a symbolic link to a directory, a dangling
    link and a special file (FIFO, socket, device) are each a :class:`CheckpointError` naming
    the path, never silently published or dropped. ``follow_symlinks`` allows links out of
    the directory and into other directories (a Hugging Face cache snapshot links into its
    ``blobs/``); dangling links and special files stay errors. Names starting with
    ``.deltasync`` are deltasync's own (a manifest cannot hold them): any such entry is an
    error too, but for the top-level ``.deltasync`` directory of a local copy (its state),
    which is not part of the checkpoint and is skipped.
    """
    root = Path(path)
    if root.is_file():
        if root.suffix != ".safetensors":
            raise CheckpointError(str(root), "not a checkpoint directory or .safetensors file")
        st = read_safetensors(root, root.name)
        return CheckpointDir(root.parent, (root.name,), {root.name: st})
    if not root.exists():
        raise CheckpointError(str(root), "no such checkpoint directory")
    if not root.is_dir():
        raise CheckpointError(str(root), "not a directory")
    files = _walk_checkpoint(root, follow_symlinks)
    st_files = {rel: read_safetensors(root / rel, rel) for rel in files if rel.endswith(".safetensors")}
    if not st_files:
        raise CheckpointError(str(root), "no .safetensors files in this directory")
    _check_index(root, files)
    seen: dict[str, str] = {}
    for rel, st in st_files.items():
        for t in st.tensors:
            if t.name in seen:
                raise CheckpointError(str(root), f"tensor {t.name!r} is in both {seen[t.name]} and {rel}")
            seen[t.name] = rel
    return CheckpointDir(root, tuple(files), st_files)


_RESERVED = ".deltasync"  # names a manifest refuses (format/manifest.py check_relpath)
_COPY_STATE = ".deltasync"  # a local copy's state directory (local/state.py STATE_DIR)
_FOLLOW_HINT = "publish --follow-symlinks (PublisherConfig(follow_symlinks=True)) publishes it anyway"


def _walk_checkpoint(root: Path, follow_symlinks: bool) -> list[str]:
    """Relative paths of the files to publish, sorted; raises on anything that is not one."""
    real_root = os.path.realpath(root)
    files: list[str] = []
    visited: set[str] = {real_root}  # real paths of directories walked: a link loop ends here
    pending: list[tuple[Path, str]] = [(root, "")]
    while pending:
        here, rel_dir = pending.pop()
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError as e:
            raise CheckpointError(str(here), f"cannot list ({e.strerror})") from None
        for entry in entries:
            if entry.name.startswith(_RESERVED):
                if not rel_dir and entry.name == _COPY_STATE and entry.is_dir(follow_symlinks=False):
                    continue  # a pulled copy published again: its state is not its checkpoint
                raise CheckpointError(
                    entry.path, f"is named {entry.name!r}: names starting with {_RESERVED} are reserved for "
                    "deltasync's own state and cannot be published (rename or remove it)"
                )
            full = Path(entry.path)
            rel = f"{rel_dir}{entry.name}"
            try:
                lst = os.lstat(full)
            except OSError as e:
                raise CheckpointError(str(full), f"cannot stat ({e.strerror})") from None
            is_link = stat.S_ISLNK(lst.st_mode)
            try:
                st = os.stat(full) if is_link else lst
            except OSError:
                raise CheckpointError(
                    str(full), f"is a dangling symbolic link (to {os.readlink(full)!r}); remove it or fix its target"
                ) from None
            if is_link and not follow_symlinks:
                target = os.path.realpath(full)
                if stat.S_ISDIR(st.st_mode):
                    raise CheckpointError(str(full), f"is a symbolic link to a directory ({target}); {_FOLLOW_HINT}")
                if os.path.commonpath([real_root, target]) != real_root:
                    raise CheckpointError(
                        str(full), f"is a symbolic link to {target}, outside the checkpoint directory; {_FOLLOW_HINT}"
                    )
            if stat.S_ISDIR(st.st_mode):
                real = os.path.realpath(full)
                if real in visited:
                    raise CheckpointError(str(full), f"is a symbolic link loop (to {real}, already published)")
                visited.add(real)
                pending.append((full, f"{rel}/"))
            elif stat.S_ISREG(st.st_mode):
                files.append(rel)
            else:
                raise CheckpointError(str(full), f"is a {_kind(st.st_mode)}, not a regular file; only regular "
                                      "files can be published (move it out of the checkpoint directory)")
    files.sort()
    return files


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device file"
    return "special file"


def _check_index(root: Path, files: list[str]) -> None:
    if INDEX_NAME not in files:
        return
    try:
        with open(root / INDEX_NAME, "rb") as f:
            raw = f.read(MAX_HEADER_BYTES + 1)  # an index is far smaller than this; never read more
        if len(raw) > MAX_HEADER_BYTES:
            raise CheckpointError(str(root / INDEX_NAME), f"corrupt index (larger than {MAX_HEADER_BYTES} bytes)")
        index = json.loads(raw)
        shards = set(index["weight_map"].values())
    except RecursionError:
        raise CheckpointError(str(root / INDEX_NAME), "corrupt index (JSON nested too deeply)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(str(root / INDEX_NAME), "corrupt index (no weight_map)") from None
    missing = sorted(s for s in shards if not isinstance(s, str) or s not in files)
    if missing:
        raise CheckpointError(str(root / INDEX_NAME), f"names missing shard(s): {', '.join(map(str, missing))}")


def build_header(tensors: Iterable[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, list[int]]:
    """A safetensors header for (name, dtype, shape, nbytes) in order; returns header and offsets."""
    # Written entry by entry, byte for byte what json.dumps(separators=(",", ":")) makes of
    # the dict of entries: a version of a million tensors (a hostile manifest's, say) must
    # not become a million dicts first. Names are unique here (as in a dict).
    parts = ['{"__metadata__":{"format":"pt"}']
    offsets: list[int] = []
    pos = 0
    for name, dtype, shape, nbytes in tensors:
        dims = ",".join(map(str, shape))
        fields = f'"dtype":{json.dumps(dtype)},"shape":[{dims}],"data_offsets":[{pos},{pos + nbytes}]'
        parts.append(f",{json.dumps(name)}:{{{fields}}}")
        offsets.append(pos)
        pos += nbytes
    parts.append("}")
    body = "".join(parts).encode()
    del parts
    body += b" " * (-len(body) % 8)  # safetensors pads the header to 8-byte alignment
    return _U64.pack(len(body)) + body, offsets


class FileReader:
    """Thread-safe positional reads from many files, keeping descriptors open."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def read(self, path: Path, offset: int, length: int) -> npt.NDArray[np.uint8]:
        try:
            data = os.pread(self._fd(path), length, offset)
        except OSError as e:
            raise CheckpointError(str(path), f"cannot read ({e.strerror})") from None
        if len(data) != length:
            raise CheckpointError(str(path), f"truncated: wanted {length} bytes at {offset}, got {len(data)}")
        return np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Where a version's bytes live in a directory: files, and each manifest entry's place in them.

A version of files (published from a checkpoint directory) keeps its own file layout; a
library version (published from a state dict) lands in one safetensors file,
``model.safetensors``, whose header is rebuilt from the manifest. Both the pull side (slots,
see slots.py) and check/repair (check.py) place and read bytes through this module.

A safetensors file is *proven* byte-identical to its manifest without reading it whole when
its header and size match the manifest and its entries tile the data section exactly (no
gap, no overlap; :func:`tiles`): every data byte then belongs to exactly one chunk, and
every chunk was checked against its digest when it was written. The manifest's whole-file
digest is checked only when a file is written whole.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ..format import dtypes
from ..format.checkpoint import FileReader, build_header
from ..format.digest import StreamDigest
from ..format.manifest import ManifestInfo, key_of, logical_shape
from ..format.slices import runs
from ..v1 import manifest_pb2 as pb
from .state import LIBRARY_FILE

Bits = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Placement:
    """Where one manifest entry's bytes live in a directory copy of its version."""

    file: str  # relative path
    start: int  # offset in the file of the entry's data (of the whole logical tensor, for a slice)
    tensor: pb.Tensor

    @property
    def contiguous(self) -> bool:
        """Whether the entry's bytes are one run in the file (not a slice of a larger tensor)."""
        return not self.tensor.full_shape


def placements(info: ManifestInfo) -> dict[str, Placement]:
    """Entry key -> placement, for a version of files or a library version (one file)."""
    if info.pb.files:
        headers = {f.path: len(f.header) for f in info.pb.files}
        return {key_of(t): Placement(t.file, headers[t.file] + t.data_offset, t) for t in info.pb.tensors}
    header, offsets = library_layout(info)
    return {key_of(t): Placement(LIBRARY_FILE, len(header) + offsets[t.name], t) for t in info.pb.tensors}


def version_files(info: ManifestInfo) -> list[pb.File]:
    """The files of a version in a directory (a library version: one safetensors file)."""
    if info.pb.files:
        return list(info.pb.files)
    header, _ = library_layout(info)
    size = len(header) + sum(math.prod(logical_shape(t)) * dtypes.itemsize(t.dtype) for t in first_of_each_name(info))
    return [pb.File(path=LIBRARY_FILE, kind=pb.File.SAFETENSORS, header=header, size=size)]


def tiles(info: ManifestInfo, f: pb.File) -> bool:
    """Whether the entries of safetensors file ``f`` cover its data section exactly once
    (what lets chunk digests stand for the file's digest). Sliced entries never do: the parts
    no rank published are zeros that no digest covers."""
    spans = sorted((t.data_offset, t.nbytes) for t in info.pb.tensors if t.file == f.path and not t.full_shape)
    if any(t.full_shape for t in info.pb.tensors if t.file == f.path) or not info.pb.files:
        return False
    at = 0
    for off, n in spans:
        if off != at:
            return False
        at += n
    return len(f.header) + at == f.size


def read_placed(reader: FileReader, root: Path, p: Placement, off: int, length: int) -> Bits:
    """Bytes [off, off + length) of entry ``p`` from its file under ``root`` (CheckpointError
    when the file is missing or short)."""
    t = p.tensor
    if not t.full_shape:
        return reader.read(root / p.file, p.start + off, length)
    buf = np.empty(length, dtype=np.uint8)
    for dst, src, n in runs(t.full_shape, t.slice_offsets, t.shape, dtypes.itemsize(t.dtype), off, off + length):
        buf[src : src + n] = reader.read(root / p.file, p.start + dst, n)
    return buf


def write_placed(fd: int, p: Placement, off: int, data: Bits) -> None:
    t = p.tensor
    if not t.full_shape:
        os.pwrite(fd, data.data, p.start + off)
        return
    for dst, src, n in runs(t.full_shape, t.slice_offsets, t.shape, dtypes.itemsize(t.dtype), off, off + len(data)):
        os.pwrite(fd, data[src : src + n].data, p.start + dst)


def file_digest(path: Path) -> bytes | None:
    """Digest of a regular file's bytes (following a link), or None when it is not one (or unreadable)."""
    d = StreamDigest()
    try:
        if not path.is_file():
            return None
        with open(path, "rb") as fh:
            while block := fh.read(8 << 20):
                d.update(block)
    except OSError:
        return None
    return d.digest()


def first_of_each_name(info: ManifestInfo) -> list[pb.Tensor]:
    seen: dict[str, pb.Tensor] = {}
    for t in info.pb.tensors:
        seen.setdefault(t.name, t)
    return list(seen.values())


def library_layout(info: ManifestInfo) -> tuple[bytes, dict[str, int]]:
    """The safetensors header of a version published from a state dict, and each tensor's
    data offset in it (sliced tensors appear once, whole, in their logical shape)."""
    firsts = first_of_each_name(info)
    header, offsets = build_header(  # a generator: no list of every entry's fields first
        (t.name, t.dtype, logical_shape(t), math.prod(logical_shape(t)) * dtypes.itemsize(t.dtype)) for t in firsts
    )
    return header, {t.name: o for t, o in zip(firsts, offsets, strict=True)}

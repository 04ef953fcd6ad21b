"""Slices of tensors: the pieces that ranks hold under FSDP and tensor parallelism.

A slice is a hyper-rectangle (offsets, shape) of a logical tensor of ``full_shape``. Its
bytes are stored row-major as a tensor of its own shape; these helpers map between a
slice's bytes and the logical tensor's, and find which bytes a wanted region needs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import UsageError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Slice:
    """A rank's piece of a logical tensor, for :class:`deltasync.DistributedPublisher`.

    ``tensor`` holds the region of the logical tensor of ``full_shape`` that starts at
    ``offsets`` (one per dimension) and has ``tensor``'s shape.
    """

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    full_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        check_region(tuple(self.full_shape), tuple(self.offsets), tuple(self.tensor.shape))


@dataclass(frozen=True)
class Region:
    """A hyper-rectangle of a logical tensor: what one inference rank needs."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]


def check_region(full_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int]) -> None:
    if not (len(full_shape) == len(offsets) == len(shape)):
        raise UsageError(f"slice offsets {tuple(offsets)} and shape {tuple(shape)} do not match {tuple(full_shape)}")
    for f, o, s in zip(full_shape, offsets, shape, strict=True):
        if o < 0 or s < 0 or o + s > f:
            raise UsageError(f"slice at {tuple(offsets)} of shape {tuple(shape)} lies outside {tuple(full_shape)}")


def entry_key(name: str, offsets: Sequence[int]) -> str:
    """Manifest entries are keyed by name, and by name and offsets for slices."""
    return f"{name}@{','.join(map(str, offsets))}" if offsets else name


def intersect(
    a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int], b_shape: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off, strict=True))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a_off, a_shape, b_off, b_shape, strict=True))
    if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))


def byte_span(
    entry_off: Sequence[int], entry_shape: Sequence[int], region_off: Sequence[int], region_shape: Sequence[int],
    itemsize: int,
) -> tuple[int, int]:
    """The [start, end) bytes of an entry's row-major data that hold ``region`` (inside it)."""
    strides = _strides(entry_shape)
    first = sum((r - e) * st for r, e, st in zip(region_off, entry_off, strides, strict=True))
    last = sum((r + s - 1 - e) * st for r, s, e, st in zip(region_off, region_shape, entry_off, strides, strict=True))
    return first * itemsize, (last + 1) * itemsize


def _strides(shape: Sequence[int]) -> list[int]:
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return out


def copy_region(
    src: npt.NDArray[np.uint8], src_off: Sequence[int], src_shape: Sequence[int],
    dst: npt.NDArray[np.uint8], dst_off: Sequence[int], dst_shape: Sequence[int],
    region_off: Sequence[int], region_shape: Sequence[int], itemsize: int,
) -> None:
    """Copy ``region`` (logical coordinates) from one row-major byte buffer to another."""
    if math.prod(region_shape) == 0:
        return
    s = src.reshape(*src_shape, itemsize)
    d = dst.reshape(*dst_shape, itemsize)
    s_idx: tuple[Any, ...] = tuple(
        slice(r - o, r - o + n) for r, o, n in zip(region_off, src_off, region_shape, strict=True)
    )
    d_idx: tuple[Any, ...] = tuple(
        slice(r - o, r - o + n) for r, o, n in zip(region_off, dst_off, region_shape, strict=True)
    )
    d[d_idx] = s[s_idx]


def runs(
    full_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int], itemsize: int, start: int, end: int
) -> list[tuple[int, int, int]]:
    """Where bytes [start, end) of a slice's row-major data go in the logical tensor.

    Returns (byte offset in the logical tensor, byte offset relative to ``start``, length)
    for each contiguous run; a run is at most one row of the slice's last dimension.
    """
    if end <= start:
        return []
    row = shape[-1] * itemsize
    rows = np.arange(start // row, (end - 1) // row + 1, dtype=np.int64)
    if len(shape) > 1:
        idx = np.unravel_index(rows, tuple(shape[:-1]))
        shifted = tuple(i + o for i, o in zip(idx, offsets[:-1], strict=True))
        full_rows = np.ravel_multi_index(shifted, tuple(full_shape[:-1])).astype(np.int64)
    else:
        full_rows = np.zeros(len(rows), dtype=np.int64)
    src = rows * row
    dst = (full_rows * full_shape[-1] + offsets[-1]) * itemsize
    lo = np.maximum(src, start)
    hi = np.minimum(src + row, end)
    return [(int(d + (a - s)), int(a - start), int(b - a)) for d, s, a, b in zip(dst, src, lo, hi, strict=True)]

"""Tensor and partial pulls: which chunks a request needs, and the tensors assembled from them.

A pull may ask for every tensor, some tensors by name, or a region (hyper-rectangle) of a
tensor, as one tensor-parallel inference rank holds it. Tensors published as slices by
several ranks (``deltasync.Slice``) are several manifest entries; they come back whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..errors import UsageError
from ..format import dtypes
from ..format.manifest import ManifestInfo, key_of, logical_shape
from ..format.slices import Region, byte_span, check_region, copy_region, intersect
from ..format.tensors import bits_to_tensor
from ..v1 import manifest_pb2 as pb
from .plan import Want

if TYPE_CHECKING:
    import torch

Bits = npt.NDArray[np.uint8]


@dataclass
class TensorRequest:
    """One tensor the caller asked for: the whole logical tensor, or a region of it."""

    dtype: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    parts: list[pb.Tensor]  # manifest entries that may hold some of it


def select_tensors(
    info: ManifestInfo, tensors: Iterable[str] | None, regions: Mapping[str, Region] | None
) -> tuple[Want | None, dict[str, TensorRequest]]:
    """What a pull of ``tensors`` and ``regions`` of ``info`` asks for (both None: everything):
    the chunks to materialise (None: all) and, by tensor name, how to assemble each answer."""
    groups: dict[str, list[pb.Tensor]] = {}
    for t in info.pb.tensors:
        groups.setdefault(t.name, []).append(t)

    def parts_of(name: str) -> list[pb.Tensor]:
        parts = groups.get(name)
        if parts is None:
            raise UsageError(f"version {info.version} has no tensor {name!r}")
        return parts

    requests: dict[str, TensorRequest] = {}
    if tensors is None and regions is None:
        for name, parts in groups.items():
            shape = logical_shape(parts[0])
            requests[name] = TensorRequest(parts[0].dtype, (0,) * len(shape), shape, parts)
        return None, requests
    want: dict[str, set[int]] = {}
    for name in tensors or ():
        parts = parts_of(name)
        shape = logical_shape(parts[0])
        requests[name] = TensorRequest(parts[0].dtype, (0,) * len(shape), shape, parts)
        for t in parts:
            want.setdefault(key_of(t), set()).update(range(len(t.chunks)))
    for name, region in (regions or {}).items():
        if name in requests:
            raise UsageError(f"tensor {name!r} is asked for both whole and as a region")
        parts = parts_of(name)
        offsets, shape = tuple(region.offsets), tuple(region.shape)
        check_region(logical_shape(parts[0]), offsets, shape)
        requests[name] = TensorRequest(parts[0].dtype, offsets, shape, parts)
        itemsize = dtypes.itemsize(parts[0].dtype)
        for t in parts:
            e_off = tuple(t.slice_offsets) or (0,) * len(t.shape)
            inter = intersect(e_off, tuple(t.shape), offsets, shape)
            if inter is None or not t.chunks:
                continue
            start, end = byte_span(e_off, tuple(t.shape), inter[0], inter[1], itemsize)
            step = info.codec.chunk_step(dtypes.element_width(t.dtype))
            want.setdefault(key_of(t), set()).update(range(start // step, (end - 1) // step + 1))
    return {key: sorted(idx) for key, idx in want.items()}, requests


def assemble(req: TensorRequest, out: dict[str, Bits]) -> torch.Tensor:
    """The tensor ``req`` asks for, from materialised entries ``out`` (bits by entry key).
    Parts of a sliced tensor that no entry holds read as zeros."""
    only = req.parts[0]
    if len(req.parts) == 1 and not only.full_shape and req.shape == tuple(only.shape):
        return bits_to_tensor(out[key_of(only)], req.dtype, req.shape)  # the entry itself, no copy
    itemsize = dtypes.itemsize(req.dtype)
    buf = np.zeros(math.prod(req.shape) * itemsize, dtype=np.uint8)
    for t in req.parts:
        e_off = tuple(t.slice_offsets) or (0,) * len(t.shape)
        inter = intersect(e_off, tuple(t.shape), req.offsets, req.shape)
        if inter is not None:
            copy_region(out[key_of(t)], e_off, tuple(t.shape), buf, req.offsets, req.shape, inter[0], inter[1], itemsize)
    return bits_to_tensor(buf, req.dtype, req.shape)

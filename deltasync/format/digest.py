"""xxh3-128 digests of raw bytes, and the version digest over ordered chunk digests."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
import xxhash
from typing_extensions import Buffer

DIGEST_SIZE = 16

#: What digests accept: any contiguous buffer, numpy arrays included.
BytesLike: TypeAlias = Buffer | npt.NDArray[Any]


def _buffer(data: BytesLike) -> Buffer:
    return data.data if isinstance(data, np.ndarray) else data


def digest(data: BytesLike) -> bytes:
    """xxh3-128 of ``data`` (any buffer: bytes, memoryview, contiguous numpy array)."""
    return bytes(xxhash.xxh3_128_digest(_buffer(data)))


def version_digest(chunk_digests: Iterable[bytes]) -> bytes:
    """The version digest: xxh3-128 over the ordered chunk target digests."""
    h = xxhash.xxh3_128()
    for d in chunk_digests:
        h.update(d)
    return bytes(h.digest())


def hexdigest(d: bytes) -> str:
    return d.hex()


class StreamDigest:
    """Incremental xxh3-128, for whole files written or read piecewise."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: BytesLike) -> None:
        self._h.update(_buffer(data))

    def digest(self) -> bytes:
        return bytes(self._h.digest())

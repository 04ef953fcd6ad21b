"""xxh3-128 digests of raw bytes, and the version digest over ordered chunk digests."""

from __future__ import annotations

from collections.abc import Iterable

from typing_extensions import Buffer

import xxhash

DIGEST_SIZE = 16


def digest(data: Buffer) -> bytes:
    """xxh3-128 of ``data`` (any buffer: bytes, memoryview, contiguous numpy array)."""
    return bytes(xxhash.xxh3_128_digest(data))


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

    def update(self, data: Buffer) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return bytes(self._h.digest())

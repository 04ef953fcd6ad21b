"""The chunk codec: per chunk, the smallest of same / sparse / dense / full.

Everything works on bit patterns (unsigned integer views of the raw bytes), never on
float values, which is what makes it lossless: -0.0 vs +0.0 and NaN payloads survive.
The element width (1, 2, 4 or 8 bytes) only decides the byte-plane split.

Payload layouts (``codec_version`` 1), all integers little-endian:

* ``SAME``   — empty.
* ``FULL``   — zstd(planes(target)).
* ``DENSE``  — u8 transform, then zstd(planes(change of every element)).
* ``SPARSE`` — u8 transform, u8 position coding, u8 gap width, u8 pad, u64 count,
  u64 length of the position section; then zstd(positions), zstd(planes(changes)).

``transform`` is 0 for XOR of the bit patterns, 1 for the zigzag of the wrapping integer
difference (so that a change of -1 ulp is as small as +1 ulp). ``position coding`` is 0 for a
bitmap of changed elements, 1 for gaps between changed indices as unsigned integers of
one byte each (255 escapes to a u32 in a second stream; ``gap width`` is 1).
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

import numpy as np
import numpy.typing as npt
import zstandard

from .errors import CorruptObjectError, UsageError
from .v1 import manifest_pb2 as pb

SAME = pb.SAME
SPARSE = pb.SPARSE
DENSE = pb.DENSE
FULL = pb.FULL

ENCODING_NAMES: dict[Encoding, str] = {SAME: "same", SPARSE: "sparse", DENSE: "dense", FULL: "full"}

_UINT: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT: dict[int, type[np.signedinteger]] = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

_XOR, _ZIGZAG = 0, 1
_BITMAP, _GAPS = 0, 1
_SPARSE_HEADER = struct.Struct("<BBBBQQ")
_DENSE_HEADER = struct.Struct("<B")
_U64 = struct.Struct("<Q")

Bytes = npt.NDArray[np.uint8]


Encoding: TypeAlias = pb.Encoding


@dataclass(frozen=True)
class EncodedChunk:
    encoding: Encoding
    payload: bytes


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not safe to share between threads; keep one per thread.
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def _unzstd(data: bytes | memoryview, expected: int, what: str) -> bytes:
    """Decompress a frame whose decoded size must be exactly ``expected`` bytes."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(what, f"bad zstd frame ({e})") from None
    if size != expected:
        raise CorruptObjectError(what, f"zstd frame holds {size} bytes, expected {expected}")
    try:
        out = _decompressor().decompress(data, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise CorruptObjectError(what, f"zstd decode failed ({e})") from None
    if len(out) != expected:
        raise CorruptObjectError(what, f"decoded {len(out)} bytes, expected {expected}")
    return out


def planes(values: npt.NDArray[np.generic], width: int) -> bytes:
    """Byte planes: byte 0 of every element, then byte 1 of every element, ..."""
    raw = values.view(np.uint8)
    if width == 1:
        return raw.tobytes()
    return raw.reshape(-1, width).T.tobytes()


def unplanes(data: bytes, width: int) -> Bytes:
    raw = np.frombuffer(data, dtype=np.uint8)
    if width == 1:
        return raw
    return np.ascontiguousarray(raw.reshape(width, -1).T).reshape(-1)


def _zigzag(diff: npt.NDArray[np.unsignedinteger], width: int) -> npt.NDArray[np.unsignedinteger]:
    s = diff.view(_INT[width])
    shift = 8 * width - 1
    return ((s << 1) ^ (s >> shift)).view(_UINT[width])


def _unzigzag(zz: npt.NDArray[np.unsignedinteger], width: int) -> npt.NDArray[np.unsignedinteger]:
    u = _UINT[width]
    one = u(1)
    out: npt.NDArray[np.unsignedinteger] = (zz >> one) ^ (u(0) - (zz & one))
    return out


@dataclass(frozen=True, kw_only=True)
class PlanesZstdCodec:
    """Byte-plane + zstd chunk codec; its fields are recorded in every manifest.

    Candidates that cannot win at a chunk's density are not tried unless ``exhaustive``:
    dense only above ``dense_min_density`` of elements changed, full only above
    ``full_min_density`` (or when there is no base).
    """

    name: ClassVar[str] = "deltasync.planes-zstd"
    codec_version: ClassVar[int] = 1

    zstd_level: int = 3
    """zstd level for sparse and dense payloads (1 fastest … 19 smallest)."""
    full_zstd_level: int = 1
    """zstd level for full payloads. On the byte planes of bf16 weights level 1 is about twice
    as fast as level 3 and compresses the exponent plane at least as well."""
    chunk_bytes: int = 4 << 20
    """Nominal chunk size in bytes; rounded down to whole elements per tensor."""
    exhaustive: bool = False
    """Try every candidate on every chunk (slower; used by tests to check the choice)."""
    dense_min_density: float = 0.3
    """Fraction of changed elements above which a dense payload is also tried."""
    full_min_density: float = 0.25
    """Fraction of changed elements above which a full payload is also tried."""

    def __post_init__(self) -> None:
        for name in ("zstd_level", "full_zstd_level"):
            level = getattr(self, name)
            if not 1 <= level <= 22:
                raise UsageError(f"{name} must be in 1..22, got {level}")
        if not 64 <= self.chunk_bytes <= 1 << 30:
            raise UsageError(f"chunk_bytes must be in 64..1 GiB, got {self.chunk_bytes}")
        if self.chunk_bytes % 8:
            raise UsageError(f"chunk_bytes must be a multiple of 8, got {self.chunk_bytes}")

    # -- public API: validation, then the private hooks -------------------------------------

    def chunk_step(self, width: int) -> int:
        """Bytes per chunk for elements of ``width`` bytes (whole elements)."""
        return max(width, self.chunk_bytes - self.chunk_bytes % width)

    def chunk_count(self, nbytes: int, width: int) -> int:
        return -(-nbytes // self.chunk_step(width))

    def chunk_ranges(self, nbytes: int, width: int) -> list[tuple[int, int]]:
        """(offset, length) of each chunk of a tensor of ``nbytes`` bytes."""
        _check_width(width)
        step = self.chunk_step(width)
        return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]

    def encode(self, target: Bytes, base: Bytes | None, width: int) -> EncodedChunk:
        """Encode ``target`` against ``base`` (None: no base, full only)."""
        _check_width(width)
        if target.dtype != np.uint8 or target.ndim != 1:
            raise UsageError("target must be a 1-d uint8 array")
        if len(target) % width:
            raise UsageError(f"chunk of {len(target)} bytes is not whole {width}-byte elements")
        if base is not None and (base.dtype != np.uint8 or base.shape != target.shape):
            base = None  # a base of another size or type cannot be diffed against
        # Element views of a strided byte array are impossible; slices of a tensor are contiguous.
        target = np.ascontiguousarray(target)
        base = None if base is None else np.ascontiguousarray(base)
        return self._encode(target, base, width)

    def decode(self, chunk: EncodedChunk, base: Bytes | None, width: int, nbytes: int) -> Bytes:
        """Decode to exactly ``nbytes`` bytes. Raises CorruptObjectError on malformed payloads."""
        _check_width(width)
        if nbytes % width:
            raise CorruptObjectError("chunk", f"{nbytes} bytes is not whole {width}-byte elements")
        enc = chunk.encoding
        if enc == FULL:
            return self._decode_full(chunk.payload, width, nbytes)
        if base is None or len(base) != nbytes:
            raise CorruptObjectError("chunk", f"{ENCODING_NAMES.get(enc, enc)} chunk needs a base of {nbytes} bytes")
        base = np.ascontiguousarray(base)
        if enc == SAME:
            if chunk.payload:
                raise CorruptObjectError("chunk", "same chunk carries a payload")
            return base
        if enc == DENSE:
            return self._decode_dense(chunk.payload, base, width, nbytes)
        if enc == SPARSE:
            return self._decode_sparse(chunk.payload, base, width, nbytes)
        raise CorruptObjectError("chunk", f"unknown encoding {enc}")

    # -- encoding -----------------------------------------------------------------------------

    def _encode(self, target: Bytes, base: Bytes | None, width: int) -> EncodedChunk:
        n = len(target) // width
        if base is None:
            return EncodedChunk(FULL, self._encode_full(target, width))
        u = _UINT[width]
        t = target.view(u)
        b = base.view(u)
        changed = np.flatnonzero(t != b)
        count = len(changed)
        if count == 0:
            return EncodedChunk(SAME, b"")
        density = count / n
        candidates: list[EncodedChunk] = []
        transform = _XOR
        if density <= 0.9 or self.exhaustive:
            sparse, transform = self._encode_sparse(t, b, changed, width, n)
            candidates.append(EncodedChunk(SPARSE, sparse))
        else:
            transform = self._pick_transform(t[changed[:4096]], b[changed[:4096]], width)
        if density >= self.dense_min_density or self.exhaustive:
            candidates.append(EncodedChunk(DENSE, self._encode_dense(t, b, transform, width)))
        if density >= self.full_min_density or self.exhaustive:
            candidates.append(EncodedChunk(FULL, self._encode_full(target, width)))
        return min(candidates, key=lambda c: len(c.payload))

    def _changes(
        self, t: npt.NDArray[np.unsignedinteger], b: npt.NDArray[np.unsignedinteger], transform: int, width: int
    ) -> npt.NDArray[np.unsignedinteger]:
        if transform == _XOR:
            return t ^ b
        return _zigzag(t - b, width)

    def _pick_transform(
        self, t: npt.NDArray[np.unsignedinteger], b: npt.NDArray[np.unsignedinteger], width: int
    ) -> int:
        cctx = _compressor(self.zstd_level)
        xor = len(cctx.compress(planes(t ^ b, width)))
        zz = len(cctx.compress(planes(_zigzag(t - b, width), width)))
        return _ZIGZAG if zz < xor else _XOR

    def _encode_full(self, target: Bytes, width: int) -> bytes:
        return _compressor(self.full_zstd_level).compress(planes(target, width))

    def _encode_dense(
        self, t: npt.NDArray[np.unsignedinteger], b: npt.NDArray[np.unsignedinteger], transform: int, width: int
    ) -> bytes:
        body = _compressor(self.zstd_level).compress(planes(self._changes(t, b, transform, width), width))
        return _DENSE_HEADER.pack(transform) + body

    def _encode_sparse(
        self,
        t: npt.NDArray[np.unsignedinteger],
        b: npt.NDArray[np.unsignedinteger],
        changed: npt.NDArray[np.intp],
        width: int,
        n: int,
    ) -> tuple[bytes, int]:
        cctx = _compressor(self.zstd_level)
        tc, bc = t[changed], b[changed]
        xor = cctx.compress(planes(tc ^ bc, width))
        zz = cctx.compress(planes(_zigzag(tc - bc, width), width))
        transform, values = (_ZIGZAG, zz) if len(zz) < len(xor) else (_XOR, xor)

        density = len(changed) / n
        position_options: list[tuple[int, int, bytes]] = []
        if density <= 0.25 or self.exhaustive:
            gaps = np.diff(changed, prepend=-1) - 1
            position_options.append((_GAPS, 1, self._encode_gaps(gaps)))
        if density >= 1 / 16 or self.exhaustive:
            mask = np.zeros(n, dtype=np.bool_)
            mask[changed] = True
            bitmap = np.packbits(mask, bitorder="little").tobytes()
            position_options.append((_BITMAP, 0, cctx.compress(bitmap)))
        coding, gap_width_used, positions = min(position_options, key=lambda o: len(o[2]))
        header = _SPARSE_HEADER.pack(transform, coding, gap_width_used, 0, len(changed), len(positions))
        return header + positions + values, transform

    def _encode_gaps(self, gaps: npt.NDArray[np.intp]) -> bytes:
        # Gaps are roughly geometric: one byte each, with 255 escaping to a u32 in a second
        # stream. Huffman over that byte stream gets close to the entropy of the positions,
        # where splitting wider gaps into byte planes would pay a bit per symbol per plane.
        cctx = _compressor(self.zstd_level)
        small = np.minimum(gaps, 255).astype(np.uint8)
        large = (gaps[gaps >= 255] - 255).astype(np.uint32)
        head = cctx.compress(small.tobytes())
        return _U64.pack(len(head)) + head + cctx.compress(planes(large, 4))

    def _decode_gaps(self, data: memoryview, count: int) -> npt.NDArray[np.int64]:
        if len(data) < _U64.size:
            raise CorruptObjectError("sparse chunk", "truncated gap section")
        (head_len,) = _U64.unpack_from(data)
        if head_len > len(data) - _U64.size:
            raise CorruptObjectError("sparse chunk", "gap section runs past the payload")
        head = data[_U64.size : _U64.size + head_len]
        small = np.frombuffer(_unzstd(head, count, "sparse chunk gaps"), dtype=np.uint8)
        escapes = small == 255
        n_large = int(np.count_nonzero(escapes))
        large = unplanes(_unzstd(data[_U64.size + head_len :], 4 * n_large, "sparse chunk gaps"), 4)
        gaps = small.astype(np.int64)
        gaps[escapes] += large.view(np.uint32)
        return gaps

    # -- decoding -----------------------------------------------------------------------------

    def _decode_full(self, payload: bytes, width: int, nbytes: int) -> Bytes:
        return unplanes(_unzstd(payload, nbytes, "full chunk"), width)

    def _decode_dense(self, payload: bytes, base: Bytes, width: int, nbytes: int) -> Bytes:
        if len(payload) < _DENSE_HEADER.size:
            raise CorruptObjectError("dense chunk", "truncated header")
        (transform,) = _DENSE_HEADER.unpack_from(payload)
        changes = unplanes(_unzstd(memoryview(payload)[_DENSE_HEADER.size :], nbytes, "dense chunk"), width)
        u = _UINT[width]
        b = base.view(u)
        c = changes.view(u)
        if transform == _XOR:
            out = b ^ c
        elif transform == _ZIGZAG:
            out = b + _unzigzag(c, width)
        else:
            raise CorruptObjectError("dense chunk", f"unknown transform {transform}")
        return out.view(np.uint8)

    def _decode_sparse(self, payload: bytes, base: Bytes, width: int, nbytes: int) -> Bytes:
        n = nbytes // width
        if len(payload) < _SPARSE_HEADER.size:
            raise CorruptObjectError("sparse chunk", "truncated header")
        transform, coding, gap_width, _, count, pos_len = _SPARSE_HEADER.unpack_from(payload)
        if count == 0 or count > n:
            raise CorruptObjectError("sparse chunk", f"{count} changes in a chunk of {n} elements")
        body = memoryview(payload)[_SPARSE_HEADER.size :]
        if pos_len > len(body):
            raise CorruptObjectError("sparse chunk", "position section runs past the payload")
        pos_raw, val_raw = body[:pos_len], body[pos_len:]
        if coding == _GAPS:
            if gap_width != 1:
                raise CorruptObjectError("sparse chunk", f"bad gap width {gap_width}")
            gaps = self._decode_gaps(pos_raw, count)
            idx = np.cumsum(gaps, dtype=np.int64) + np.arange(count, dtype=np.int64)
        elif coding == _BITMAP:
            bitmap = np.frombuffer(_unzstd(pos_raw, (n + 7) // 8, "sparse chunk positions"), dtype=np.uint8)
            idx = np.flatnonzero(np.unpackbits(bitmap, count=n, bitorder="little"))
        else:
            raise CorruptObjectError("sparse chunk", f"unknown position coding {coding}")
        if len(idx) != count or (count and (idx[-1] >= n or idx[0] < 0)):
            raise CorruptObjectError("sparse chunk", "positions out of range")
        u = _UINT[width]
        values = unplanes(_unzstd(val_raw, count * width, "sparse chunk values"), width).view(u)
        out = base.view(u).copy()
        if transform == _XOR:
            out[idx] ^= values
        elif transform == _ZIGZAG:
            out[idx] += _unzigzag(values, width)
        else:
            raise CorruptObjectError("sparse chunk", f"unknown transform {transform}")
        return out.view(np.uint8)


def _check_width(width: int) -> None:
    if width not in _UINT:
        raise UsageError(f"element width must be 1, 2, 4 or 8, got {width}")


DEFAULT_CODEC = PlanesZstdCodec()


def codec_from_spec(
    name: str, codec_version: int, zstd_level: int, chunk_bytes: int, full_zstd_level: int
) -> PlanesZstdCodec:
    """The codec a manifest was written with; refuses codecs this build cannot decode."""
    if name != PlanesZstdCodec.name or codec_version != PlanesZstdCodec.codec_version:
        raise CorruptObjectError("manifest", f"unknown codec {name!r} version {codec_version}")
    # 0 is protobuf's "unset": manifests written before full_zstd_level existed used zstd_level.
    full_zstd_level = full_zstd_level or zstd_level
    try:
        return PlanesZstdCodec(zstd_level=zstd_level, chunk_bytes=chunk_bytes, full_zstd_level=full_zstd_level)
    except UsageError as e:
        raise CorruptObjectError("manifest", f"bad codec parameters: {e}") from None

"""The chunk codec: per chunk, the smallest of same / sparse / dense / full.

Everything works on bit patterns (unsigned integer views of the raw bytes), never on
float values, which is what makes it lossless: -0.0 vs +0.0 and NaN payloads survive.
The element width (1, 2, 4 or 8 bytes) only decides the byte-plane split.

Payload layouts (``codec_version`` 1; version 2 adds position coding 3 below; version 3 adds
the full layout below and keeps version 2's), all integers little-endian:

* ``SAME``   — empty.
* ``FULL``   — versions 1 and 2: zstd(planes(target)). Version 3: see "Full payloads" below.
* ``DENSE``  — u8 transform (0 or 1), then zstd(planes(change of every element)).
* ``SPARSE`` — u8 transform, u8 position coding, u8 position parameter, u8 value parameter,
  u64 count of changed elements (>= 1), u64 length of the position section; then the
  position section, then the value section (the rest of the payload).

Position codings, with their position parameter; a gap is ``index - previous index - 1``
(the first previous index is -1):

* 0, bitmap [0] — zstd of one bit per element (1 = changed), LSB-first, zero padding bits.
* 1, gap bytes [1] — u64 length of the first frame, zstd(min(gap, 255) as u8 per change),
  zstd(planes(gap - 255 as u32 for every gap >= 255)).
* 2, Rice [k <= 31] — the unary stream of ``gap >> k`` for every change, then the k low bits
  of every gap (exactly ``ceil(count * k / 8)`` bytes).
* 3, magnitude classes [B, 2 <= B <= 8] (codec version 2) — the context is the base, which
  every decoder holds: an element's magnitude is its bits without the sign bit, its bin that
  shifted right by 3, 7, 23 or 52 for widths 1, 2, 4, 8 (the exponent of fp8 e4m3, bf16,
  fp32, fp64), and B - 1 thresholds split the bins into B classes; the encoder picks them per
  chunk so that classes differ most in how often their elements change (small weights change
  more often: their ulp is smaller). The section: B - 1 u16 thresholds (increasing, from 1),
  B u32 counts of the chunk's elements in each class, B class headers (u32 changes, u8 method,
  u8 parameter, u32 stream length), then the streams. A class's changes are coded by their
  ranks among its elements: method 0, Rice [k] as in coding 2 over the ranks; method 1, a
  bitmap [0] as in coding 0 over the class's elements. The value section then holds the
  changes class after class (within a class, in index order). Such a chunk does not decode
  backwards (its classes come from the base); rollbacks rebuild it from the forward chain.

Transforms of the changed elements, with their value parameter:

* 0, XOR [0] — zstd(planes(target ^ base)).
* 1, zigzag [0] — zstd(planes(zigzag(target - base))): the wrapping difference, zigzagged
  (0, -1, +1, -2, ... -> 0, 1, 2, 3, ...) so that -1 ulp is as small as +1 ulp.
* 2, 2-bit zigzag [k < 8 * width] — z = zigzag(target - base) >= 1 as the 2-bit symbol
  ``min(z - 1, 3)``, four to a byte from the low bits (padding symbols 0); every z >= 4 is
  an escape, coded as e = z - 4 in exp-Golomb order k. The section is: u32 length of the
  symbol frame, zstd(symbols), u32 length of the prefix stream, the prefix stream
  (``nb = bit_length((e >> k) + 1) - 1`` in unary for every escape), the suffix stream (for
  every escape the k low bits of e, then the nb low bits of ``(e >> k) + 1``). k is 0 when
  there is no escape. ±1 ulp, the bulk of an RL step, costs two bits before zstd, where
  byte planes cost at least a bit per plane.

Full payloads (codec version 3): u8 method, then one section per byte plane (plane 0 first):
u8 plane coding, u32 length, then that many bytes. Methods: 0, the byte planes of the
elements; 1 (widths 2, 4, 8), the byte planes of the elements rotated left by one bit (the
sign to bit 0: the top plane of bf16, fp32 and fp64 then holds the exponent, or its 8 high
bits, alone, and that plane is where the bytes are saved). The encoder takes the method whose
planes have the lower order-0 entropy (width 1: always 0). Plane codings, each plane holding
n = elements bytes:

* 0, raw — the plane (length n).
* 1, zstd — a zstd frame with content size n.
* 2, rANS (n >= 1) — a 32-byte bitmap of the byte values present (value s: bit s, LSB-first),
  a u16 frequency (>= 1) for each present value in increasing order, summing to 4096, then
  the stream: static rANS, 32-bit states, 16-bit renormalisation words, 32 interleaved states
  (byte i by state i % 32). The stream is the 32 final encoder states (u32, each >= 2^16;
  the decoder's initial ones), then u16 words. To decode byte i from its state x: slot =
  x % 4096, s = the value whose cumulative range holds the slot, x = f[s] * (x >> 12) + slot
  - cum[s]; if then x < 2^16, x = x << 16 | the next word. Decoding ends with every state at
  2^16 and every word read. The encoder codes bytes n - 1 down to 0: if x >= f[s] << 20 it
  emits x & 0xFFFF and shifts x right by 16, then x = ((x // f[s]) << 12) + cum[s] + x % f[s].

The encoder takes rANS only where it saves at least 1/64 of the plane (near-uniform planes,
such as the sign-and-mantissa plane of bf16, decode at memory speed raw), and tries zstd on
a plane when it is small or when zstd beats the order-0 entropy on a sample of it (repeats
that an order-0 coder cannot see); the smallest candidate wins.

Bit streams are LSB-first (bit i is ``byte[i // 8] >> (i % 8) & 1``), a unary code of q is q
zero bits then a one, and every stream is padded with zero bits to whole bytes. Decoding
accepts exactly what encoding writes: every header field, length and padding is checked.

The hot loops live in the C extensions ``deltasync.format._kernels`` and (full payloads)
``deltasync.format._entropy``; ``deltasync.format._kernels_py`` and ``deltasync.format._entropy_py`` are their
pure-numpy twins (byte-identical), used when an extension is not built or when the
environment variable ``DELTASYNC_NO_KERNELS`` is set.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt
import zstandard

from ..errors import CorruptObjectError, UsageError
from ..v1 import manifest_pb2 as pb
from . import _entropy_py, _kernels_py
from ._kernels_py import UINT as _UINT, Data, unzigzag, zigzag

SAME = pb.SAME
SPARSE = pb.SPARSE
DENSE = pb.DENSE
FULL = pb.FULL

ENCODING_NAMES: dict[Encoding, str] = {SAME: "same", SPARSE: "sparse", DENSE: "dense", FULL: "full"}

_XOR, _ZIGZAG, _ZIGZAG2 = 0, 1, 2
_BITMAP, _GAPS, _RICE, _CLASSES = 0, 1, 2, 3
_CLASS_RICE, _CLASS_BITMAP = 0, 1
_CLASS_STREAM = _kernels_py.CLASS_HEAD  # changes in the class, method, Rice k, stream length
_CLASS_OVERHEAD_BITS = 8 * (_CLASS_STREAM.size + 6)
"""What one more class costs in a payload (its stream header, threshold and count), in bits."""
MAX_CLASSES = _kernels_py.MAX_CLASSES
CODEC_VERSIONS = (1, 2, 3)
"""Codec versions this build decodes; it writes 3 unless ``full_coder`` is off (then 2 with
``max_classes`` >= 2, else 1)."""
_MAX_RICE_K = 31
_SPARSE_HEADER = struct.Struct("<BBBBQQ")
_DENSE_HEADER = struct.Struct("<B")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")

_SAMPLE = 1024
"""Changes per trial encoding when the sparse transform is picked from a sample (enough to
tell the transforms apart; the trials cost a few percent of an encode)."""
_SPARSE_MAX_DENSITY = 0.9
_RICE_MAX_DENSITY = 0.5
_BITMAP_MIN_DENSITY = 1 / 8
_MAX_SPARSE_ELEMENTS = 0xFFFFFFFF  # positions are u32
MAX_CHUNK_BYTES = 64 << 20
"""Largest ``chunk_bytes`` a codec accepts, for writing and for reading a manifest."""

Bytes = npt.NDArray[np.uint8]

Encoding: TypeAlias = pb.Encoding


class _Kernels(Protocol):
    """The functions of ``deltasync.format._kernels`` and its twin ``deltasync.format._kernels_py``."""

    def scan(self, target: Data, base: Data, width: int, limit: int, /) -> tuple[
        int, bytes | None, bytes | None, bytes | None
    ]: ...
    def scan_sampled(self, target: Data, base: Data, width: int, limit: int, /) -> tuple[
        int, bytes | None, bytes | None, bytes | None, bytes
    ]: ...
    def rice_encode(self, indices: Data, /) -> tuple[int, bytes]: ...
    def rice_decode(self, data: Data, count: int, k: int, n: int, /) -> bytes: ...
    def pack2(self, target_values: Data, base_values: Data, width: int, /) -> tuple[bytes, int, bytes, bytes]: ...
    def unpack2(self, symbols: Data, count: int, k: int, prefix: Data, suffix: Data, width: int, /) -> bytes: ...
    def scatter(self, out: Bytes, base: Data | None, indices: Data, values: Data, width: int, transform: int, /) -> None: ...
    def apply2(
        self, out: Bytes, base: Data | None, indices: Data, symbols: Data, k: int, prefix: Data, suffix: Data,
        width: int, /,
    ) -> None: ...
    def class_thresholds(self, base: Data, width: int, values: Data, max_classes: int, overhead_bits: int, /) -> bytes: ...
    def class_thresholds_sampled(
        self, sample: Data, width: int, values: Data, max_classes: int, overhead_bits: int, /
    ) -> bytes: ...
    def class_encode(
        self, base: Data, width: int, thresholds: Data, indices: Data, target_values: Data, base_values: Data, /
    ) -> tuple[bytes, bytes, bytes, bytes, tuple[tuple[int, bytes, bytes | None], ...]]: ...
    def class_select(
        self, base: Data, width: int, thresholds: Data, counts: Data, heads: Data, streams: Sequence[Data],
        values: Data, /
    ) -> tuple[bytes, bytes]: ...


def _load_kernels() -> tuple[_Kernels, str]:
    if not os.environ.get("DELTASYNC_NO_KERNELS"):
        try:
            from . import _kernels
        except ImportError:
            pass
        else:
            return _kernels, "c"
    return _kernels_py, "numpy"


_K, KERNELS = _load_kernels()
"""The kernels in use, and which: ``"c"`` (the extension) or ``"numpy"`` (the fallback)."""


class _Entropy(Protocol):
    """The functions of ``deltasync.format._entropy`` and its twin ``deltasync.format._entropy_py``."""

    def split(self, data: Data, width: int, rotate: bool, /) -> tuple[bytes, bytes]: ...
    def join(self, planes: Data, out: Bytes, width: int, rotate: bool, /) -> None: ...
    def counts(self, data: Data, width: int, rotate: bool, /) -> bytes: ...
    def rans_encode(self, plane: Data, freqs: Data, /) -> bytes: ...
    def rans_decode(self, stream: Data, freqs: Data, n: int, /) -> bytes: ...


def _load_entropy() -> tuple[_Entropy, str]:
    if not os.environ.get("DELTASYNC_NO_KERNELS"):
        try:
            from . import _entropy
        except ImportError:
            pass
        else:
            return _entropy, "c"
    return _entropy_py, "numpy"


_E, ENTROPY_KERNELS = _load_entropy()
"""The full-payload coder in use, and which: ``"c"`` or ``"numpy"``."""


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
        # One frame and nothing after it: encoders write exactly that, and a section with
        # trailing bytes is not one they wrote.
        out = _decompressor().decompress(data, max_output_size=expected, allow_extra_data=False)
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


def _unplanes_into(data: bytes, out: Bytes, width: int) -> None:
    raw = np.frombuffer(data, dtype=np.uint8)
    if width == 1:
        np.copyto(out, raw)
    else:
        np.copyto(out.reshape(-1, width), raw.reshape(width, -1).T)


def _take(data: memoryview, at: int, length: int, what: str, chunk: str = "sparse chunk") -> memoryview:
    if length > len(data) - at:
        raise CorruptObjectError(chunk, f"{what} runs past the payload")
    return data[at : at + length]


# -- full payloads of codec version 3 ---------------------------------------------------------

_FULL_PLANES, _FULL_ROTATED = 0, 1
_PLANE_RAW, _PLANE_ZSTD, _PLANE_RANS = 0, 1, 2
_PLANE_HEADER = struct.Struct("<BI")  # plane coding, section length
_RANS_SCALE = 1 << _entropy_py.PROB_BITS
_RANS_STATES = 4 * _entropy_py.LANES  # bytes of the stream's initial states
_RANS_MIN_GAIN = 1 / 64
"""The least fraction of a plane that rANS must save over storing it raw to be chosen: raw
decodes at memory speed, rANS at about a byte per ns."""
_ROTATE_SAMPLE = 1 << 14
"""Elements (at most) whose planes decide whether a chunk's elements are rotated."""
_ZSTD_SAMPLE = 16 << 10
"""Planes up to this size are tried with zstd; larger ones when zstd beats the order-0 entropy
on a sample of this many bytes (four slices across the plane)."""


def _order0_bits(counts: npt.NDArray[np.uint64]) -> float:
    """Bits of symbols with these counts at their empirical entropy."""
    c = counts[counts > 0].astype(np.float64)
    return float((c * np.log2(c.sum() / c)).sum()) if len(c) else 0.0


def _rans_freqs(counts: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
    """Frequencies in 1/4096 for a plane with these byte counts (>= 1 for every present byte):
    the counts scaled down, then the rounding error given to, or taken from, the symbols
    where it costs the fewest bits. Deterministic: C and numpy encoders share it."""
    c = counts.astype(np.float64)
    present = counts > 0
    f = np.where(present, np.maximum(1.0, np.floor(c * _RANS_SCALE / c.sum())), 0.0).astype(np.int64)
    rest = _RANS_SCALE - int(f.sum())
    if rest > 0:  # fewer than the present symbols (each lost under 1 to the floor): +1 each at most
        gain = np.where(present, c * np.log2((f + 1) / np.maximum(f, 1)), -1.0)
        f[np.argsort(-gain, kind="stable")[:rest]] += 1
    while rest < 0:  # symbols raised to 1 overdraw the scale: take from where it costs least
        loss = np.full(256, np.inf)
        more = f > 1
        loss[more] = c[more] * np.log2(f[more] / (f[more] - 1))
        f[int(np.argmin(loss))] -= 1
        rest += 1
    return f


def _rans_bits(counts: npt.NDArray[np.uint64], freqs: npt.NDArray[np.int64]) -> float:
    present = counts > 0
    return float((counts[present] * np.log2(_RANS_SCALE / freqs[present])).sum())


def _encode_plane(plane: memoryview, counts: npt.NDArray[np.uint64], zstd_level: int) -> tuple[int, bytes | memoryview]:
    """(coding, section) of one byte plane: the smallest of raw, zstd and rANS tried."""
    n = len(plane)
    best: tuple[int, bytes | memoryview] = (_PLANE_RAW, plane)
    if n == 0:
        return best
    freqs = _rans_freqs(counts)
    table_len = 32 + 2 * int(np.count_nonzero(freqs))
    estimate = table_len + _RANS_STATES + _rans_bits(counts, freqs) / 8
    if estimate <= n * (1 - _RANS_MIN_GAIN):
        present = freqs > 0
        bitmap = np.packbits(present, bitorder="little").tobytes()
        stream = _E.rans_encode(plane, freqs.astype("<u4").tobytes())
        if table_len + len(stream) <= n * (1 - _RANS_MIN_GAIN):
            best = (_PLANE_RANS, bitmap + freqs[present].astype("<u2").tobytes() + stream)
    cctx = _compressor(zstd_level)
    if n > _ZSTD_SAMPLE:
        step = _ZSTD_SAMPLE // 4
        starts = np.linspace(0, n - step, 4).astype(np.int64).tolist()
        sample = b"".join(plane[at : at + step] for at in starts)
        bits = _order0_bits(np.bincount(np.frombuffer(sample, dtype=np.uint8), minlength=256).astype(np.uint64))
        if 8 * len(cctx.compress(sample)) >= bits:
            return best
    frame = cctx.compress(plane)
    if len(frame) < len(best[1]):
        best = (_PLANE_ZSTD, frame)
    return best


def _encode_full_v3(target: Bytes, width: int, zstd_level: int) -> bytes:
    n = len(target) // width
    rotate = False
    if width > 1:  # rotate if that lowers the planes' entropy on a sample of the elements
        sample = np.ascontiguousarray(target.view(_UINT[width])[:: 1 + n // _ROTATE_SAMPLE]).view(np.uint8)

        def cost(rot: bool) -> float:
            counts = np.frombuffer(_E.counts(sample, width, rot), dtype="<u8").reshape(width, 256)
            return sum(min(8.0 * (len(sample) // width), _order0_bits(c)) for c in counts)

        rotate = cost(True) < cost(False)
    data, counted = _E.split(target, width, rotate)
    counts = np.frombuffer(counted, dtype="<u8").reshape(width, 256)
    planes = memoryview(data)
    parts: list[bytes | memoryview] = [bytes([_FULL_ROTATED if rotate else _FULL_PLANES])]
    for p in range(width):
        coding, section = _encode_plane(planes[p * n : (p + 1) * n], counts[p], zstd_level)
        parts += (_PLANE_HEADER.pack(coding, len(section)), section)
    return b"".join(parts)


def _decode_plane(coding: int, section: memoryview, n: int) -> bytes | memoryview:
    if coding == _PLANE_RAW:
        if len(section) != n:
            raise CorruptObjectError("full chunk", f"raw plane of {len(section)} bytes, expected {n}")
        return section
    if coding == _PLANE_ZSTD:
        return _unzstd(section, n, "full chunk")
    if coding != _PLANE_RANS:
        raise CorruptObjectError("full chunk", f"unknown plane coding {coding}")
    if n == 0:
        raise CorruptObjectError("full chunk", "rANS plane without bytes")
    present = np.unpackbits(np.frombuffer(_take(section, 0, 32, "rANS table", "full chunk"), dtype=np.uint8),
                            bitorder="little").astype(np.bool_)
    k = int(np.count_nonzero(present))
    given = np.frombuffer(_take(section, 32, 2 * k, "rANS table", "full chunk"), dtype="<u2")
    if (given == 0).any() or int(given.sum(dtype=np.int64)) != _RANS_SCALE:
        raise CorruptObjectError("full chunk", f"rANS frequencies must be >= 1 and sum to {_RANS_SCALE}")
    freqs = np.zeros(256, dtype="<u4")
    freqs[present] = given
    try:
        return _E.rans_decode(section[32 + 2 * k :], freqs.tobytes(), n)
    except ValueError as e:
        raise CorruptObjectError("full chunk", str(e)) from None


def _decode_full_v3(payload: bytes, out: Bytes, width: int) -> None:
    """Decode into ``out``, which is written only once the whole payload has decoded."""
    data = memoryview(payload)
    n = len(out) // width
    if not data:
        raise CorruptObjectError("full chunk", "empty payload")
    method = data[0]
    if method not in (_FULL_PLANES, _FULL_ROTATED) or (method == _FULL_ROTATED and width == 1):
        raise CorruptObjectError("full chunk", f"unknown method {method} for width {width}")
    at = 1
    parts: list[bytes | memoryview] = []
    for _ in range(width):
        coding, length = _PLANE_HEADER.unpack(_take(data, at, _PLANE_HEADER.size, "plane header", "full chunk"))
        parts.append(_decode_plane(coding, _take(data, at + _PLANE_HEADER.size, length, "plane", "full chunk"), n))
        at += _PLANE_HEADER.size + length
    if at != len(data):
        raise CorruptObjectError("full chunk", "payload longer than its planes")
    _E.join(parts[0] if width == 1 else b"".join(parts), out, width, method == _FULL_ROTATED)


@dataclass(frozen=True, kw_only=True)
class PlanesZstdCodec:
    """Byte-plane + zstd chunk codec; its fields are recorded in every manifest.

    Candidates that cannot win at a chunk's density are not tried unless ``exhaustive``:
    sparse only up to 90% of elements changed, dense only above ``dense_min_density``, full
    only above ``full_min_density`` (or when there is no base). Within sparse, positions are
    Rice-coded up to 50% changed and a bitmap is tried from 1/8 up; the value transform is
    the best of the three on the first 1024 changes, then applied to all of them.
    """

    name: ClassVar[str] = "deltasync.planes-zstd"

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
    full_coder: bool = True
    """Full payloads in the layout of codec version 3: byte planes (rotated one bit where that
    isolates the exponent) each stored raw, zstd- or rANS-coded, whichever is smallest; about
    4% smaller than zstd over the planes on bf16 weights. Off: zstd(planes), as in versions 1
    and 2."""
    max_classes: int = 6
    """Most magnitude classes a sparse chunk's positions are coded in (codec version 2 and
    later; the context every decoder has: the base). On a real AdamW stream (MiniLM, bf16)
    deltas are 23-27% smaller than context-free ones, for about 1.3x the encode CPU on large
    chunks (2x on small ones). Such chunks do not decode backwards: a rollback past the
    version the other slot of a copy holds rebuilds them from the snapshot chain instead of
    reversing the kept payloads. 0 or 1: context-free chunks only (whose sparse and dense
    chunks decode backwards, for rollbacks without downloads)."""

    @property
    def codec_version(self) -> int:
        """The payload layout version written to manifests: 3 with ``full_coder``, else 2 with
        magnitude classes, else 1."""
        if self.full_coder:
            return 3
        return 2 if self.max_classes > 1 else 1

    def __post_init__(self) -> None:
        for name in ("zstd_level", "full_zstd_level"):
            level = getattr(self, name)
            if not 1 <= level <= 22:
                raise UsageError(f"{name} must be in 1..22, got {level}")
        # Bounded because a reader holds a few chunks per thread in memory: a manifest from
        # a hostile store naming 1 GiB chunks must not make a pull allocate gigabytes.
        if not 64 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise UsageError(f"chunk_bytes must be 64 bytes to {MAX_CHUNK_BYTES >> 20} MiB, got {self.chunk_bytes}")
        if self.chunk_bytes % 8:
            raise UsageError(f"chunk_bytes must be a multiple of 8, got {self.chunk_bytes}")
        if not 0 <= self.max_classes <= MAX_CLASSES:
            raise UsageError(f"max_classes must be in 0..{MAX_CLASSES}, got {self.max_classes}")

    # -- public API: validation, then the private hooks -------------------------------------

    def chunk_step(self, width: int) -> int:
        """Bytes per chunk for elements of ``width`` bytes (whole elements)."""
        return max(width, self.chunk_bytes - self.chunk_bytes % width)

    @staticmethod
    def max_payload(nbytes: int) -> int:
        """The most bytes an encoded chunk of ``nbytes`` raw bytes can take. Encoders write
        at most about ``nbytes`` plus zstd's framing (the smallest candidate wins, and even
        a sparse payload of escapes stays under twice the raw size); a manifest naming a
        longer payload is hostile, and its length is refused before anything is read."""
        return 2 * nbytes + (64 << 10)

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
        """Decode to exactly ``nbytes`` bytes. Raises CorruptObjectError on malformed payloads.

        Returns a new array, or ``base`` itself for a ``same`` chunk; :meth:`decode_into`
        writes into the caller's buffer instead."""
        _check_width(width)
        if nbytes % width:
            raise CorruptObjectError("chunk", f"{nbytes} bytes is not whole {width}-byte elements")
        if chunk.encoding == SAME:
            self._check_base(chunk, base, nbytes)
            assert base is not None
            if chunk.payload:
                raise CorruptObjectError("chunk", "same chunk carries a payload")
            return np.ascontiguousarray(base)
        return self.decode_into(chunk, base, np.empty(nbytes, dtype=np.uint8), width)

    def decode_into(self, chunk: EncodedChunk, base: Bytes | None, out: Bytes, width: int) -> Bytes:
        """Decode into ``out`` (a writable, contiguous 1-d uint8 array of the chunk's size) and
        return it. ``out`` may be ``base`` itself: the change is then applied in place, which
        for a sparse chunk touches only the changed elements. Raises CorruptObjectError on
        malformed payloads, and then leaves ``out`` as it was."""
        _check_width(width)
        if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable:
            raise UsageError("out must be a writable, contiguous 1-d uint8 array")
        nbytes = len(out)
        if nbytes % width:
            raise CorruptObjectError("chunk", f"{nbytes} bytes is not whole {width}-byte elements")
        enc = chunk.encoding
        if enc == FULL:
            if self.full_coder:
                _decode_full_v3(chunk.payload, out, width)
            else:
                _unplanes_into(_unzstd(chunk.payload, nbytes, "full chunk"), out, width)
            return out
        self._check_base(chunk, base, nbytes)
        assert base is not None
        base = np.ascontiguousarray(base)
        in_place = base.ctypes.data == out.ctypes.data
        if not in_place and np.may_share_memory(base, out):
            raise UsageError("out overlaps base without being base")
        if enc == SAME:
            if chunk.payload:
                raise CorruptObjectError("chunk", "same chunk carries a payload")
            if not in_place:
                np.copyto(out, base)
        elif enc == DENSE:
            self._decode_dense(chunk.payload, base, out, width)
        elif enc == SPARSE:
            self._decode_sparse(chunk.payload, width, base, out, in_place)
        else:
            raise CorruptObjectError("chunk", f"unknown encoding {enc}")
        return out

    @staticmethod
    def _check_base(chunk: EncodedChunk, base: Bytes | None, nbytes: int) -> None:
        if base is None or len(base) != nbytes:
            name = ENCODING_NAMES.get(chunk.encoding, chunk.encoding)
            raise CorruptObjectError("chunk", f"{name} chunk needs a base of {nbytes} bytes")

    # -- encoding -----------------------------------------------------------------------------

    def _encode(self, target: Bytes, base: Bytes | None, width: int) -> EncodedChunk:
        n = len(target) // width
        if base is None:
            return EncodedChunk(FULL, self._encode_full(target, width))
        t, b = target.view(_UINT[width]), base.view(_UINT[width])
        sample = None  # the base's elements per magnitude bin (a sample), for class thresholds
        if n <= _MAX_SPARSE_ELEMENTS:
            limit = n if self.exhaustive else int(_SPARSE_MAX_DENSITY * n)
            if self.max_classes > 1:  # counted while the scan reads the base, not in a second pass
                count, indices, tv, bv, sample = _K.scan_sampled(target, base, width, limit)
            else:
                count, indices, tv, bv = _K.scan(target, base, width, limit)
        else:  # positions would not fit in u32: dense or full only
            count, indices, tv, bv = int(np.count_nonzero(t != b)), None, None, None
        if count == 0:
            return EncodedChunk(SAME, b"")
        density = count / n
        candidates: list[EncodedChunk] = []
        if indices is not None and tv is not None and bv is not None:
            sparse, transform = self._encode_sparse(indices, tv, bv, width, n, base, sample)
            candidates.append(EncodedChunk(SPARSE, sparse))
        else:
            head = slice(0, min(n, 1 << 16))  # a sample of the changes, from the chunk's start
            changed = t[head] != b[head]
            transform = self._pick_transform(t[head][changed][:4096], b[head][changed][:4096], width)
        if density >= self.dense_min_density or self.exhaustive:
            # transform: the better of XOR and zigzag byte planes on the changed elements
            for tr in (_XOR, _ZIGZAG) if self.exhaustive else (transform,):
                candidates.append(EncodedChunk(DENSE, self._encode_dense(t, b, tr, width)))
        if density >= self.full_min_density or self.exhaustive:
            candidates.append(EncodedChunk(FULL, self._encode_full(target, width)))
        return min(candidates, key=lambda c: len(c.payload))

    def _changes(
        self, t: npt.NDArray[np.unsignedinteger], b: npt.NDArray[np.unsignedinteger], transform: int, width: int
    ) -> npt.NDArray[np.unsignedinteger]:
        if transform == _XOR:
            return t ^ b
        return zigzag(t - b, width)

    def _pick_transform(
        self, t: npt.NDArray[np.unsignedinteger], b: npt.NDArray[np.unsignedinteger], width: int
    ) -> int:
        cctx = _compressor(self.zstd_level)
        xor = len(cctx.compress(planes(t ^ b, width)))
        zz = len(cctx.compress(planes(zigzag(t - b, width), width)))
        return _ZIGZAG if zz < xor else _XOR

    def _encode_full(self, target: Bytes, width: int) -> bytes:
        if self.full_coder:
            return _encode_full_v3(target, width, self.full_zstd_level)
        return _compressor(self.full_zstd_level).compress(planes(target, width))

    def _encode_dense(
        self, t: npt.NDArray[np.unsignedinteger], b: npt.NDArray[np.unsignedinteger], transform: int, width: int
    ) -> bytes:
        body = _compressor(self.zstd_level).compress(planes(self._changes(t, b, transform, width), width))
        return _DENSE_HEADER.pack(transform) + body

    def _encode_sparse(
        self, indices: bytes, tv: bytes, bv: bytes, width: int, n: int, base: Bytes, sample: bytes | None
    ) -> tuple[bytes, int]:
        """Payload of the changes at ``indices`` (u32) from ``bv`` to ``tv`` (their elements' bytes),
        and the better byte-plane transform (XOR or zigzag) for a dense payload of the chunk.
        ``sample``: what ``scan_sampled`` counted in ``base`` (None: count it here)."""
        count = len(indices) // 4
        density = count / n
        positions: list[tuple[int, int, bytes]] = []  # (coding, parameter, section)
        ordered: tuple[bytes, bytes] | None = None  # the values class after class
        if self.max_classes > 1:
            found = self._encode_classes(indices, tv, bv, width, base, sample)
            if found is not None:
                nclasses, section, ordered_tv, ordered_bv = found
                ordered = ordered_tv, ordered_bv
                positions.append((_CLASSES, nclasses, section))
        # Classes are chosen only where they beat one class, which the Rice code below is.
        if ordered is None or self.exhaustive:
            if density <= _RICE_MAX_DENSITY or self.exhaustive:
                k, rice = _K.rice_encode(indices)
                positions.append((_RICE, k, rice))
            if density >= _BITMAP_MIN_DENSITY or self.exhaustive:
                mask = np.zeros(n, dtype=np.bool_)
                mask[np.frombuffer(indices, dtype=np.uint32)] = True
                bitmap = np.packbits(mask, bitorder="little").tobytes()
                positions.append((_BITMAP, 0, _compressor(self.zstd_level).compress(bitmap)))
        if self.exhaustive:
            idx = np.frombuffer(indices, dtype=np.uint32).astype(np.int64)
            positions.append((_GAPS, 1, self._encode_gaps(np.diff(idx, prepend=-1) - 1)))
        classes = [p for p in positions if p[0] == _CLASSES]
        others = [p for p in positions if p[0] != _CLASSES]
        done: list[tuple[bytes, int]] = []
        if classes and ordered is not None:
            done.append(self._sparse_payload(classes[0], ordered[0], ordered[1], width, count))
        if others:
            done.append(self._sparse_payload(min(others, key=lambda o: len(o[2])), tv, bv, width, count))
        return min(done, key=lambda d: len(d[0]))

    def _sparse_payload(
        self, position: tuple[int, int, bytes], tv: bytes, bv: bytes, width: int, count: int
    ) -> tuple[bytes, int]:
        """A sparse payload from its position section and the changed values in its order, and
        the better byte-plane transform (XOR or zigzag) for a dense payload of the chunk."""
        coding, pos_param, section = position
        if self.exhaustive or count <= _SAMPLE:
            options = [self._encode_values(tv, bv, width, tr) for tr in (_XOR, _ZIGZAG, _ZIGZAG2)]
            sizes = [len(o[0]) for o in options]
            transform = sizes.index(min(sizes))  # ties: the first
            values, value_param = options[transform]
        else:
            cut = _SAMPLE * width
            sizes = [len(self._encode_values(tv[:cut], bv[:cut], width, tr)[0]) for tr in (_XOR, _ZIGZAG, _ZIGZAG2)]
            transform = sizes.index(min(sizes))
            values, value_param = self._encode_values(tv, bv, width, transform)
        planes_transform = _ZIGZAG if sizes[_ZIGZAG] < sizes[_XOR] else _XOR
        header = _SPARSE_HEADER.pack(transform, coding, pos_param, value_param, count, len(section))
        return header + section + values, planes_transform

    def _encode_classes(
        self, indices: bytes, tv: bytes, bv: bytes, width: int, base: Bytes, sample: bytes | None
    ) -> tuple[int, bytes, bytes, bytes] | None:
        """The magnitude-class position section (its class count, the section, and the target
        and base values class after class), or None when one class is best."""
        if sample is None:
            th = _K.class_thresholds(base, width, bv, self.max_classes, _CLASS_OVERHEAD_BITS)
        else:
            th = _K.class_thresholds_sampled(sample, width, bv, self.max_classes, _CLASS_OVERHEAD_BITS)
        if not th:
            return None
        counts, per, ordered_tv, ordered_bv, classes = _K.class_encode(base, width, th, indices, tv, bv)
        heads: list[bytes] = []
        streams: list[bytes] = []
        for k_c, (rice_k, rice, bitmap) in zip(np.frombuffer(per, dtype=np.uint32).tolist(), classes, strict=True):
            method, param, stream = _CLASS_RICE, rice_k, rice
            if bitmap is not None:  # 1/8 or more of the class changed
                packed = _compressor(self.zstd_level).compress(bitmap)
                if len(packed) < 0.97 * len(rice):  # a bitmap decodes in O(class), Rice in O(changes)
                    method, param, stream = _CLASS_BITMAP, 0, packed
            heads.append(_CLASS_STREAM.pack(k_c, method, param, len(stream)))
            streams.append(stream)
        return len(th) // 2 + 1, th + counts + b"".join(heads) + b"".join(streams), ordered_tv, ordered_bv

    def _encode_values(self, tv: bytes, bv: bytes, width: int, transform: int) -> tuple[bytes, int]:
        """The value section for one transform, and its value parameter."""
        cctx = _compressor(self.zstd_level)
        if transform == _ZIGZAG2:
            symbols, k, prefix, suffix = _K.pack2(tv, bv, width)
            frame = cctx.compress(symbols)
            return _U32.pack(len(frame)) + frame + _U32.pack(len(prefix)) + prefix + suffix, k
        u = _UINT[width]
        changes = self._changes(np.frombuffer(tv, dtype=u), np.frombuffer(bv, dtype=u), transform, width)
        return cctx.compress(planes(changes, width)), 0

    def _encode_gaps(self, gaps: npt.NDArray[np.int64]) -> bytes:
        # One byte per gap, with 255 escaping to a u32 in a second stream: Huffman over the
        # byte stream adapts to any gap distribution (Rice codes suit geometric gaps best).
        cctx = _compressor(self.zstd_level)
        small = np.minimum(gaps, 255).astype(np.uint8)
        large = (gaps[gaps >= 255] - 255).astype(np.uint32)
        head = cctx.compress(small.tobytes())
        return _U64.pack(len(head)) + head + cctx.compress(planes(large, 4))

    # -- decoding -----------------------------------------------------------------------------

    def _decode_dense(self, payload: bytes, base: Bytes, out: Bytes, width: int) -> None:
        if len(payload) < _DENSE_HEADER.size:
            raise CorruptObjectError("dense chunk", "truncated header")
        (transform,) = _DENSE_HEADER.unpack_from(payload)
        if transform not in (_XOR, _ZIGZAG):
            raise CorruptObjectError("dense chunk", f"unknown transform {transform}")
        raw = _unzstd(memoryview(payload)[_DENSE_HEADER.size :], len(out), "dense chunk")
        u = _UINT[width]
        c = unplanes(raw, width).view(u)
        if transform == _XOR:
            np.bitwise_xor(base.view(u), c, out=out.view(u))
        else:
            np.add(base.view(u), unzigzag(c), out=out.view(u))

    def _decode_sparse(self, payload: bytes, width: int, base: Bytes, out: Bytes, in_place: bool) -> None:
        """Apply a sparse payload to ``out`` (which holds the base already when ``in_place``),
        once all of it has been checked."""
        n = len(out) // width
        if len(payload) < _SPARSE_HEADER.size:
            raise CorruptObjectError("sparse chunk", "truncated header")
        transform, coding, pos_param, value_param, count, pos_len = _SPARSE_HEADER.unpack_from(payload)
        if not 1 <= count <= n or n > _MAX_SPARSE_ELEMENTS:
            raise CorruptObjectError("sparse chunk", f"{count} changes in a chunk of {n} elements")
        if transform not in (_XOR, _ZIGZAG, _ZIGZAG2):
            raise CorruptObjectError("sparse chunk", f"unknown transform {transform}")
        if value_param != 0 and not (transform == _ZIGZAG2 and value_param < 8 * width):
            raise CorruptObjectError("sparse chunk", f"bad value parameter {value_param}")
        body = memoryview(payload)[_SPARSE_HEADER.size :]
        pos_raw = _take(body, 0, pos_len, "position section")
        val_raw = body[pos_len:]
        try:
            if coding == _CLASSES and self.codec_version < 2:  # what the manifest's version allows
                raise CorruptObjectError("sparse chunk", "magnitude classes in a codec version 1 chunk")
            if coding != _CLASSES:
                indices = self._decode_positions(pos_raw, coding, pos_param, count, n)
            src = None if in_place else base
            if transform == _ZIGZAG2:
                symbols, prefix, suffix = self._zigzag2_streams(val_raw, count)
                if coding != _CLASSES:  # the values go from their streams straight into out
                    _K.apply2(out, src, indices, symbols, value_param, prefix, suffix, width)
                    return
                values: Data = _K.unpack2(symbols, count, value_param, prefix, suffix, width)
                transform = _ZIGZAG
            else:
                values = unplanes(_unzstd(val_raw, count * width, "sparse chunk values"), width)
            if coding == _CLASSES:  # values come class after class: put them in index order
                indices, values = self._decode_classes(pos_raw, pos_param, n, base, width, values)
            _K.scatter(out, src, indices, values, width, transform)
        except ValueError as e:  # the kernels refuse malformed streams
            raise CorruptObjectError("sparse chunk", str(e)) from None

    def _decode_classes(
        self, data: memoryview, nclasses: int, n: int, base: Bytes, width: int, values: Data
    ) -> tuple[bytes, bytes]:
        """Increasing indices of a magnitude-class position section, and ``values`` (class after
        class) in their order. The kernel checks the rest: the streams, counts and classes."""
        if not 2 <= nclasses <= MAX_CLASSES:
            raise CorruptObjectError("sparse chunk", f"bad class count {nclasses}")
        th = _take(data, 0, 2 * (nclasses - 1), "class thresholds")
        counts = _take(data, len(th), 4 * nclasses, "class counts")
        at = len(th) + len(counts)
        heads = _take(data, at, nclasses * _CLASS_STREAM.size, "class headers")
        at += len(heads)
        class_n = np.frombuffer(counts, dtype=np.uint32).tolist()
        if sum(class_n) != n:  # before any bitmap below is inflated to its class's size
            raise CorruptObjectError("sparse chunk", "class counts do not add up to the chunk")
        streams: list[Data] = []
        for (k_c, method, _, length), n_c in zip(_CLASS_STREAM.iter_unpack(heads), class_n, strict=True):
            stream = _take(data, at, length, "class stream")
            at += length
            if method == _CLASS_BITMAP and 0 < k_c <= n_c:
                streams.append(_unzstd(stream, (n_c + 7) // 8, "class bitmap"))
            else:
                streams.append(stream)
        if at != len(data):
            raise CorruptObjectError("sparse chunk", "position section longer than its classes")
        return _K.class_select(base, width, th, counts, heads, streams, values)

    def _decode_positions(self, data: memoryview, coding: int, param: int, count: int, n: int) -> bytes:
        if coding == _RICE:
            if param > _MAX_RICE_K:
                raise CorruptObjectError("sparse chunk", f"bad Rice parameter {param}")
            return _K.rice_decode(data, count, param, n)
        if coding == _BITMAP:
            if param != 0:
                raise CorruptObjectError("sparse chunk", f"bad bitmap parameter {param}")
            bitmap = np.frombuffer(_unzstd(data, (n + 7) // 8, "sparse chunk positions"), dtype=np.uint8)
            bits = np.unpackbits(bitmap, bitorder="little")
            if bits[n:].any():
                raise CorruptObjectError("sparse chunk", "bitmap padding is not zero")
            idx = np.flatnonzero(bits)
        elif coding == _GAPS:
            if param != 1:
                raise CorruptObjectError("sparse chunk", f"bad gap width {param}")
            idx = np.cumsum(self._decode_gaps(data, count), dtype=np.int64) + np.arange(count, dtype=np.int64)
        else:
            raise CorruptObjectError("sparse chunk", f"unknown position coding {coding}")
        if len(idx) != count or idx[-1] >= n:
            raise CorruptObjectError("sparse chunk", "positions out of range")
        return idx.astype(np.uint32).tobytes()

    def _decode_gaps(self, data: memoryview, count: int) -> npt.NDArray[np.int64]:
        if len(data) < _U64.size:
            raise CorruptObjectError("sparse chunk", "truncated gap section")
        (head_len,) = _U64.unpack_from(data)
        head = _take(data, _U64.size, head_len, "gap section")
        small = np.frombuffer(_unzstd(head, count, "sparse chunk gaps"), dtype=np.uint8)
        escapes = small == 255
        n_large = int(np.count_nonzero(escapes))
        large = unplanes(_unzstd(data[_U64.size + head_len :], 4 * n_large, "sparse chunk gaps"), 4)
        gaps = small.astype(np.int64)
        gaps[escapes] += large.view(np.uint32)
        return gaps

    def _zigzag2_streams(self, data: memoryview, count: int) -> tuple[bytes, memoryview, memoryview]:
        """The symbols (decompressed), escape prefixes and escape suffixes of a 2-bit value section."""
        sym_len = _U32.unpack(_take(data, 0, _U32.size, "symbol length"))[0]
        symbols = _unzstd(_take(data, _U32.size, sym_len, "symbol frame"), (count + 3) // 4, "sparse chunk values")
        at = _U32.size + sym_len
        prefix_len = _U32.unpack(_take(data, at, _U32.size, "escape length"))[0]
        prefix = _take(data, at + _U32.size, prefix_len, "escape prefix")
        return symbols, prefix, data[at + _U32.size + prefix_len :]


def _check_width(width: int) -> None:
    if width not in _UINT:
        raise UsageError(f"element width must be 1, 2, 4 or 8, got {width}")


DEFAULT_CODEC = PlanesZstdCodec()


def codec_from_spec(
    name: str, codec_version: int, zstd_level: int, chunk_bytes: int, full_zstd_level: int
) -> PlanesZstdCodec:
    """The codec a manifest was written with; refuses codecs this build cannot decode."""
    if name != PlanesZstdCodec.name or codec_version not in CODEC_VERSIONS:
        raise CorruptObjectError("manifest", f"unknown codec {name!r} version {codec_version}")
    # 0 is protobuf's "unset": manifests written before full_zstd_level existed used zstd_level.
    full_zstd_level = full_zstd_level or zstd_level
    try:
        return PlanesZstdCodec(zstd_level=zstd_level, chunk_bytes=chunk_bytes, full_zstd_level=full_zstd_level,
                               max_classes=MAX_CLASSES if codec_version >= 2 else 0, full_coder=codec_version >= 3)
    except UsageError as e:
        raise CorruptObjectError("manifest", f"bad codec parameters: {e}") from None


def decode_reverse(codec: PlanesZstdCodec, chunk: EncodedChunk, target: Bytes, width: int) -> Bytes:
    """The base a delta chunk was encoded against, from its target: ``decode`` run backwards
    (a rollback without downloads). ``same``, ``sparse`` and ``dense`` chunks reverse (an XOR
    is its own inverse, a wrapping difference is subtracted); ``full`` ones cannot (UsageError).
    The caller checks the result against the chunk's base digest, as every decode is checked."""
    if chunk.encoding == FULL:
        raise UsageError("a full chunk does not determine its base")
    if chunk.encoding == SAME:
        return codec.decode(chunk, target, width, len(target)).copy()
    if not chunk.payload:
        raise CorruptObjectError("chunk", "delta chunk without a payload")
    if chunk.encoding == SPARSE and len(chunk.payload) > 1 and chunk.payload[1] == _CLASSES:
        raise UsageError("a chunk coded in magnitude classes of its base does not determine that base")
    # Decoded against a base of zeros, a payload yields its change alone (0 ^ c, 0 + d).
    change = codec.decode(chunk, np.zeros(len(target), dtype=np.uint8), width, len(target))
    u = _UINT[width]
    t, c = np.ascontiguousarray(target).view(u), change.view(u)
    base = t ^ c if chunk.payload[0] == _XOR else t - c  # the transform is the first payload byte
    return base.view(np.uint8)


def changed_within(target: Bytes, base: Bytes, width: int, limit: int) -> tuple[npt.NDArray[np.int64], Bytes] | None:
    """Where two equal-length 1-d uint8 arrays of ``width``-byte elements differ by bit pattern
    (ascending element positions, and those elements' bytes in ``target``), or None when more
    than ``limit`` elements differ: one pass of the encoder's scan kernel (C, the GIL released),
    so that threads diffing chunks at once run at once (numpy's ``flatnonzero`` holds the GIL)."""
    _check_width(width)
    if len(target) != len(base) or len(target) % width:
        raise UsageError("target and base must be equal lengths of whole elements")
    n = len(target) // width
    if n > _MAX_SPARSE_ELEMENTS:
        raise UsageError(f"{n} elements is more than one scan takes ({_MAX_SPARSE_ELEMENTS}); scan it in parts")
    count, idx, tv, _bv = _K.scan(np.ascontiguousarray(target), np.ascontiguousarray(base), width, max(0, limit))
    if count > limit or idx is None or tv is None:
        return None
    return np.frombuffer(idx, dtype=np.uint32).astype(np.int64), np.frombuffer(tv, dtype=np.uint8)


def changed_elements(target: Bytes, base: Bytes, width: int) -> tuple[npt.NDArray[np.int64], Bytes, Bytes]:
    """Where two equal-length byte arrays of ``width``-byte elements differ by bit pattern, as the
    encoder finds a chunk's changes (the same scan kernel; C, the GIL released): the ascending
    element positions, and those elements' bytes in ``target`` and in ``base`` (``width`` bytes
    each, in position order). Neither array is copied."""
    _check_width(width)
    if target.dtype != np.uint8 or base.dtype != np.uint8 or target.shape != base.shape or target.ndim != 1:
        raise UsageError("target and base must be 1-d uint8 arrays of the same length")
    if len(target) % width:
        raise UsageError(f"{len(target)} bytes is not whole {width}-byte elements")
    n = len(target) // width
    if n > _MAX_SPARSE_ELEMENTS:
        raise UsageError(f"{n} elements is more than one scan takes ({_MAX_SPARSE_ELEMENTS}); scan it in parts")
    _count, idx, tv, bv = _K.scan(np.ascontiguousarray(target), np.ascontiguousarray(base), width, n)
    assert idx is not None and tv is not None and bv is not None  # the limit is every element
    return (np.frombuffer(idx, dtype=np.uint32).astype(np.int64), np.frombuffer(tv, dtype=np.uint8),
            np.frombuffer(bv, dtype=np.uint8))

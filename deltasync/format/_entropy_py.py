"""Pure-numpy twin of the C extension ``deltasync.format._entropy`` (``_entropy.c``): the same functions,
byte-identical results, the same inputs refused (ValueError). The codec uses it when the
extension is not built or ``DELTASYNC_NO_KERNELS`` is set. The rANS loops step all LANES
interleaved states at once, so a 4 MiB chunk takes about a second per plane here.

See ``_entropy.c`` for the coder: static rANS, 32-bit states, 16-bit words, frequencies in
1/2^PROB_BITS, LANES states interleaved (symbol i by state i % LANES); a stream is the final
encoder states (u32) then the words in the order the decoder reads them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ._kernels_py import UINT, Data

LANES = 32
PROB_BITS = 12
_SCALE = 1 << PROB_BITS
_L = 1 << 16
_HEAD = 4 * LANES


def _check_width(width: int) -> None:
    if width not in UINT:
        raise ValueError(f"element width must be 1, 2, 4 or 8, got {width}")


def _bytes(data: Data) -> npt.NDArray[np.uint8]:
    return np.frombuffer(data, dtype=np.uint8)


def _rotl1(v: npt.NDArray[np.unsignedinteger], width: int) -> npt.NDArray[np.unsignedinteger]:
    u = UINT[width]
    return np.bitwise_or(v << u(1), v >> u(8 * width - 1), dtype=u)


def _rotr1(v: npt.NDArray[np.unsignedinteger], width: int) -> npt.NDArray[np.unsignedinteger]:
    u = UINT[width]
    return np.bitwise_or(v >> u(1), v << u(8 * width - 1), dtype=u)


def _planes(data: Data, width: int, rotate: bool) -> npt.NDArray[np.uint8]:
    _check_width(width)
    raw = _bytes(data)
    if len(raw) % width or len(raw) // width > 0xFFFFFFFF:
        raise ValueError("split: data is not whole elements, or too many")
    if width == 1 and not rotate:
        return raw.reshape(1, -1)
    v = raw.view(UINT[width])
    if rotate:
        v = _rotl1(v, width)
    return np.ascontiguousarray(v.view(np.uint8).reshape(-1, width).T)


def _counts(planes: npt.NDArray[np.uint8]) -> bytes:
    return np.stack([np.bincount(p, minlength=256) for p in planes]).astype("<u8").tobytes()


def split(data: Data, width: int, rotate: bool, /) -> tuple[bytes, bytes]:
    """Byte planes of the elements (each rotated left by one bit if ``rotate``), and how often
    each byte value occurs in each plane: ``width * 256`` u64 counts, plane after plane."""
    planes = _planes(data, width, rotate)
    return planes.tobytes(), _counts(planes)


def counts(data: Data, width: int, rotate: bool, /) -> bytes:
    """The counts of ``split(data, width, rotate)``, without the planes."""
    return _counts(_planes(data, width, rotate))


def join(planes: Data, out: npt.NDArray[np.uint8], width: int, rotate: bool, /) -> None:
    """The inverse of :func:`split`, written into ``out`` (writable, of the same size)."""
    _check_width(width)
    raw = _bytes(planes)
    if len(raw) != len(out) or len(raw) % width:
        raise ValueError("join: buffers of mismatched sizes")
    if width == 1 and not rotate:
        np.copyto(out, raw)
        return
    v = np.ascontiguousarray(raw.reshape(width, -1).T).view(UINT[width]).reshape(-1)
    if rotate:
        v = _rotr1(v, width)
    np.copyto(out, v.view(np.uint8))


def _freqs(freqs: Data) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    f = np.frombuffer(freqs, dtype="<u4") if len(freqs) == 1024 else None
    if f is None or int(f.astype(np.uint64).sum()) != _SCALE:
        raise ValueError("frequencies must be 256 u32 summing to 2**12")
    f64 = f.astype(np.uint64)
    return f64, np.concatenate(([0], np.cumsum(f64)[:-1])).astype(np.uint64)


def rans_encode(plane: Data, freqs: Data, /) -> bytes:
    """The rANS stream of ``plane``'s bytes under ``freqs`` (256 u32 summing to 2**12; every byte
    of the plane must have a frequency)."""
    freq, cum = _freqs(freqs)
    sym = _bytes(plane)
    n = len(sym)
    if n and not freq[sym].all():
        raise ValueError("rans_encode: a byte of the plane has no frequency")
    bound = freq << np.uint64(32 - PROB_BITS)
    x = np.full(LANES, _L, dtype=np.uint64)
    steps = -(-n // LANES)
    words: list[npt.NDArray[np.uint16]] = [np.empty(0, np.uint16)] * steps
    for t in range(steps - 1, -1, -1):
        s = sym[t * LANES : (t + 1) * LANES]
        m = len(s)
        v = x[:m]
        emit = v >= bound[s]
        # Within a round the decoder reads lane 0's word first: keep lane order.
        words[t] = (v[emit] & np.uint64(0xFFFF)).astype(np.uint16)
        v = np.where(emit, v >> np.uint64(16), v)
        f = freq[s]
        x[:m] = ((v // f) << np.uint64(PROB_BITS)) + v % f + cum[s]
    body = np.concatenate(words).astype("<u2") if steps else np.empty(0, "<u2")
    return x.astype("<u4").tobytes() + body.tobytes()


def rans_decode(stream: Data, freqs: Data, n: int, /) -> bytes:
    """The ``n`` bytes a :func:`rans_encode` stream under the same ``freqs`` holds. Raises
    ValueError on a stream that is not exactly what rans_encode writes."""
    if n < 0:
        raise ValueError(f"bad symbol count {n}")
    freq, cum = _freqs(freqs)
    raw = _bytes(stream)
    if len(raw) < _HEAD or (len(raw) - _HEAD) % 2:
        raise ValueError("rANS stream of a bad length")
    x = raw[:_HEAD].view("<u4").astype(np.uint64)
    if (x < _L).any():
        raise ValueError("rANS state out of range")
    words = raw[_HEAD:].view("<u2").astype(np.uint64)
    slot_sym = np.repeat(np.arange(256, dtype=np.uint8), freq.astype(np.int64))
    out = np.empty(n, dtype=np.uint8)
    mask, pb, at = np.uint64(_SCALE - 1), np.uint64(PROB_BITS), 0
    for t in range(-(-n // LANES)):
        lo = t * LANES
        m = min(LANES, n - lo)
        v = x[:m]
        slot = v & mask
        s = slot_sym[slot]
        out[lo : lo + m] = s
        v = freq[s] * (v >> pb) + slot - cum[s]
        need = v < _L
        k = int(np.count_nonzero(need))
        if at + k > len(words):
            raise ValueError("rANS stream ends early")
        v[need] = (v[need] << np.uint64(16)) | words[at : at + k]
        at += k
        x[:m] = v
    if at != len(words):
        raise ValueError("rANS stream longer than its symbols")
    if (x != _L).any():
        raise ValueError("rANS stream does not end in its initial states")
    return out.tobytes()

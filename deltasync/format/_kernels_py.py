"""Pure-numpy twin of the ``deltasync.format._kernels`` extension module.

Same functions, arguments and byte-identical results; malformed input raises ValueError in
both. The codec uses the C module when it imports (built by ``pip install``) and this one
otherwise; tests run both and compare. The formats are documented in ``deltasync/format/codec.py``
and the C source: bit streams are LSB-first, a unary code of q is q zero bits then a one,
every stream is padded with zero bits to whole bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

MAX_RICE_K = 31

UINT: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
INT: dict[int, type[np.signedinteger]] = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
Bits = npt.NDArray[np.uint8]
Data = bytes | memoryview | npt.NDArray[np.uint8]
"""What the kernels take as a byte buffer (the C module: anything C-contiguous)."""


def zigzag(diff: npt.NDArray[np.unsignedinteger], width: int) -> npt.NDArray[np.unsignedinteger]:
    """Wrapping difference to unsigned, small magnitudes first: 0, -1, +1, -2, ... -> 0, 1, 2, 3, ..."""
    s = diff.view(INT[width])
    shift = 8 * width - 1
    return ((s << 1) ^ (s >> shift)).view(UINT[width])


def unzigzag(zz: npt.NDArray[np.unsignedinteger]) -> npt.NDArray[np.unsignedinteger]:
    u = zz.dtype.type
    out: npt.NDArray[np.unsignedinteger] = (zz >> u(1)) ^ (u(0) - (zz & u(1)))
    return out


def _elems(data: Data, width: int) -> npt.NDArray[np.unsignedinteger]:
    return np.frombuffer(data, dtype=np.uint8).view(UINT[width])


def _bitlen(x: U64) -> I64:
    """Exact bit length of every element (no float rounding)."""
    n = np.zeros(len(x), dtype=np.int64)
    y = x.copy()
    for s in (32, 16, 8, 4, 2, 1):
        big = y >= np.uint64(1 << s)
        n[big] += s
        y[big] >>= np.uint64(s)
    n += (y > 0).astype(np.int64)
    return n


def _pack(bits: Bits) -> bytes:
    return np.packbits(bits, bitorder="little").tobytes()


def _unpack(data: Data) -> Bits:
    return np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")


_POPCOUNT = np.array([bin(b).count("1") for b in range(256)], dtype=np.uint8)


def _ones(data: Data) -> int:
    """The one bits in ``data``, counted without expanding it to bits."""
    return int(_POPCOUNT[np.frombuffer(data, dtype=np.uint8)].sum(dtype=np.int64))


def _unary(q: I64) -> bytes:
    """q[i] zero bits then a one, for every i."""
    total = int(q.sum()) + len(q)
    bits = np.zeros(total, dtype=np.uint8)
    bits[np.cumsum(q + 1) - 1] = 1
    return _pack(bits)


def _put_fields(values: U64, widths: I64) -> bytes:
    """The low ``widths[i]`` bits of ``values[i]``, back to back."""
    total = int(widths.sum())
    bits = np.zeros(total, dtype=np.uint8)
    starts = np.cumsum(widths) - widths
    for j in range(int(widths.max(initial=0))):
        sel = widths > j
        bits[starts[sel] + j] = ((values[sel] >> np.uint64(j)) & np.uint64(1)).astype(np.uint8)
    return _pack(bits)


def _get_fields(bits: Bits, starts: I64, widths: I64) -> U64:
    out = np.zeros(len(starts), dtype=np.uint64)
    for j in range(int(widths.max(initial=0))):
        sel = widths > j
        out[sel] |= bits[starts[sel] + j].astype(np.uint64) << np.uint64(j)
    return out


def _exact_padding(data: Data, nbits: int) -> bool:
    if len(data) != (nbits + 7) // 8:
        return False
    return not (nbits % 8 and data[-1] >> (nbits % 8))


# -- the kernels ----------------------------------------------------------------------------


def scan(target: Data, base: Data, width: int, limit: int, /) -> tuple[
    int, bytes | None, bytes | None, bytes | None
]:
    if len(target) != len(base) or len(target) % width:
        raise ValueError("target and base must be equal lengths of whole elements")
    if len(target) // width > 0xFFFFFFFF:
        raise ValueError("too many elements for u32 indices")
    t, b = _elems(target, width), _elems(base, width)
    idx = np.flatnonzero(t != b)
    if len(idx) > limit:
        return len(idx), None, None, None
    return len(idx), idx.astype(np.uint32).tobytes(), t[idx].tobytes(), b[idx].tobytes()


def scan_sampled(target: Data, base: Data, width: int, limit: int, /) -> tuple[
    int, bytes | None, bytes | None, bytes | None, bytes
]:
    count, idx, tv, bv = scan(target, base, width, limit)
    return count, idx, tv, bv, _sample(base, width).astype("<u4").tobytes()


def _rice_halves(gaps: I64, k: int) -> int:
    return int((((gaps >> k) + 1) >> 1).sum())


def rice_encode(indices: Data, /) -> tuple[int, bytes]:
    if len(indices) % 4:
        raise ValueError("indices must be u32")
    idx = np.frombuffer(indices, dtype=np.uint32).astype(np.int64)
    gaps = np.diff(idx, prepend=-1) - 1
    if len(gaps) and gaps[1:].min(initial=0) < 0:
        raise ValueError("indices must be strictly increasing")
    m = len(gaps)
    if m == 0:
        return 0, b""
    # cost(k) = m * (1 + k) + sum(g >> k) is convex; the smallest minimizer is the first k
    # where going to k + 1 saves nothing.
    k = next((k for k in range(MAX_RICE_K) if _rice_halves(gaps, k) <= m), MAX_RICE_K)
    unary = _unary(gaps >> k)
    low = _put_fields((gaps & ((1 << k) - 1)).astype(np.uint64), np.full(m, k, dtype=np.int64))
    return k, unary + low


def rice_decode(data: Data, count: int, k: int, n: int, /) -> bytes:
    if not 0 <= k <= MAX_RICE_K:
        raise ValueError(f"bad Rice parameter {k}")
    if count < 1 or n < 1 or count > n or n > 0xFFFFFFFF:
        raise ValueError(f"bad count {count} for {n} elements")
    low_len = (count * k + 7) // 8
    if len(data) < low_len + 1:
        raise ValueError("Rice stream too short")
    unary, low = data[: len(data) - low_len], data[len(data) - low_len :]
    # Refused by the C decoder too (after a pass over the stream), but checked before the
    # stream is expanded to bits and one-bit positions (64 bytes per stream byte: hundreds of
    # MiB from a hostile stream for a 4 MiB chunk): an accepted unary stream holds exactly
    # ``count`` one bits and at most n bits (the unary parts sum to at most last + 1 - count).
    ones_in = _ones(unary)
    if ones_in < count:
        raise ValueError("Rice stream ends early")
    if ones_in > count or len(unary) > (n + 7) // 8:
        raise ValueError("Rice stream has trailing data")
    # Codes must be read one by one, like the C loop, to refuse the same inputs: stop at the
    # first code whose gap runs past the chunk (the unary stream may hold more ones after it).
    ones = np.flatnonzero(_unpack(unary))[:count]
    q = np.diff(ones, prepend=-1) - 1
    bad_q = np.flatnonzero(q > (n >> k))
    lows = _get_fields(_unpack(low), np.arange(count, dtype=np.int64) * k, np.full(count, k, np.int64))
    usable = min(len(q), int(bad_q[0]) if len(bad_q) else len(q))
    pos = np.cumsum((q[:usable] << k) + lows[:usable].astype(np.int64) + 1) - 1
    past = np.flatnonzero(pos >= n)
    if len(past) or usable < len(q):
        raise ValueError("position past the end of the chunk")
    if len(q) < count:
        raise ValueError("Rice stream ends early")
    if not _exact_padding(unary, int(ones[-1]) + 1):
        raise ValueError("Rice stream has trailing data")
    if not _exact_padding(low, count * k):
        raise ValueError("Rice low bits have trailing data")
    return pos.astype(np.uint32).tobytes()


def _expg_cost(e: U64, k: int) -> int:
    return len(e) * (1 + k) + 2 * int((_bitlen((e >> np.uint64(k)) + np.uint64(1)) - 1).sum())


def pack2(target_values: Data, base_values: Data, width: int, /) -> tuple[bytes, int, bytes, bytes]:
    if len(target_values) != len(base_values) or len(target_values) % width:
        raise ValueError("target and base values must be equal lengths of whole elements")
    t, b = _elems(target_values, width), _elems(base_values, width)
    z = zigzag(t - b, width).astype(np.uint64)
    if (z == 0).any():
        raise ValueError("an unchanged element has no symbol")
    sym = np.minimum(z - np.uint64(1), np.uint64(3)).astype(np.uint8)
    sym = np.concatenate([sym, np.zeros(-len(sym) % 4, np.uint8)]).reshape(-1, 4)
    symbols = (sym[:, 0] | sym[:, 1] << 2 | sym[:, 2] << 4 | sym[:, 3] << 6).astype(np.uint8).tobytes()
    e = z[z >= 4] - np.uint64(4)
    if len(e) == 0:
        return symbols, 0, b"", b""
    kmax = min(int(_bitlen(e.max(keepdims=True))[0]), 8 * width - 1)
    costs = [_expg_cost(e, k) for k in range(kmax + 1)]
    k = costs.index(min(costs))
    x = (e >> np.uint64(k)) + np.uint64(1)
    nb = _bitlen(x) - 1
    prefix = _unary(nb)
    low = e & np.uint64((1 << k) - 1)
    high = x - (np.uint64(1) << nb.astype(np.uint64))
    fields = np.empty(2 * len(e), dtype=np.uint64)
    fields[0::2], fields[1::2] = low, high
    widths = np.empty(2 * len(e), dtype=np.int64)
    widths[0::2], widths[1::2] = k, nb
    return symbols, k, prefix, _put_fields(fields, widths)


def unpack2(symbols: Data, count: int, k: int, prefix: Data, suffix: Data, width: int, /) -> bytes:
    if width not in UINT:
        raise ValueError(f"element width must be 1, 2, 4 or 8, got {width}")
    if count < 1:
        raise ValueError(f"bad count {count}")
    if not 0 <= k < 8 * width:
        raise ValueError(f"bad escape parameter {k}")
    if len(symbols) != (count + 3) // 4:
        raise ValueError("symbol stream of the wrong size")
    raw = np.frombuffer(symbols, dtype=np.uint8)
    sym = ((raw[:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(-1)
    z = sym[:count].astype(np.uint64) + np.uint64(1)
    where = np.flatnonzero(sym[:count] == 3)
    m = len(where)
    if m:
        # Like the C loop, escapes are read in order and the first bad one is reported; the
        # checks below look at the escapes before the first failure only where it matters.
        # As in rice_decode, refused by C too but checked before the streams are expanded to
        # bits: an accepted prefix stream holds exactly m one bits, each after at most 63 zeros.
        ones_in = _ones(prefix)
        if ones_in < m:
            raise ValueError("escape stream ends early")
        if ones_in > m or len(prefix) > 8 * m:
            raise ValueError("escape stream has trailing data")
        ones = np.flatnonzero(_unpack(prefix))
        nb = (np.diff(ones[:m], prepend=-1) - 1).astype(np.int64)
        if (nb > 63).any():
            raise ValueError("escape runs past its stream")
        starts = np.cumsum(nb + k) - (nb + k)
        if int(starts[-1] + k + nb[-1]) > 8 * len(suffix):
            raise ValueError("escape runs past its stream")
        if len(suffix) > (int(starts[-1] + k + nb[-1]) + 7) // 8:
            raise ValueError("escape stream has trailing data")
        bits = _unpack(suffix)
        low = _get_fields(bits, starts, np.full(m, k, np.int64))
        high = (np.uint64(1) << nb.astype(np.uint64)) - np.uint64(1) + _get_fields(bits, starts + k, nb)
        emax = (1 << (8 * width)) - 5
        hmax, lmax = np.uint64(emax >> k), np.uint64(emax & ((1 << k) - 1))
        if ((high > hmax) | ((high == hmax) & (low > lmax))).any():
            raise ValueError("escaped change wider than the element")
        z[where] = ((high << np.uint64(k)) | low) + np.uint64(4)
        pbits, sbits = int(ones[m - 1]) + 1, int(starts[-1] + k + nb[-1])
    else:
        pbits = sbits = 0
    if (sym[count:] != 0).any():
        raise ValueError("symbol stream has trailing data")
    if not m and k:
        raise ValueError("escape parameter without escapes")
    if not _exact_padding(prefix, pbits) or not _exact_padding(suffix, sbits):
        raise ValueError("escape stream has trailing data")
    return z.astype(UINT[width]).tobytes()


def scatter(
    out: npt.NDArray[np.uint8], base: Data | None, indices: Data, values: Data, width: int, transform: int, /
) -> None:
    if transform not in (0, 1):
        raise ValueError(f"bad transform {transform}")
    idx = np.frombuffer(indices, dtype=np.uint32)
    v = _elems(values, width)
    if len(out) % width or len(v) != len(idx) or (base is not None and len(base) != len(out)):
        raise ValueError("scatter: buffers of mismatched sizes")
    o = out.view(UINT[width])
    if len(idx) and (int(idx[-1]) >= len(o) or (np.diff(idx.astype(np.int64)) <= 0).any()):
        raise ValueError("scatter: indices must be increasing and in range")
    if base is not None:
        np.copyto(out, np.frombuffer(base, dtype=np.uint8))
    if transform == 0:
        o[idx] ^= v
    else:
        o[idx] += unzigzag(v)


def apply2(
    out: npt.NDArray[np.uint8], base: Data | None, indices: Data, symbols: Data, k: int, prefix: Data,
    suffix: Data, width: int, /,
) -> None:
    """``scatter`` of ``unpack2``'s values with the add transform (the C kernel does it in one
    pass); ``out`` is written only once everything has been checked."""
    values = unpack2(symbols, len(indices) // 4, k, prefix, suffix, width)
    scatter(out, base, indices, values, width, 1)


MAX_CLASSES = 8
BIN_SHIFT: dict[int, int] = {1: 3, 2: 7, 4: 23, 8: 52}
"""Magnitude bins: an element's bits without the sign bit, shifted right by this (for bf16 and
fp32 the exponent, for fp8 e4m3 too); class thresholds are bins."""


def _classes(base: Data, width: int, thresholds: Data) -> tuple[npt.NDArray[np.intp], int]:
    """The magnitude class of every element of ``base``, and the number of classes."""
    th = np.frombuffer(thresholds, dtype=np.uint16).astype(np.uint64)
    if len(thresholds) % 2 or len(th) > MAX_CLASSES - 1:
        raise ValueError("bad class thresholds")
    max_bin = (int(np.iinfo(UINT[width]).max) >> 1) >> BIN_SHIFT[width]
    if len(th) and (th[0] < 1 or (len(th) > 1 and (np.diff(th.astype(np.int64)) <= 0).any()) or th[-1] > max_bin):
        raise ValueError("class thresholds must increase from 1 to the largest bin")
    u = UINT[width]
    mag = _elems(base, width) & u(int(np.iinfo(u).max) >> 1)
    lim = (th << np.uint64(BIN_SHIFT[width])).astype(u)
    return np.searchsorted(lim, mag, side="right"), len(th) + 1


MAX_RUNS = 64
"""Most runs of bins the threshold DP splits; more present bins are thinned to this many."""
CLASS_HEAD = struct.Struct("<IBBI")
"""A class's header in the payload: changes, method, parameter, stream length."""


def _bins(x: npt.NDArray[np.unsignedinteger], width: int) -> npt.NDArray[np.intp]:
    u = UINT[width]
    bins: npt.NDArray[np.unsignedinteger] = (x & u(int(np.iinfo(u).max) >> 1)) >> u(BIN_SHIFT[width])
    return bins.astype(np.intp)


def _nbins(width: int) -> int:
    return ((int(np.iinfo(UINT[width]).max) >> 1) >> BIN_SHIFT[width]) + 1


def _sample(base: Data, width: int) -> npt.NDArray[np.intp]:
    """Elements per magnitude bin among every 16th element of ``base`` (from the first)."""
    return np.bincount(_bins(_elems(base, width)[::16], width), minlength=_nbins(width))


def _threshold_args(width: int, values: Data, max_classes: int, overhead_bits: int) -> None:
    if width not in UINT:
        raise ValueError(f"element width must be 1, 2, 4 or 8, got {width}")
    if not 1 <= max_classes <= MAX_CLASSES or overhead_bits < 0:
        raise ValueError(f"bad class count {max_classes}")
    if len(values) % width:
        raise ValueError("class_thresholds: buffers of whole elements expected")


def class_thresholds(base: Data, width: int, values: Data, max_classes: int, overhead_bits: int, /) -> bytes:
    _threshold_args(width, values, max_classes, overhead_bits)
    if len(base) % width:
        raise ValueError("class_thresholds: buffers of whole elements expected")
    return _thresholds(_sample(base, width), width, values, max_classes, overhead_bits)


def class_thresholds_sampled(sample: Data, width: int, values: Data, max_classes: int, overhead_bits: int, /) -> bytes:
    _threshold_args(width, values, max_classes, overhead_bits)
    if len(sample) % width:
        raise ValueError("class_thresholds: buffers of whole elements expected")
    if len(sample) != 4 * _nbins(width):
        raise ValueError("class_thresholds_sampled: a sample of u32 per bin of the width expected")
    return _thresholds(np.frombuffer(sample, dtype="<u4"), width, values, max_classes, overhead_bits)


def _thresholds(
    sample: npt.NDArray[np.integer], width: int, values: Data, max_classes: int, overhead_bits: int
) -> bytes:
    nbins = _nbins(width)
    n_bins = sample.astype(np.float64) * 16
    k_bins = np.bincount(_bins(_elems(values, width), width), minlength=nbins).astype(np.float64)
    present = np.flatnonzero((n_bins > 0) | (k_bins > 0))
    if len(present) < 2 or max_classes < 2:
        return b""
    if len(present) > MAX_RUNS:
        at = (np.arange(MAX_RUNS, dtype=np.float64) * ((len(present) - 1) / (MAX_RUNS - 1))).astype(np.int64)
        at[-1] = len(present) - 1
        present = present[at]
    # cum[r]: totals of the bins before present[r] (a class is a run present[i] .. present[j] - 1)
    edges = np.concatenate((present, [nbins]))
    cum_n = np.concatenate(([0.0], np.cumsum(n_bins)))[edges]
    cum_k = np.concatenate(([0.0], np.cumsum(k_bins)))[edges]
    cum_n[0] = cum_k[0] = 0.0
    m = len(present)
    i, j = np.triu_indices(m + 1, 1)
    nn = cum_n[j] - cum_n[i]
    kk = np.minimum(cum_k[j] - cum_k[i], nn)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(nn > 0, kk / nn, 0.0)
    # math.log2 is the C library's log2, which the C kernel calls: numpy's may round otherwise
    lp = np.array([math.log2(x) for x in np.where(p > 0, p, 1.0).tolist()], dtype=np.float64)
    lq = np.array([math.log2(x) for x in np.where(p < 1, 1 - p, 1.0).tolist()], dtype=np.float64)
    cost = np.full((m + 1, m + 1), np.inf)
    cost[i, j] = nn * -(p * lp + (1 - p) * lq)
    choices = [cost[0].copy()]  # choices[g][j]: the first j runs in g + 1 classes
    back: list[npt.NDArray[np.intp]] = []
    for _ in range(1, max_classes):
        total = choices[-1][:, None] + cost
        arg = np.argmin(total, axis=0)
        choices.append(total[arg, np.arange(m + 1)])
        back.append(arg)
    totals = [c[m] + g * overhead_bits for g, c in enumerate(choices)]
    g = int(np.argmin(totals))
    cuts: list[int] = []
    at_run = m
    for level in range(g, 0, -1):
        at_run = int(back[level - 1][at_run])
        cuts.append(int(present[at_run]))
    return np.array(sorted(cuts), dtype="<u2").tobytes()


def class_encode(
    base: Data, width: int, thresholds: Data, indices: Data, target_values: Data, base_values: Data, /
) -> tuple[bytes, bytes, bytes, bytes, tuple[tuple[int, bytes, bytes | None], ...]]:
    cls, nclasses = _classes(base, width, thresholds)
    idx = np.frombuffer(indices, dtype=np.uint32).astype(np.int64) if len(indices) % 4 == 0 else None
    if idx is None or len(base) % width or len(target_values) != len(idx) * width or len(base_values) != len(target_values):
        raise ValueError("class_encode: buffers of mismatched sizes")
    if len(idx) and ((np.diff(idx) <= 0).any() or idx[-1] >= len(cls)):
        raise ValueError("class_encode: indices must be increasing and in range")
    of = cls[idx]
    ranks = np.empty(len(idx), dtype=np.int64)
    for c in range(nclasses):
        before = np.cumsum(cls == c) - 1  # rank of each element of class c
        ranks[of == c] = before[idx[of == c]]
    order = np.argsort(of, kind="stable")
    per = np.bincount(of, minlength=nclasses)
    counts = np.bincount(cls, minlength=nclasses)
    ranks = ranks[order]
    classes: list[tuple[int, bytes, bytes | None]] = []
    at = 0
    for k_c, n_c in zip(per.tolist(), counts.tolist(), strict=True):
        r = ranks[at : at + k_c]
        at += k_c
        rice_k, rice = rice_encode(r.astype(np.uint32).tobytes())
        bitmap = None
        if k_c and 8 * k_c >= n_c:
            mask = np.zeros(n_c, dtype=np.uint8)
            mask[r] = 1
            bitmap = _pack(mask)
        classes.append((rice_k, rice, bitmap))
    tv, bv = _elems(target_values, width)[order].tobytes(), _elems(base_values, width)[order].tobytes()
    return counts.astype(np.uint32).tobytes(), per.astype(np.uint32).tobytes(), tv, bv, tuple(classes)


def class_select(
    base: Data, width: int, thresholds: Data, counts: Data, heads: Data, streams: Sequence[Data], values: Data, /
) -> tuple[bytes, bytes]:
    cls, nclasses = _classes(base, width, thresholds)
    if (len(base) % width or len(values) % width or len(counts) != 4 * nclasses
            or len(heads) != CLASS_HEAD.size * nclasses or len(streams) != nclasses):
        raise ValueError("class_select: buffers of mismatched sizes")
    n_c = np.frombuffer(counts, dtype=np.uint32).astype(np.int64).tolist()
    head = list(CLASS_HEAD.iter_unpack(bytes(heads)))
    for (k_c, method, param, length), n, stream in zip(head, n_c, streams, strict=True):
        if k_c > n:
            raise ValueError("more changes than elements in a class")
        if k_c == 0 and (method or param or length or len(stream)):
            raise ValueError("empty class with a stream")
        if k_c and method == 0 and (param > MAX_RICE_K or len(stream) != length):
            raise ValueError("bad Rice class stream")
        if k_c and method == 1 and (param or len(stream) != (n + 7) // 8):
            raise ValueError("bad class bitmap")
        if method > 1:
            raise ValueError("unknown class coding")
    if sum(n_c) != len(cls):
        raise ValueError("class counts do not add up to the chunk")
    if sum(h[0] for h in head) != len(values) // width:
        raise ValueError("class changes do not add up to the values")
    parts: list[npt.NDArray[np.int64]] = []
    for (k_c, method, param, _), n, stream in zip(head, n_c, streams, strict=True):
        if not k_c:
            continue
        if method == 0:
            ranks = np.frombuffer(rice_decode(stream, k_c, param, n), dtype=np.uint32).astype(np.int64)
        else:
            if not _exact_padding(stream, n):
                raise ValueError("class bitmap padding is not zero")
            ranks = np.flatnonzero(_unpack(stream)[:n])
            if len(ranks) != k_c:
                raise ValueError("class bitmap holds another number of changes")
        parts.append(ranks)
    if (np.bincount(cls, minlength=nclasses) != np.array(n_c)).any():
        raise ValueError("class positions do not match the base (ranks or class counts)")
    out: list[npt.NDArray[np.int64]] = []
    at = 0
    for c, (k_c, *_) in enumerate(head):
        if k_c:
            out.append(np.flatnonzero(cls == c)[parts[at]])
            at += 1
    where = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    order = np.argsort(where, kind="stable")
    return where[order].astype(np.uint32).tobytes(), _elems(values, width)[order].tobytes()

"""Pure-numpy twin of the ``deltasync._kernels`` extension module.

Same functions, arguments and byte-identical results; malformed input raises ValueError in
both. The codec uses the C module when it imports (built by ``pip install``) and this one
otherwise; tests run both and compare. The formats are documented in ``deltasync/format/codec.py``
and the C source: bit streams are LSB-first, a unary code of q is q zero bits then a one,
every stream is padded with zero bits to whole bytes.
"""

from __future__ import annotations

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
        ones = np.flatnonzero(_unpack(prefix))
        if len(ones) < m:
            raise ValueError("escape stream ends early")
        nb = (np.diff(ones[:m], prepend=-1) - 1).astype(np.int64)
        if (nb > 63).any():
            raise ValueError("escape runs past its stream")
        starts = np.cumsum(nb + k) - (nb + k)
        if int(starts[-1] + k + nb[-1]) > 8 * len(suffix):
            raise ValueError("escape runs past its stream")
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


def class_ranks(base: Data, width: int, thresholds: Data, indices: Data, /) -> tuple[bytes, bytes, bytes, bytes]:
    if len(indices) % 4 or len(base) % width:
        raise ValueError("class_ranks: buffers of mismatched sizes")
    cls, nclasses = _classes(base, width, thresholds)
    idx = np.frombuffer(indices, dtype=np.uint32).astype(np.int64)
    if len(idx) and ((np.diff(idx) <= 0).any() or idx[-1] >= len(cls)):
        raise ValueError("class_ranks: indices must be increasing and in range")
    ranks = np.empty(len(idx), dtype=np.uint32)
    of = cls[idx]
    for c in range(nclasses):
        before = np.cumsum(cls == c) - 1  # rank of each element of class c
        ranks[of == c] = before[idx[of == c]]
    order = np.argsort(of, kind="stable")
    per = np.bincount(of, minlength=nclasses).astype(np.uint32)
    counts = np.bincount(cls, minlength=nclasses).astype(np.uint32)
    return order.astype(np.uint32).tobytes(), ranks[order].tobytes(), per.tobytes(), counts.tobytes()


def class_select(
    base: Data, width: int, thresholds: Data, counts: Data, ranks: Data, per_class: Data, /
) -> tuple[bytes, bytes]:
    cls, nclasses = _classes(base, width, thresholds)
    if len(base) % width or len(ranks) % 4 or len(counts) != 4 * nclasses or len(per_class) != 4 * nclasses:
        raise ValueError("class_select: buffers of mismatched sizes")
    per = np.frombuffer(per_class, dtype=np.uint32).astype(np.int64)
    r = np.frombuffer(ranks, dtype=np.uint32).astype(np.int64)
    if int(per.sum()) != len(r):
        raise ValueError("class_select: per-class counts do not add up to the ranks")
    bounds = np.concatenate(([0], np.cumsum(per)))
    out = np.empty(len(r), dtype=np.int64)
    bad = False
    for c in range(nclasses):
        rc = r[bounds[c] : bounds[c + 1]]
        if len(rc) > 1 and (np.diff(rc) <= 0).any():
            raise ValueError("class positions do not match the base (ranks or class counts)")
        members = np.flatnonzero(cls == c)
        if len(rc) and rc[-1] >= len(members):
            bad = True
            break
        out[bounds[c] : bounds[c + 1]] = members[rc]
    if bad or (np.bincount(cls, minlength=nclasses) != np.frombuffer(counts, dtype=np.uint32)).any():
        raise ValueError("class positions do not match the base (ranks or class counts)")
    order = np.argsort(out, kind="stable")
    return out[order].astype(np.uint32).tobytes(), order.astype(np.uint32).tobytes()

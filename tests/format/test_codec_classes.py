"""Codec version 2, positions in magnitude classes of the base: the C kernels against their numpy
twin (the threshold choice, class ranks and value order, class decoding), round trips at every
width, damaged payloads, and payloads pinned to the bytes the first version 2 encoder wrote."""

from __future__ import annotations

import hashlib
import struct
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings, strategies as st

import deltasync.format.codec as codec_module
from deltasync.errors import CorruptObjectError
from deltasync.format import _kernels_py
from deltasync.format.codec import MAX_CLASSES, SPARSE, EncodedChunk, PlanesZstdCodec

Bytes = npt.NDArray[np.uint8]
UINT: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
BIN_SHIFT = {1: 3, 2: 7, 4: 23, 8: 52}  # as documented in codec.py
CLASS_HEAD = struct.Struct("<IBBI")
OVERHEAD_BITS = 8 * (CLASS_HEAD.size + 6)

c_kernels: ModuleType | None
try:
    from deltasync.format import _kernels as c_kernels
except ImportError:  # pragma: no cover - the extension is built by every normal install
    c_kernels = None

KERNEL_IMPLS: list[ModuleType] = [_kernels_py] + ([c_kernels] if c_kernels is not None else [])
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Bit patterns that must not confuse a magnitude: signed zeros, infinities, NaNs with payloads.
SPECIALS: dict[int, list[int]] = {
    1: [0x00, 0x80, 0x7F, 0xFF, 0x78, 0xF8, 0x01, 0x81],
    2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC1, 0x0001, 0x8001, 0x7FFF],
    4: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC12345, 0x7FFFFFFF],
    8: [0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000, 0xFFF8DEADBEEF0000,
        0x7FFFFFFFFFFFFFFF, 1],
}


@contextmanager
def kernels(impl: ModuleType) -> Iterator[None]:
    saved = codec_module._K
    codec_module._K = cast(Any, impl)
    try:
        yield
    finally:
        codec_module._K = saved


def agree(kernel: str, *args: object) -> Any:
    """Call ``kernel`` of every implementation: all must raise ValueError or all return the same."""
    results: list[object] = []
    for impl in KERNEL_IMPLS:
        try:
            results.append(getattr(impl, kernel)(*args))
        except ValueError:
            results.append(ValueError)
    assert all(r == results[0] for r in results), (kernel, results)
    return results[0]


def weights(rng: np.random.Generator, n: int, width: int, specials: float) -> Bytes:
    """Bit patterns of weights over many magnitudes (many bins), some special values among them."""
    u = UINT[width]
    top = int(np.iinfo(u).max)
    if width == 1:
        bits = rng.integers(0, 256, n).astype(u)
    else:
        x = rng.normal(0, 1, n) * np.exp(rng.normal(-4, 3, n))
        if width == 2:
            bits = (x.astype(np.float32).view(np.uint32) >> 16).astype(u)
        elif width == 4:
            bits = x.astype(np.float32).view(u)
        else:
            bits = x.view(u)
    special = rng.random(n) < specials
    bits[special] = np.array(SPECIALS[width], dtype=np.uint64)[rng.integers(0, len(SPECIALS[width]), n)][special].astype(u)
    assert int(bits.max(initial=0)) <= top
    return bits.view(np.uint8).copy()


def changed(rng: np.random.Generator, base: Bytes, width: int, pattern: str) -> Bytes:
    """A target: base with a change pattern, small changes favoured on small magnitudes."""
    u = UINT[width]
    b = base.view(u)
    n = len(b)
    if pattern == "none":
        mask = np.zeros(n, dtype=bool)
    elif pattern == "all":
        mask = np.ones(n, dtype=bool)
    elif pattern == "dense":
        mask = rng.random(n) < 0.6
    elif pattern == "one":
        mask = np.zeros(n, dtype=bool)
        mask[rng.integers(0, n)] = True
    else:  # magnitude-dependent, as an AdamW step of a cast does: small weights change more often
        mag = (b & u(int(np.iinfo(u).max) >> 1)).astype(np.float64)
        p = 0.5 * (1 - mag / max(1.0, float(mag.max(initial=0))))
        mask = rng.random(n) < (p if pattern == "weights" else p * 0.05)
    t = b.copy()
    delta = rng.integers(1, 3, n).astype(u)
    t[mask] = np.where(rng.random(int(mask.sum())) < 0.5, b[mask] + delta[mask], b[mask] - delta[mask])
    t[mask & (t == b)] ^= u(1)
    return t.view(np.uint8).copy()


PATTERNS = ("none", "one", "sparse", "weights", "dense", "all")


@st.composite
def chunks(draw: st.DrawFn) -> tuple[int, Bytes, Bytes]:
    width = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = weights(rng, n, width, draw(st.sampled_from([0.0, 0.02, 0.5])))
    return width, changed(rng, base, width, draw(st.sampled_from(PATTERNS))), base


def random_thresholds(rng: np.random.Generator, width: int, most: int) -> bytes:
    max_bin = (int(np.iinfo(UINT[width]).max) >> 1) >> BIN_SHIFT[width]
    count = int(rng.integers(0, min(most, max_bin) + 1))
    cuts = np.sort(rng.choice(np.arange(1, max_bin + 1), size=count, replace=False))
    return cuts.astype("<u2").tobytes()


# -- the kernels: C against numpy ----------------------------------------------------------


@PROPERTY
@given(chunk=chunks(), max_classes=st.integers(1, MAX_CLASSES), seed=st.integers(0, 2**32 - 1))
def test_class_kernels_agree(chunk: tuple[int, Bytes, Bytes], max_classes: int, seed: int) -> None:
    width, target, base = chunk
    n = len(base) // width
    _, idx, tv, bv = _kernels_py.scan(target, base, width, n)
    assert idx is not None and tv is not None and bv is not None
    chosen = agree("class_thresholds", base, width, bv, max_classes, OVERHEAD_BITS)
    assert isinstance(chosen, bytes)
    # the encoder's path: the base's sample counted by the scan, the thresholds from it
    for limit in (n, max(len(idx) // 4 - 1, 0)):
        sampled = agree("scan_sampled", target, base, width, limit)
        assert isinstance(sampled, tuple)
        assert sampled[:4] == _kernels_py.scan(target, base, width, limit)
        assert agree("class_thresholds_sampled", sampled[4], width, bv, max_classes, OVERHEAD_BITS) == chosen
    th = np.frombuffer(chosen, dtype="<u2")
    assert len(th) < max_classes and (np.diff(th.astype(np.int64)) > 0).all() and (th >= 1).all()
    rng = np.random.default_rng(seed)
    for thresholds in (chosen, random_thresholds(rng, width, MAX_CLASSES - 1)):
        enc = agree("class_encode", base, width, thresholds, idx, tv, bv)
        assert isinstance(enc, tuple)
        counts, per, otv, _, classes = enc
        k_c = np.frombuffer(per, dtype=np.uint32)
        n_c = np.frombuffer(counts, dtype=np.uint32)
        assert int(n_c.sum()) == n and int(k_c.sum()) == len(idx) // 4
        assert sorted(np.frombuffer(otv, UINT[width]).tolist()) == sorted(np.frombuffer(tv, UINT[width]).tolist())
        for (rice_k, rice, bitmap), kc, nc in zip(classes, k_c.tolist(), n_c.tolist(), strict=True):
            assert (bitmap is not None) == (kc > 0 and 8 * kc >= nc)
            assert (rice_k, rice) == _kernels_py.rice_encode(decode_ranks(0, rice_k, rice, kc, nc))
            if bitmap is not None:
                assert decode_ranks(1, 0, bitmap, kc, nc) == decode_ranks(0, rice_k, rice, kc, nc)
        # both methods, whichever the codec would pick, decode back to the scan's order
        for method in (0, 1):
            heads, streams = [], []
            for (rice_k, rice, bitmap), kc in zip(classes, k_c.tolist(), strict=True):
                use_bitmap = method == 1 and bitmap is not None
                stream = bitmap if use_bitmap and bitmap is not None else rice
                heads.append(CLASS_HEAD.pack(kc, int(use_bitmap), 0 if use_bitmap else rice_k,
                                             len(stream)))
                streams.append(stream)
            got = agree("class_select", base, width, thresholds, counts, b"".join(heads), streams, otv)
            assert got == (idx, tv)


def decode_ranks(method: int, param: int, stream: bytes, k_c: int, n_c: int) -> bytes:
    if k_c == 0:
        return b""
    if method == 0:
        return _kernels_py.rice_decode(stream, k_c, param, n_c)
    bits = np.unpackbits(np.frombuffer(stream, dtype=np.uint8), bitorder="little")
    assert len(stream) == (n_c + 7) // 8 and not bits[n_c:].any()
    return np.flatnonzero(bits).astype(np.uint32).tobytes()


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_thresholds_agree_on_many_bins(width: int) -> None:
    """More than 64 bins present (the DP thins them), near-ties from repeated structure, and
    every class count: the C DP and the numpy one pick the same thresholds."""
    rng = np.random.default_rng(width)
    u = UINT[width]
    nbins = ((int(np.iinfo(u).max) >> 1) >> BIN_SHIFT[width]) + 1
    for trial in range(12):
        n = int(rng.integers(2000, 40_000))
        spread = min(nbins, 200)
        bins = rng.integers(0, nbins, n) if trial % 3 else np.repeat(np.arange(spread), n // spread + 1)[:n]
        low = rng.integers(0, 1 << BIN_SHIFT[width], n).astype(np.uint64)
        base = (bins.astype(np.uint64) << np.uint64(BIN_SHIFT[width])) | low
        base |= (rng.random(n) < 0.5).astype(np.uint64) << np.uint64(8 * width - 1)  # signs do not matter
        b = base.astype(u).view(np.uint8)
        k = int(rng.integers(0, n))
        values = b.view(u)[np.sort(rng.choice(n, size=k, replace=False))].tobytes()
        for max_classes in range(1, MAX_CLASSES + 1):
            agree("class_thresholds", b, width, values, max_classes, OVERHEAD_BITS)


@PROPERTY
@given(chunk=chunks(), data=st.data())
def test_class_select_refuses_the_same_damaged_input(chunk: tuple[int, Bytes, Bytes], data: st.DataObject) -> None:
    width, target, base = chunk
    n = len(base) // width
    _, idx, tv, bv = _kernels_py.scan(target, base, width, n)
    assert idx is not None and tv is not None and bv is not None
    thresholds = random_thresholds(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))), width, 5)
    counts, per, otv, _, classes = _kernels_py.class_encode(base, width, thresholds, idx, tv, bv)
    heads = [CLASS_HEAD.pack(kc, 0, rk, len(rice)) for kc, (rk, rice, _) in
             zip(np.frombuffer(per, dtype=np.uint32).tolist(), classes, strict=True)]
    streams = [rice for _, rice, _ in classes]
    parts: list[bytes] = [thresholds, counts, b"".join(heads), otv]
    which = data.draw(st.integers(0, 4 + len(streams) - 1))
    if which < 4:
        parts[which] = mutate(parts[which], data)
    else:
        streams[which - 4] = mutate(streams[which - 4], data)
    bad_base = mutate(base.tobytes(), data) if data.draw(st.booleans()) else base
    agree("class_select", bad_base, width, parts[0], parts[1], parts[2], streams, parts[3])


def mutate(data: bytes, draws: st.DataObject) -> bytes:
    draw = draws.draw
    kind = draw(st.sampled_from(["flip", "cut", "append", "zero"]))
    if not data or kind == "append":
        return data + draw(st.binary(min_size=1, max_size=3))
    at = draw(st.integers(0, len(data) - 1))
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ (1 << draw(st.integers(0, 7)))]) + data[at + 1 :]
    if kind == "zero":
        return data[:at] + b"\x00" + data[at + 1 :]
    return data[:at]


def test_class_kernels_refuse_bad_arguments() -> None:
    base = np.arange(64, dtype=np.uint16).view(np.uint8)
    idx = np.array([1, 5], dtype=np.uint32).tobytes()
    two = base.view(np.uint16)[[1, 5]].tobytes()
    th = np.array([1], dtype="<u2").tobytes()
    for k in KERNEL_IMPLS:
        with pytest.raises(ValueError):
            k.class_thresholds(base, 2, two, 0, OVERHEAD_BITS)
        with pytest.raises(ValueError):
            k.class_thresholds(base, 2, b"\x00", 6, OVERHEAD_BITS)
        sample = k.scan_sampled(base, base, 2, 32)[4]
        assert len(sample) == 4 * 256 and sum(np.frombuffer(sample, dtype="<u4").tolist()) == 4  # elements 0, 16, 32, 48
        for bad in (sample[:-4], sample + b"\x00" * 4, b""):
            with pytest.raises(ValueError):
                k.class_thresholds_sampled(bad, 2, two, 6, OVERHEAD_BITS)
        with pytest.raises(ValueError):
            k.class_thresholds_sampled(sample, 1, two, 6, OVERHEAD_BITS)  # 16 bins of width 1
        with pytest.raises(ValueError):
            k.class_encode(base, 2, th, np.array([5, 1], dtype=np.uint32).tobytes(), two, two)
        with pytest.raises(ValueError):
            k.class_encode(base, 2, th, np.array([1, 64], dtype=np.uint32).tobytes(), two, two)
        with pytest.raises(ValueError):
            k.class_encode(base, 2, th, idx, two[:2], two)
        with pytest.raises(ValueError):
            k.class_encode(base, 2, np.array([2, 2], dtype="<u2").tobytes(), idx, two, two)
        counts, _, otv, _, classes = k.class_encode(base, 2, th, idx, two, two)
        heads = b"".join(CLASS_HEAD.pack(1 if rice else 0, 0, rk, len(rice)) for rk, rice, _ in classes)
        streams = [rice for _, rice, _ in classes]
        with pytest.raises(ValueError):
            k.class_select(base, 2, th, counts, heads, streams[:1], otv)  # a stream short
        with pytest.raises(ValueError):
            k.class_select(base, 2, th, counts, heads, streams, otv + otv[:2])  # a value more


# -- the codec: round trips, damage, the bytes of earlier encoders ---------------------------


@PROPERTY
@given(chunk=chunks(), max_classes=st.integers(2, MAX_CLASSES), exhaustive=st.booleans())
def test_class_chunks_round_trip_with_either_kernels(chunk: tuple[int, Bytes, Bytes], max_classes: int,
                                                     exhaustive: bool) -> None:
    width, target, base = chunk
    codec = PlanesZstdCodec(max_classes=max_classes, exhaustive=exhaustive)
    encs = []
    for impl in KERNEL_IMPLS:
        with kernels(impl):
            enc = codec.encode(target, base, width)
            encs.append(enc)
            assert codec.decode(enc, base, width, len(base)).tobytes() == target.tobytes()
            work = base.copy()
            codec.decode_into(enc, work, work, width)  # in place
            assert work.tobytes() == target.tobytes()
    assert all(e == encs[0] for e in encs)


@PROPERTY
@given(chunk=chunks(), data=st.data())
def test_damaged_class_payloads_raise_corrupt_object(chunk: tuple[int, Bytes, Bytes], data: st.DataObject) -> None:
    width, target, base = chunk
    codec = PlanesZstdCodec(max_classes=6)
    enc = codec.encode(target, base, width)
    if enc.encoding != SPARSE or enc.payload[1] != 3:
        return
    bad = EncodedChunk(enc.encoding, mutate(enc.payload, data))
    results: list[bytes | None] = []
    for impl in KERNEL_IMPLS:
        with kernels(impl):
            try:
                results.append(codec.decode(bad, base, width, len(base)).tobytes())
            except CorruptObjectError:
                results.append(None)
            work = base.copy()
            try:
                codec.decode_into(bad, work, work, width)
            except CorruptObjectError:
                assert work.tobytes() == base.tobytes()  # a refused payload leaves out as it was
    assert all(r == results[0] for r in results)


def golden_inputs() -> list[tuple[int, Bytes, Bytes]]:
    """Weight-like chunks from fixed seeds: (width, target, base)."""
    out = []
    for seed, width, n, step_size in ((1, 2, 60_000, 0.5), (2, 2, 20_000, 3.0), (3, 4, 30_000, 0.5), (4, 2, 5_000, 0.05)):
        rng = np.random.default_rng(seed)
        w32 = (rng.normal(0, 1, n) * np.exp(rng.normal(-4, 1.5, n))).astype(np.float32)
        step = w32 + rng.normal(0, step_size * 1e-5, n).astype(np.float32)
        if width == 2:
            base = (w32.view(np.uint32) >> 16).astype(np.uint16)
            target = (step.view(np.uint32) >> 16).astype(np.uint16)
        else:
            keep = np.uint32(0xFFFF)
            base, target = w32.view(np.uint32), (step.view(np.uint32) & ~keep) | (w32.view(np.uint32) & keep)
        out.append((width, target.view(np.uint8).copy(), base.view(np.uint8).copy()))
    return out


# sha256 (first 16 bytes) and length of PlanesZstdCodec(max_classes=6) payloads of golden_inputs(),
# as the version 2 encoder with its class DP in numpy (before commit cb8505c) wrote them
GOLDEN = [("6649c5cb56899cfabafc47b013ab2754", 7697), ("811966028a8aef9499c89d1325715538", 6479),
          ("484031236c11e0974d449fed9c12c1ab", 4894), ("02d59ad6aaafdc791482176cbeb143bb", 247)]


@pytest.mark.parametrize("impl", KERNEL_IMPLS, ids=lambda m: m.__name__)
def test_class_payloads_are_the_bytes_earlier_encoders_wrote(impl: ModuleType) -> None:
    codec = PlanesZstdCodec(max_classes=6)
    with kernels(impl):
        for (width, target, base), (digest, length) in zip(golden_inputs(), GOLDEN, strict=True):
            enc = codec.encode(target, base, width)
            assert enc.encoding == SPARSE and enc.payload[1] == 3  # magnitude classes
            assert (hashlib.sha256(enc.payload).hexdigest()[:32], len(enc.payload)) == (digest, length)
            assert codec.decode(enc, base, width, len(base)).tobytes() == target.tobytes()


_PORTABLE_SCRIPT = """
import sys, numpy as np
from deltasync.format import _kernels as k
sys.stdout.write(k.simd + '\\n')
for width in (1, 2, 4, 8):
    for seed in range(4):
        rng = np.random.default_rng(seed)
        u = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
        n = 1000 + 37 * seed
        base = rng.integers(0, 1 << min(63, 8 * width), n, dtype=np.uint64).astype(u)
        base >>= u(int(rng.integers(0, 8 * width - 1)) % 5)
        target = base.copy()
        target[rng.random(n) < (0.02, 0.3, 0.9, 0.001)[seed]] ^= u(1)
        _, idx, tv, bv = k.scan(target.view(np.uint8), base.view(np.uint8), width, n)
        th = k.class_thresholds(base.view(np.uint8), width, bv, 8, 128)
        if not th:
            th = np.array([1], dtype='<u2').tobytes()
        counts, per, otv, obv, classes = k.class_encode(base.view(np.uint8), width, th, idx, tv, bv)
        heads = b''.join(np.array([p], '<u4').tobytes() + bytes([0, rk]) + np.array([len(r)], '<u4').tobytes()
                         for p, (rk, r, _) in zip(np.frombuffer(per, np.uint32).tolist(), classes))
        back = k.class_select(base.view(np.uint8), width, th, counts, heads, [r for _, r, _ in classes], otv)
        assert back == (idx, tv)
        sys.stdout.write(repr((th, counts, per, otv, obv, classes)) + '\\n')
"""


@pytest.mark.skipif(c_kernels is None or getattr(c_kernels, "simd", "") != "avx512bw", reason="no AVX-512 here")
def test_the_portable_class_loops_agree_with_the_avx512_ones() -> None:
    """The class loops pick AVX-512 + BMI2 at import; run the SSE2 / software pdep ones in a child."""
    import os
    import subprocess
    import sys

    runs = []
    for env in (dict(os.environ, DELTASYNC_NO_AVX512="1"), dict(os.environ)):
        child = subprocess.run([sys.executable, "-c", _PORTABLE_SCRIPT], env=env, capture_output=True, text=True,
                               check=True)
        runs.append(child.stdout.splitlines())
    assert runs[0][0] == "sse2" and runs[1][0] == "avx512bw"
    assert runs[0][1:] == runs[1][1:] and len(runs[0]) == 17


# -- hostile bit streams: bounded work and memory, the same refusals --------------------------------


def _hostile_sparse(kind: str, nbytes: int) -> tuple[bytes, Bytes]:
    """A sparse payload of a bf16 chunk of ``nbytes`` whose bit stream (Rice positions, a Rice
    class stream, or the escape prefix of 2-bit values) is as long as a payload may be, all one
    bits, and a base for it."""
    zc = zstandard.ZstdCompressor(write_content_size=True)
    n = nbytes // 2
    base = np.zeros(nbytes, dtype=np.uint8)
    ones = b"\xff" * (2 * nbytes)  # max_payload(nbytes) allows about this much
    header = struct.Struct("<BBBBQQ")  # transform, position coding and parameter, value parameter, count, length
    value = zc.compress(b"\x01\x00")  # one change, XOR 1
    if kind == "rice":
        return header.pack(0, 2, 0, 0, 1, len(ones)) + ones + value, base
    if kind == "classes":
        base.view(np.uint16)[: n // 2] = 0x3F80  # 1.0: bins >= 1 in class 1, zeros in class 0
        section = (struct.pack("<H", 1) + struct.pack("<II", n - n // 2, n // 2)
                   + CLASS_HEAD.pack(1, 0, 0, len(ones)) + CLASS_HEAD.pack(0, 0, 0, 0) + ones)
        return header.pack(0, 3, 2, 0, 1, len(section)) + section + value, base
    symbols = zc.compress(b"\x03")  # one escape
    positions = zc.compress(b"\x01" + bytes((n + 7) // 8 - 1))  # bitmap: element 0
    values = struct.pack("<I", len(symbols)) + symbols + struct.pack("<I", len(ones)) + ones
    return header.pack(2, 0, 0, 0, 1, len(positions)) + positions + values, base


@pytest.mark.parametrize("kind", ["rice", "classes", "escapes"])
@pytest.mark.parametrize("impl", KERNEL_IMPLS, ids=lambda m: m.__name__)
def test_hostile_bit_streams_are_refused_without_expanding_them(impl: ModuleType, kind: str) -> None:
    """A stream of one bits is refused by both kernels; the numpy twin used to expand it to bit
    positions first (64 bytes per stream byte: about 570 MiB for a 4 MiB chunk's payload)."""
    nbytes = 1 << 20
    payload, base = _hostile_sparse(kind, nbytes)
    codec = PlanesZstdCodec()
    assert len(payload) <= codec.max_payload(nbytes)
    out = base.copy()
    with kernels(impl):
        tracemalloc.start()
        try:
            with pytest.raises(CorruptObjectError):
                codec.decode_into(EncodedChunk(SPARSE, payload), base, out, 2)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert (out == base).all()
    assert peak < 4 * len(payload), peak  # was about 64 times the payload in the twin


def _lying_class_payload(rng: np.random.Generator, base: Bytes, width: int, lie: int) -> bytes:
    """A class-coded sparse payload built field by field for ``base``, true but for one lie."""
    u = UINT[width]
    zc = zstandard.ZstdCompressor(write_content_size=True)
    top = int(np.iinfo(u).max) >> 1
    bins = (base.view(u) & u(top)) >> u(BIN_SHIFT[width])
    present = np.unique(bins[bins >= 1]).astype(np.int64)
    pool = present if len(present) >= 2 else np.arange(1, (top >> BIN_SHIFT[width]) + 1)
    th = np.sort(rng.choice(pool, size=min(int(rng.integers(1, MAX_CLASSES)), len(pool)), replace=False))
    nclasses = len(th) + 1
    counts = np.bincount(np.searchsorted(th, bins.astype(np.int64), side="right"),
                         minlength=nclasses).astype(np.int64)
    if lie == 1:  # elements moved between classes, the sum kept
        a, b = rng.choice(nclasses, 2, replace=False)
        counts[a] += 1
        counts[b] -= 1
    heads, streams = [], []
    for n_c in counts.tolist():
        k_c = int(rng.integers(0, n_c + 1)) if n_c > 0 else 0
        ranks = np.sort(rng.choice(n_c, size=k_c, replace=False)).astype(np.uint32) if k_c else np.zeros(0, np.uint32)
        if lie == 2 and k_c:  # a rank past its class
            ranks[-1] = n_c + int(rng.integers(0, 70))
        method, param, stream = 0, 0, b""
        if k_c and rng.random() < 0.5:
            bits = np.zeros(max(n_c, int(ranks[-1]) + 1), dtype=np.uint8)
            bits[ranks] = 1
            method, stream = 1, zc.compress(np.packbits(bits, bitorder="little").tobytes())
        elif k_c:
            param, stream = _kernels_py.rice_encode(ranks.tobytes())
            if lie == 3:
                param = (param + int(rng.integers(1, 40))) % 256
        if lie == 4:
            k_c = max(0, k_c + int(rng.choice([-1, 1])))
        heads.append(CLASS_HEAD.pack(k_c, method, param, len(stream)))
        streams.append(stream)
    if lie == 5:
        th[int(rng.integers(0, len(th)))] = int(rng.choice([0, 65535, int(th[-1])]))
    count = sum(CLASS_HEAD.unpack(h)[0] for h in heads) + (int(rng.choice([-1, 1])) if lie == 6 else 0)
    values = rng.integers(1, 1 << min(63, 8 * width), max(count, 0), dtype=np.uint64).astype(u)
    section = (th.astype("<u2").tobytes() + (counts & 0xFFFFFFFF).astype("<u4").tobytes() + b"".join(heads)
               + b"".join(streams))
    if lie == 7:  # a field overwritten with an extreme value
        at = int(rng.integers(0, len(section)))
        section = section[:at] + rng.choice([b"\x00" * 4, b"\xff" * 4, b"\x00\x00\x00\x80"]) + section[at + 4 :]
    header = struct.pack("<BBBBQQ", 0, 3, nclasses, 0, max(count, 0), len(section))
    return header + section + zc.compress(values.view(np.uint8).reshape(-1, width).T.tobytes())


def test_class_payloads_with_lying_fields_are_refused_alike() -> None:
    """Payloads that are well formed but for one field (class counts moved, a rank past its
    class, a wrong Rice parameter, change counts, thresholds, the total, an extreme value):
    every kernel refuses the same ones, leaves ``out`` as it was, and decodes the rest alike."""
    rng = np.random.default_rng(7)
    codec = PlanesZstdCodec()
    refused: dict[int, int] = {}
    for trial in range(160):
        width = (1, 2, 4, 8)[trial % 4]
        n = int(rng.choice([1, 63, 64, 65, 200, 1000]))
        base = weights(rng, n, width, 0.02)
        payload = _lying_class_payload(rng, base, width, trial % 8)
        results: list[bytes | None] = []
        for impl in KERNEL_IMPLS:
            with kernels(impl):
                work = base.copy()
                try:
                    codec.decode_into(EncodedChunk(SPARSE, payload), work, work, width)
                    results.append(work.tobytes())
                except CorruptObjectError:
                    assert work.tobytes() == base.tobytes()
                    results.append(None)
        assert all(r == results[0] for r in results), trial
        refused[trial % 8] = refused.get(trial % 8, 0) + (results[0] is None)
    assert refused[0] == 0  # honest payloads decode
    assert refused[1] == refused[2] == refused[6] == 20  # lies that no payload gets away with
    assert sum(refused.values()) >= 130

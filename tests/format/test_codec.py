"""The chunk codec: lossless round trips, the choice of encoding, chunking, hostile payloads."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings, strategies as st

import deltasync.format.codec as codec_module
from deltasync.errors import CorruptObjectError, UsageError
from deltasync.format import _kernels_py
from deltasync.format.codec import (
    DENSE,
    ENCODING_NAMES,
    FULL,
    MAX_CLASSES,
    SAME,
    SPARSE,
    EncodedChunk,
    Encoding,
    PlanesZstdCodec,
    codec_from_spec,
    decode_reverse,
    planes,
    unplanes,
)

Bytes = npt.NDArray[np.uint8]

WIDTHS = (1, 2, 4, 8)
UINT: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# Payload layouts, as documented in deltasync/format/codec.py (codec_version 1).
SPARSE_HEADER = struct.Struct("<BBBBQQ")
U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")
XOR, ZIGZAG, ZIGZAG2 = 0, 1, 2
BITMAP, GAPS, RICE = 0, 1, 2

c_kernels: ModuleType | None
try:
    from deltasync.format import _kernels as c_kernels
except ImportError:  # pragma: no cover - the extension is built by every normal install
    c_kernels = None
# Every implementation of the kernels: the numpy twin always, the C extension when built.
KERNEL_IMPLS: list[ModuleType] = [_kernels_py] + ([c_kernels] if c_kernels is not None else [])

PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Bit patterns that float codecs get wrong when they compare values instead of bits:
# signed zeros, infinities, quiet and signalling NaNs with payloads, subnormals.
SPECIALS: dict[int, list[int]] = {
    1: [0x00, 0x80, 0x7F, 0xFF, 0x7C, 0xFC, 0x01, 0x81],  # fp8 e4m3 / e5m2
    2: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE01,  # fp16
        0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC1, 0x0001, 0x8001],  # bf16
    4: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
        0xFFC12345, 0x7FFFFFFF, 0x00000001, 0x80000001],
    8: [0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000,
        0x7FF0000000000001, 0xFFF8DEADBEEF0000, 0x7FFFFFFFFFFFFFFF, 1, (1 << 63) | 1],
}

PATTERNS = ("none", "one", "few", "sparse", "dense", "all", "runs", "ulps", "specials", "signed-zeros")


def bogus(value: int) -> Encoding:
    """An encoding id this codec does not define (as a hostile manifest may name)."""
    return cast(Encoding, value)


@dataclass(frozen=True)
class Case:
    width: int
    pattern: str
    base: Bytes
    target: Bytes

    @property
    def n(self) -> int:
        return len(self.target) // self.width


def _nonzero(rng: np.random.Generator, count: int, width: int) -> npt.NDArray[np.unsignedinteger]:
    vals = rng.integers(0, 256, count * width, dtype=np.uint8).view(UINT[width])
    vals[vals == 0] = 1
    return vals


def make_case(seed: int, width: int, n: int, pattern: str) -> Case:
    rng = np.random.default_rng(seed)
    u = UINT[width]
    base = rng.integers(0, 256, n * width, dtype=np.uint8)
    b = base.view(u)
    t = b.copy()
    if n and pattern != "none":
        if pattern == "one":
            idx = rng.integers(0, n, 1)
        elif pattern == "few":
            idx = rng.choice(n, size=min(n, int(rng.integers(1, 6))), replace=False)
        elif pattern == "sparse":
            idx = np.flatnonzero(rng.random(n) < rng.uniform(0.001, 0.1))
        elif pattern == "dense":
            idx = np.flatnonzero(rng.random(n) < rng.uniform(0.3, 0.97))
        elif pattern == "all":
            idx = np.arange(n)
        elif pattern == "runs":
            parts = []
            for _ in range(int(rng.integers(1, 4))):
                start = int(rng.integers(0, n))
                parts.append(np.arange(start, min(n, start + int(rng.integers(1, 300)))))
            idx = np.unique(np.concatenate(parts))
        else:
            idx = np.flatnonzero(rng.random(n) < rng.uniform(0.01, 1.0))
        if pattern == "ulps":  # the RL-step shape: +-1 in the last place, wrapping
            step = np.where(rng.random(len(idx)) < 0.5, u(1), u(np.iinfo(u).max)).astype(u)
            t[idx] = b[idx] + step
        elif pattern == "specials":
            specials = np.array(SPECIALS[width], dtype=u)
            b[idx] = specials[rng.integers(0, len(specials), len(idx))]
            t[idx] = specials[rng.integers(0, len(specials), len(idx))]
        elif pattern == "signed-zeros":  # +0.0 -> -0.0 and back: equal as floats, not as bits
            sign = u(1) << u(8 * width - 1)
            b[idx] = np.where(rng.random(len(idx)) < 0.5, u(0), sign).astype(u)
            t[idx] = b[idx] ^ sign
        else:
            t[idx] ^= _nonzero(rng, len(idx), width)
    return Case(width, pattern, base, t.view(np.uint8))


@st.composite
def cases(draw: st.DrawFn, max_n: int = 3000) -> Case:
    width = draw(st.sampled_from(WIDTHS))
    n = draw(st.one_of(st.just(0), st.integers(1, 40), st.integers(41, max_n)))
    pattern = draw(st.sampled_from(PATTERNS))
    seed = draw(st.integers(0, 2**32 - 1))
    return make_case(seed, width, n, pattern)


def roundtrip(codec: PlanesZstdCodec, target: Bytes, base: Bytes | None, width: int) -> EncodedChunk:
    enc = codec.encode(target, base, width)
    out = PlanesZstdCodec().decode(enc, base, width, len(target))  # decoding needs no parameters
    assert out.dtype == np.uint8
    assert out.tobytes() == target.tobytes()
    return enc


# -- lossless round trips --------------------------------------------------------------------


@PROPERTY
@given(case=cases(), exhaustive=st.booleans(), level=st.sampled_from([1, 3, 9]))
def test_delta_roundtrip_is_bit_exact(case: Case, exhaustive: bool, level: int) -> None:
    codec = PlanesZstdCodec(exhaustive=exhaustive, zstd_level=level, full_zstd_level=level)
    enc = roundtrip(codec, case.target, case.base, case.width)
    identical = case.target.tobytes() == case.base.tobytes()
    assert (enc.encoding == SAME) == identical
    if enc.encoding == SAME:
        assert enc.payload == b""
    assert enc.encoding in ENCODING_NAMES


@PROPERTY
@given(case=cases(), level=st.sampled_from([1, 3, 9]))
def test_full_roundtrip_is_bit_exact(case: Case, level: int) -> None:
    enc = roundtrip(PlanesZstdCodec(full_zstd_level=level), case.target, None, case.width)
    assert enc.encoding == FULL


@pytest.mark.parametrize("width", WIDTHS)
def test_signed_zero_and_nan_payloads_survive(width: int) -> None:
    u = UINT[width]
    specials = np.array(SPECIALS[width], dtype=u)
    base = np.tile(specials, 50)
    target = np.roll(base, 1)  # every element becomes a different special pattern
    for b in (base.view(np.uint8), None):
        for exhaustive in (False, True):
            roundtrip(PlanesZstdCodec(exhaustive=exhaustive), target.view(np.uint8), b, width)
    flipped = base ^ (u(1) << u(8 * width - 1))  # -0.0 <-> +0.0, NaN sign bits
    enc = roundtrip(PlanesZstdCodec(), flipped.view(np.uint8), base.view(np.uint8), width)
    assert enc.encoding != SAME


def test_base_of_another_size_is_ignored() -> None:
    target = np.arange(64, dtype=np.uint8)
    enc = PlanesZstdCodec().encode(target, np.zeros(32, np.uint8), 4)
    assert enc.encoding == FULL
    assert PlanesZstdCodec().decode(enc, None, 4, 64).tobytes() == target.tobytes()


def test_non_contiguous_inputs_encode() -> None:
    rng = np.random.default_rng(1)
    wide = rng.integers(0, 256, 256, dtype=np.uint8)
    target, base = wide[::2], wide[1::2]
    for b in (base, None):
        roundtrip(PlanesZstdCodec(), target, b, 2)


def test_concurrent_encoding_matches_serial() -> None:
    codec = PlanesZstdCodec(exhaustive=True)
    work = [make_case(seed, WIDTHS[seed % 4], 2000, PATTERNS[seed % len(PATTERNS)]) for seed in range(24)]
    serial = [codec.encode(c.target, c.base, c.width) for c in work]
    with ThreadPoolExecutor(max_workers=4) as pool:
        parallel = list(pool.map(lambda c: codec.encode(c.target, c.base, c.width), work))
    assert parallel == serial


@PROPERTY
@given(width=st.sampled_from(WIDTHS), n=st.integers(0, 500), seed=st.integers(0, 2**32 - 1))
def test_planes_inverts(width: int, n: int, seed: int) -> None:
    data = np.random.default_rng(seed).integers(0, 256, n * width, dtype=np.uint8)
    p = planes(data, width)
    assert len(p) == len(data)
    assert unplanes(p, width).tobytes() == data.tobytes()
    if n and width > 1:  # plane 0 holds byte 0 of every element
        assert p[:n] == data[0::width].tobytes()


# -- the choice of encoding -------------------------------------------------------------------


@PROPERTY
@given(case=cases(max_n=2000))
def test_exhaustive_choice_is_never_larger(case: Case) -> None:
    exhaustive = PlanesZstdCodec(exhaustive=True).encode(case.target, case.base, case.width)
    quick = PlanesZstdCodec().encode(case.target, case.base, case.width)
    full = PlanesZstdCodec().encode(case.target, None, case.width)
    identical = case.target.tobytes() == case.base.tobytes()
    assert (exhaustive.encoding == SAME) == identical
    assert (quick.encoding == SAME) == identical
    assert len(exhaustive.payload) <= len(quick.payload)
    assert len(exhaustive.payload) <= len(full.payload)


def _sparse_header(payload: bytes) -> tuple[int, int, int, int, int, int]:
    fields: tuple[int, int, int, int, int, int] = SPARSE_HEADER.unpack_from(payload)
    return fields


def test_few_changes_in_a_large_chunk_are_sparse_and_gap_coded() -> None:
    n = 65536
    rng = np.random.default_rng(7)
    base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    target = base.copy()
    # gaps around the one-byte escape (254, 255, 256) and far beyond it
    idx = np.array([0, 1, 256, 512, 769, 30000, n - 1])
    target[idx] ^= np.uint16(0x0101)
    enc = roundtrip(PlanesZstdCodec(), target.view(np.uint8), base.view(np.uint8), 2)
    assert enc.encoding == SPARSE
    _, coding, _, _, count, _ = _sparse_header(enc.payload)
    assert (coding, count) == (RICE, len(idx))  # gaps, Rice-coded
    assert len(enc.payload) < 200
    exhaustive = roundtrip(PlanesZstdCodec(exhaustive=True), target.view(np.uint8), base.view(np.uint8), 2)
    assert len(exhaustive.payload) <= len(enc.payload)


def test_moderate_density_in_runs_uses_a_bitmap() -> None:
    n = 16384
    rng = np.random.default_rng(8)
    base = rng.integers(0, 1 << 32, n, dtype=np.uint32)
    target = base.copy()
    idx = np.flatnonzero(np.repeat(rng.random(n // 16) < 0.2, 16))  # runs of 16 changed elements
    target[idx] += np.uint32(1)
    enc = roundtrip(PlanesZstdCodec(), target.view(np.uint8), base.view(np.uint8), 4)
    assert enc.encoding == SPARSE
    transform, coding, _, _, count, _ = _sparse_header(enc.payload)
    assert (coding, count) == (BITMAP, len(idx))
    assert transform in (ZIGZAG, ZIGZAG2)  # +1 on random bits: a zigzag of the difference, not XOR


def test_moderate_density_at_random_uses_rice() -> None:
    """Independent positions have geometric gaps, for which Rice codes are near the entropy."""
    n = 16384
    rng = np.random.default_rng(8)
    base = rng.integers(0, 1 << 32, n, dtype=np.uint32)
    target = base.copy()
    idx = np.flatnonzero(rng.random(n) < 0.2)
    target[idx] += np.uint32(1)
    enc = roundtrip(PlanesZstdCodec(), target.view(np.uint8), base.view(np.uint8), 4)
    transform, coding, _, _, count, _ = _sparse_header(enc.payload)
    assert (coding, count) == (RICE, len(idx))
    assert transform in (ZIGZAG, ZIGZAG2)
    positions_floor = n * _binary_entropy(len(idx) / n) / 8
    assert len(enc.payload) < 1.03 * positions_floor + 64  # values are all +1: nearly free


def _binary_entropy(p: float) -> float:
    return float(-(p * np.log2(p) + (1 - p) * np.log2(1 - p)))


def _entropy(values: npt.NDArray[Any]) -> float:
    """Zero-order entropy in bits of the whole array."""
    _, counts = np.unique(values, return_counts=True)
    probs = counts / counts.sum()
    return float(-(counts * np.log2(probs)).sum())


def test_rl_step_delta_is_much_smaller_than_full() -> None:
    """~1% of bf16 elements move by one ulp: the delta must be a small fraction of the raw bytes."""
    n = 1 << 20
    rng = np.random.default_rng(9)
    weights = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32)
    base = (weights >> np.uint32(16)).astype(np.uint16)  # bf16 bit patterns
    target = base.copy()
    idx = np.flatnonzero(rng.random(n) < 0.01)
    target[idx] += np.where(rng.random(len(idx)) < 0.5, np.uint16(1), np.uint16(0xFFFF)).astype(np.uint16)
    codec = PlanesZstdCodec()
    enc = roundtrip(codec, target.view(np.uint8), base.view(np.uint8), 2)
    assert enc.encoding == SPARSE
    assert len(enc.payload) < 0.03 * target.nbytes
    transform, coding, _, _, count, _ = _sparse_header(enc.payload)
    assert (transform, coding, count) == (ZIGZAG2, RICE, len(idx))
    # zero-order entropy of positions and values: the floor no coding of independent symbols beats
    floor = (n * _binary_entropy(len(idx) / n) + _entropy(target[idx] - base[idx])) / 8
    assert len(enc.payload) < 1.025 * floor


def test_rl_step_with_larger_moves_stays_near_the_entropy() -> None:
    """Mostly +-1 ulp with a long tail (the measured shape): the tail goes to the escapes."""
    n = 1 << 20
    rng = np.random.default_rng(12)
    base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    target = base.copy()
    idx = np.flatnonzero(rng.random(n) < 0.01)
    magnitude = np.where(rng.random(len(idx)) < 0.9, 1, np.minimum(rng.pareto(1.0, len(idx)) + 2, 30000))
    step = (np.where(rng.random(len(idx)) < 0.5, 1, -1) * magnitude.astype(np.int64)).astype(np.int16)
    target[idx] += step.view(np.uint16)
    enc = roundtrip(PlanesZstdCodec(), target.view(np.uint8), base.view(np.uint8), 2)
    transform, coding, _, _, _, _ = _sparse_header(enc.payload)
    assert (transform, coding) == (ZIGZAG2, RICE)
    floor = (n * _binary_entropy(len(idx) / n) + _entropy(step)) / 8
    assert len(enc.payload) < 1.04 * floor


def test_everything_changed_at_random_is_stored_full() -> None:
    rng = np.random.default_rng(10)
    base = rng.integers(0, 256, 8192, dtype=np.uint8)
    target = rng.integers(0, 256, 8192, dtype=np.uint8)
    enc = roundtrip(PlanesZstdCodec(), target, base, 4)
    assert enc.encoding in (DENSE, FULL)
    assert len(enc.payload) <= len(PlanesZstdCodec().encode(target, None, 4).payload)


def test_small_changes_everywhere_are_dense() -> None:
    rng = np.random.default_rng(11)
    base = rng.integers(0, 1 << 32, 8192, dtype=np.uint32)
    target = base + np.uint32(1)
    enc = roundtrip(PlanesZstdCodec(), target.view(np.uint8), base.view(np.uint8), 4)
    assert enc.encoding == DENSE
    assert enc.payload[0] == ZIGZAG


# -- chunking ---------------------------------------------------------------------------------


@PROPERTY
@given(
    width=st.sampled_from(WIDTHS),
    elements=st.integers(0, 100_000),
    chunk_bytes=st.integers(8, 1024).map(lambda k: 8 * k),
)
def test_chunk_ranges_cover_the_tensor(width: int, elements: int, chunk_bytes: int) -> None:
    nbytes = elements * width
    ranges = PlanesZstdCodec(chunk_bytes=chunk_bytes).chunk_ranges(nbytes, width)
    pos = 0
    for off, length in ranges:
        assert off == pos
        assert 0 < length <= chunk_bytes
        assert off % width == 0 and length % width == 0
        pos += length
    assert pos == nbytes
    assert all(length == ranges[0][1] for _, length in ranges[:-1])
    assert len(ranges) == -(-nbytes // chunk_bytes)


def test_chunk_ranges_of_nothing() -> None:
    assert PlanesZstdCodec().chunk_ranges(0, 4) == []


# -- corrupt and hostile payloads -------------------------------------------------------------


def _decode_or_corrupt(enc: EncodedChunk, base: Bytes | None, width: int, nbytes: int) -> Bytes | None:
    """Decode; a CorruptObjectError is fine, any other exception fails the test."""
    try:
        out = PlanesZstdCodec().decode(enc, base, width, nbytes)
    except CorruptObjectError:
        return None
    assert out.dtype == np.uint8 and out.shape == (nbytes,)
    return out


@PROPERTY
@given(case=cases(max_n=1500), data=st.data())
def test_damaged_payloads_are_refused_or_decode_to_something(case: Case, data: st.DataObject) -> None:
    enc = PlanesZstdCodec(exhaustive=data.draw(st.booleans())).encode(case.target, case.base, case.width)
    nbytes = len(case.target)
    payload = enc.payload
    if payload:
        cut = data.draw(st.integers(0, len(payload) - 1), label="truncate at")
        with pytest.raises(CorruptObjectError):
            PlanesZstdCodec().decode(EncodedChunk(enc.encoding, payload[:cut]), case.base, case.width, nbytes)
        bit = data.draw(st.integers(0, 8 * len(payload) - 1), label="flip bit")
        flipped = bytearray(payload)
        flipped[bit // 8] ^= 1 << (bit % 8)
        _decode_or_corrupt(EncodedChunk(enc.encoding, bytes(flipped)), case.base, case.width, nbytes)
    extra = data.draw(st.binary(min_size=1, max_size=16), label="appended")
    _decode_or_corrupt(EncodedChunk(enc.encoding, payload + extra), case.base, case.width, nbytes)
    others = [e for e in (SAME, SPARSE, DENSE, FULL, bogus(0), bogus(99)) if e != enc.encoding]
    other = data.draw(st.sampled_from(others))
    wrong = _decode_or_corrupt(EncodedChunk(other, payload), case.base, case.width, nbytes)
    assert wrong is None


def _zstd(data: bytes, *, content_size: bool = True) -> bytes:
    out: bytes = zstandard.ZstdCompressor(write_content_size=content_size).compress(data)
    return out


def _gaps(gaps: list[int]) -> bytes:
    small = bytes(min(g, 255) for g in gaps)
    large = np.array([g - 255 for g in gaps if g >= 255], dtype=np.uint32)
    head = _zstd(small)
    return U64.pack(len(head)) + head + _zstd(planes(large, 4))


def _sparse(count: int, positions: bytes, values: bytes, *, transform: int = XOR, coding: int = GAPS,
            pos_len: int | None = None, pos_param: int | None = None, value_param: int = 0) -> EncodedChunk:
    if pos_param is None:
        pos_param = 1 if coding == GAPS else 0
    header = SPARSE_HEADER.pack(
        transform, coding, pos_param, value_param, count, len(positions) if pos_len is None else pos_len
    )
    return EncodedChunk(SPARSE, header + positions + values)


N, W = 100, 4
VALUES3 = _zstd(bytes(range(1, 13)))  # three 4-byte changes
BASE = np.zeros(N * W, dtype=np.uint8)


def test_handmade_sparse_payload_decodes() -> None:
    """The hostile cases below are built this way; make sure the well-formed one works."""
    out = PlanesZstdCodec().decode(_sparse(3, _gaps([0, 45, 10]), VALUES3), BASE, W, N * W)
    assert np.flatnonzero(out.view(np.uint32)).tolist() == [0, 46, 57]
    mask = np.zeros(N, np.bool_)
    mask[[3, 50, 99]] = True
    bitmap = _zstd(np.packbits(mask, bitorder="little").tobytes())
    out = PlanesZstdCodec().decode(_sparse(3, bitmap, VALUES3, coding=BITMAP), BASE, W, N * W)
    assert np.flatnonzero(out.view(np.uint32)).tolist() == [3, 50, 99]


def _bitmap(indices: list[int], n: int = N) -> bytes:
    mask = np.zeros(n, np.bool_)
    mask[indices] = True
    return _zstd(np.packbits(mask, bitorder="little").tobytes())


def _bitstream(bits: list[int]) -> bytes:
    """LSB-first bits, zero-padded to whole bytes (the documented bit order)."""
    out = bytearray((len(bits) + 7) // 8)
    for i, bit in enumerate(bits):
        out[i // 8] |= bit << (i % 8)
    return bytes(out)


def _rice_parts(indices: list[int], k: int) -> tuple[bytes, bytes]:
    """Position section, Rice coding, written from the documented layout (not the codec):
    the unary stream and the low-bits stream."""
    unary: list[int] = []
    low: list[int] = []
    prev = -1
    for i in indices:
        gap = i - prev - 1
        prev = i
        unary += [0] * (gap >> k) + [1]
        low += [(gap >> j) & 1 for j in range(k)]
    return _bitstream(unary), _bitstream(low)


def _rice(indices: list[int], k: int) -> bytes:
    unary, low = _rice_parts(indices, k)
    return unary + low


def _zz2_raw(symbols: bytes, prefix: bytes, suffix: bytes, *, frame: bytes | None = None) -> bytes:
    frame = _zstd(symbols) if frame is None else frame
    return U32.pack(len(frame)) + frame + U32.pack(len(prefix)) + prefix + suffix


def _zigzag2(zs: list[int], k: int) -> bytes:
    """Value section of the 2-bit zigzag transform, written from the documented layout."""
    symbols = bytearray((len(zs) + 3) // 4)
    prefix: list[int] = []
    suffix: list[int] = []
    for i, z in enumerate(zs):
        symbols[i // 4] |= min(z - 1, 3) << (2 * (i % 4))
        if z >= 4:
            e = z - 4
            x = (e >> k) + 1
            nb = x.bit_length() - 1
            prefix += [0] * nb + [1]
            suffix += [(e >> j) & 1 for j in range(k)] + [((x - (1 << nb)) >> j) & 1 for j in range(nb)]
    return _zz2_raw(bytes(symbols), _bitstream(prefix), _bitstream(suffix))


def _rice_zz2(count: int, positions: bytes, values: bytes, k: int = 0, value_param: int = 0) -> EncodedChunk:
    return _sparse(count, positions, values, transform=ZIGZAG2, coding=RICE, pos_param=k, value_param=value_param)


def test_handmade_rice_and_zigzag2_payload_decodes() -> None:
    # z = zigzag(change): 1 is -1, 2 is +1, 9 is -5 (an escape, e = 5), 200 is +100
    for k, ek in ((0, 0), (2, 1), (5, 3)):
        chunk = _rice_zz2(4, _rice([3, 50, 51, 99], k), _zigzag2([1, 2, 9, 200], ek), k, ek)
        out = PlanesZstdCodec().decode(chunk, BASE, W, N * W).view(np.int32)
        assert np.flatnonzero(out).tolist() == [3, 50, 51, 99]
        assert out[[3, 50, 51, 99]].tolist() == [-1, 1, -5, 100]
    # the widest change an element can take: z = 2**32 - 1, e = 2**32 - 5
    chunk = _rice_zz2(1, _rice([7], 0), _zigzag2([(1 << 32) - 1], 2), 0, 2)
    out = PlanesZstdCodec().decode(chunk, BASE, W, N * W).view(np.uint32)
    assert out[7] == 0x80000000  # zigzag 2**32 - 1 is -2**31


def test_handmade_byte_gaps_with_escapes_decode() -> None:
    base = np.zeros(4000 * W, dtype=np.uint8)
    chunk = _sparse(3, _gaps([0, 300, 3000]), VALUES3)
    out = PlanesZstdCodec().decode(chunk, base, W, len(base))
    assert np.flatnonzero(out.view(np.uint32)).tolist() == [0, 301, 3302]


RICE3 = _rice([3, 50, 99], 2)
RICE3_UNARY, RICE3_LOW = _rice_parts([3, 50, 99], 2)  # 26 unary bits: 6 padding bits in byte 3
ZZ3 = _zigzag2([1, 2, 9], 1)  # one escape
ESC_SYMBOLS = bytes([0 | 1 << 2 | 3 << 4])  # z = 1, 2, escape

HOSTILE_SPARSE: dict[str, EncodedChunk] = {
    "rice parameter too large": _rice_zz2(3, _rice([3, 50, 99], 0), ZZ3, 32, 1),
    "rice stream ends early": _rice_zz2(4, RICE3, _zigzag2([1, 2, 9, 1], 1), 2, 1),
    "rice stream has a trailing byte": _rice_zz2(3, RICE3_UNARY + b"\x00" + RICE3_LOW, ZZ3, 2, 1),
    "rice extra code": _rice_zz2(3, _rice([3, 50, 99, 100], 0), ZZ3, 0, 1),
    "rice padding bit set": _rice_zz2(3, RICE3_UNARY[:3] + bytes([RICE3_UNARY[3] | 0x80]) + RICE3_LOW, ZZ3, 2, 1),
    "rice low padding bit set": _rice_zz2(3, RICE3_UNARY + bytes([RICE3_LOW[0] | 0x80]), ZZ3, 2, 1),
    "rice position past the end": _rice_zz2(3, _rice([3, 50, 100], 2), ZZ3, 2, 1),
    "rice long unary run": _rice_zz2(3, b"\x00" * 100 + _rice([3, 50, 99], 0), ZZ3, 0, 1),
    "rice low bits truncated": _rice_zz2(3, RICE3[:-1], ZZ3, 2, 1),
    "rice empty": _rice_zz2(3, b"", ZZ3, 2, 1),
    "zigzag2 parameter too large": _rice_zz2(3, RICE3, _zigzag2([1, 2, 9], 1), 2, 32),
    "zigzag2 parameter without escapes": _rice_zz2(3, RICE3, _zigzag2([1, 2, 3], 0), 2, 1),
    "zigzag2 symbol frame of wrong size": _rice_zz2(3, RICE3, _zz2_raw(ESC_SYMBOLS + b"\x00", b"\x04", b"\x02"), 2, 0),
    "zigzag2 symbol padding set": _rice_zz2(3, RICE3, _zz2_raw(bytes([ESC_SYMBOLS[0] | 0x40]), b"\x04", b"\x02"), 2, 0),
    "zigzag2 symbol length huge": _rice_zz2(3, RICE3, U32.pack(2**32 - 1) + ZZ3[4:], 2, 1),
    "zigzag2 symbol length truncated": _rice_zz2(3, RICE3, b"\x05\x00", 2, 1),
    "zigzag2 prefix length huge": _rice_zz2(3, RICE3, _zz2_raw(ESC_SYMBOLS, b"", b"")[:-4] + U32.pack(2**32 - 1), 2, 0),
    "zigzag2 escape missing": _rice_zz2(3, RICE3, _zz2_raw(ESC_SYMBOLS, b"", b""), 2, 0),
    "zigzag2 escape suffix missing": _rice_zz2(3, RICE3, _zz2_raw(ESC_SYMBOLS, b"\x04", b""), 2, 0),
    "zigzag2 escape wider than the element": _rice_zz2(3, RICE3, _zigzag2([1, 2, 1 << 32], 0), 2, 0),
    "zigzag2 escape one past the widest": _rice_zz2(3, RICE3, _zigzag2([1, 2, 1 << 32], 3), 2, 3),
    "zigzag2 escape prefix over 63": _rice_zz2(3, RICE3, _zz2_raw(ESC_SYMBOLS, _bitstream([0] * 70 + [1]), bytes(16)), 2, 0),
    "zigzag2 trailing suffix byte": _rice_zz2(3, RICE3, ZZ3 + b"\x00", 2, 1),
    "zigzag2 extra escape code": _rice_zz2(3, RICE3, _zz2_raw(ESC_SYMBOLS, _bitstream([0, 0, 1, 1]), _bitstream([0, 1])), 2, 0),
    "xor with a value parameter": _sparse(3, _gaps([0, 1, 2]), VALUES3, value_param=1),
    "bitmap with a parameter": _sparse(3, _bitmap([3, 50, 99]), VALUES3, coding=BITMAP, pos_param=1),
    "bitmap padding set": _sparse(3, _zstd(np.packbits(np.isin(np.arange(104), [3, 50, 101]), bitorder="little").tobytes()),
                                  VALUES3, coding=BITMAP),
    "gaps with another width": _sparse(3, _gaps([0, 1, 2]), VALUES3, pos_param=2),
    "count zero": _sparse(0, _gaps([]), _zstd(b"")),
    "count past n": _sparse(N + 1, _gaps([0] * (N + 1)), _zstd(bytes(4 * (N + 1)))),
    "count huge": _sparse(2**64 - 1, _gaps([0]), VALUES3),
    "position length huge": _sparse(3, _gaps([0, 1, 2]), VALUES3, pos_len=2**64 - 1),
    "position length past payload": _sparse(3, _gaps([0, 1, 2]), VALUES3, pos_len=10_000),
    "unknown coding": _sparse(3, _gaps([0, 1, 2]), VALUES3, coding=7),
    "unknown transform": _sparse(3, _gaps([0, 1, 2]), VALUES3, transform=9),
    "gaps past the end": _sparse(3, _gaps([0, 50, 60]), VALUES3),
    "escaped gap past the end": _sparse(3, _gaps([0, 1, 4000]), VALUES3),
    "gap count mismatch": _sparse(3, _gaps([0, 1]), VALUES3),
    "escape without its u32": _sparse(
        3, U64.pack(len(_zstd(bytes([0, 255, 1])))) + _zstd(bytes([0, 255, 1])) + _zstd(b""), VALUES3
    ),
    "gap head length huge": _sparse(3, U64.pack(2**64 - 1) + _zstd(bytes(3)), VALUES3),
    "gap section truncated": _sparse(3, b"\x01\x02", VALUES3),
    "bitmap popcount mismatch": _sparse(3, _bitmap([1, 2]), VALUES3, coding=BITMAP),
    "bitmap of wrong size": _sparse(3, _zstd(b"\x07" * 3), VALUES3, coding=BITMAP),
    "bitmap not zstd": _sparse(3, b"garbage-bitmap", VALUES3, coding=BITMAP),
    "values of wrong size": _sparse(3, _gaps([0, 1, 2]), _zstd(bytes(8))),
    "values without content size": _sparse(3, _gaps([0, 1, 2]), _zstd(bytes(12), content_size=False)),
    "values claim a huge size": _sparse(3, _gaps([0, 1, 2]), _zstd(bytes(1 << 20))),
    "values not zstd": _sparse(3, _gaps([0, 1, 2]), b"\x00" * 12),
    "header truncated": EncodedChunk(SPARSE, SPARSE_HEADER.pack(0, 1, 1, 0, 3, 0)[:-1]),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_SPARSE))
def test_hostile_sparse_payloads_are_corrupt(name: str) -> None:
    with pytest.raises(CorruptObjectError):
        PlanesZstdCodec().decode(HOSTILE_SPARSE[name], BASE, W, N * W)
    out = np.full(N * W, 0xA5, dtype=np.uint8)
    with pytest.raises(CorruptObjectError):
        PlanesZstdCodec().decode_into(HOSTILE_SPARSE[name], BASE, out, W)
    assert (out == 0xA5).all()  # a refused payload leaves the output untouched


def test_well_formed_twins_of_the_hostile_cases_decode() -> None:
    """The hostile cases above differ from these in one field; these must decode."""
    twins = [
        _rice_zz2(3, RICE3, ZZ3, 2, 1),
        _rice_zz2(3, _rice([3, 50, 99], 0), ZZ3, 0, 1),
        _rice_zz2(3, RICE3, _zz2_raw(ESC_SYMBOLS, _bitstream([0, 0, 1]), _bitstream([0, 1])), 2, 0),
        _rice_zz2(3, RICE3, _zigzag2([1, 2, (1 << 32) - 1], 3), 2, 3),
    ]
    for chunk in twins:
        out = PlanesZstdCodec().decode(chunk, BASE, W, N * W)
        assert np.flatnonzero(out.view(np.uint32)).tolist() == [3, 50, 99]


@pytest.mark.parametrize(
    ("name", "chunk"),
    [
        ("dense empty", EncodedChunk(DENSE, b"")),
        ("dense unknown transform", EncodedChunk(DENSE, b"\x05" + _zstd(bytes(N * W)))),
        ("dense wrong size", EncodedChunk(DENSE, b"\x00" + _zstd(bytes(N * W - 4)))),
        ("dense bomb", EncodedChunk(DENSE, b"\x00" + _zstd(bytes(64 << 20)))),
        ("full empty", EncodedChunk(FULL, b"")),
        ("full garbage", EncodedChunk(FULL, b"\x28\xb5\x2f\xfd garbage")),
        ("full wrong size", EncodedChunk(FULL, _zstd(bytes(N * W + 4)))),
        ("full without content size", EncodedChunk(FULL, _zstd(bytes(N * W), content_size=False))),
        ("same with payload", EncodedChunk(SAME, b"\x00")),
        ("unknown encoding", EncodedChunk(bogus(42), b"")),
    ],
)
def test_hostile_payloads_are_corrupt(name: str, chunk: EncodedChunk) -> None:
    with pytest.raises(CorruptObjectError):
        PlanesZstdCodec().decode(chunk, BASE, W, N * W)


@pytest.mark.parametrize("encoding", [SAME, SPARSE, DENSE])
def test_delta_encodings_need_a_matching_base(encoding: Encoding) -> None:
    case = make_case(3, 4, 100, "few")
    enc = PlanesZstdCodec().encode(case.target, case.base if encoding != SAME else case.target, 4)
    chunk = EncodedChunk(encoding, enc.payload if enc.encoding == encoding else b"")
    for base in (None, case.base[:-4]):
        with pytest.raises(CorruptObjectError, match="needs a base"):
            PlanesZstdCodec().decode(chunk, base, 4, 400)


def test_decode_size_not_whole_elements_is_corrupt() -> None:
    enc = PlanesZstdCodec().encode(np.zeros(12, np.uint8), None, 4)
    with pytest.raises(CorruptObjectError):
        PlanesZstdCodec().decode(enc, None, 4, 10)


# -- bad arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize("width", [0, 3, 5, 16, -1])
def test_bad_width_is_a_usage_error(width: int) -> None:
    data = np.zeros(48, np.uint8)
    with pytest.raises(UsageError, match="width"):
        PlanesZstdCodec().encode(data, None, width)
    with pytest.raises(UsageError, match="width"):
        PlanesZstdCodec().decode(EncodedChunk(FULL, _zstd(bytes(48))), None, width, 48)
    with pytest.raises(UsageError, match="width"):
        PlanesZstdCodec().chunk_ranges(48, width)


def test_bad_targets_are_usage_errors() -> None:
    codec = PlanesZstdCodec()
    with pytest.raises(UsageError, match="whole"):
        codec.encode(np.zeros(10, np.uint8), None, 4)
    with pytest.raises(UsageError, match="whole"):
        codec.encode(np.zeros(10, np.uint8), np.zeros(10, np.uint8), 8)
    with pytest.raises(UsageError, match="uint8"):
        codec.encode(np.zeros(4, np.uint32), None, 4)
    with pytest.raises(UsageError, match="uint8"):
        codec.encode(np.zeros((4, 4), np.uint8), None, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_bytes": 100},
        {"chunk_bytes": 4100},
        {"chunk_bytes": 56},
        {"chunk_bytes": 0},
        {"chunk_bytes": (1 << 30) + 8},
        {"zstd_level": 0},
        {"zstd_level": 23},
        {"full_zstd_level": 0},
        {"full_zstd_level": 23},
    ],
)
def test_bad_codec_parameters_are_usage_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        PlanesZstdCodec(**kwargs)


def test_codec_from_spec() -> None:
    name, version = PlanesZstdCodec.name, PlanesZstdCodec(max_classes=6, full_coder=False).codec_version
    assert version == 2 and PlanesZstdCodec(full_coder=False).codec_version == 2  # classes are the default
    assert PlanesZstdCodec(max_classes=0, full_coder=False).codec_version == 1
    codec = codec_from_spec(name, version, 5, 4096, 2)
    assert codec == PlanesZstdCodec(zstd_level=5, chunk_bytes=4096, full_zstd_level=2, max_classes=MAX_CLASSES,
                                    full_coder=False)
    # Version 1 manifests: context-free chunks only (a class-coded payload in one is refused).
    assert codec_from_spec(name, 1, 5, 4096, 2) == PlanesZstdCodec(zstd_level=5, chunk_bytes=4096, full_zstd_level=2,
                                                                    max_classes=0, full_coder=False)
    assert PlanesZstdCodec(max_classes=1, full_coder=False).codec_version == 1
    # Version 3: full payloads in planes coded raw, zstd or rANS (the default), classes accepted.
    assert PlanesZstdCodec().codec_version == PlanesZstdCodec(max_classes=6).codec_version == 3
    assert codec_from_spec(name, 3, 5, 4096, 2) == PlanesZstdCodec(zstd_level=5, chunk_bytes=4096, full_zstd_level=2,
                                                                    max_classes=MAX_CLASSES)
    # Manifests from before full_zstd_level was recorded hold 0 (unset): full payloads used zstd_level.
    assert codec_from_spec(name, version, 5, 4096, 0).full_zstd_level == 5
    with pytest.raises(CorruptObjectError, match="unknown codec"):
        codec_from_spec("someone.else", 1, 3, 4096, 1)
    with pytest.raises(CorruptObjectError, match="unknown codec"):
        codec_from_spec(name, 4, 3, 4096, 1)
    with pytest.raises(CorruptObjectError, match="bad codec parameters"):
        codec_from_spec(name, 1, 3, 100, 1)
    with pytest.raises(CorruptObjectError, match="bad codec parameters"):
        codec_from_spec(name, 1, 3, 4096, 30)


# -- decode_into: caller's buffer, in place ---------------------------------------------------


@PROPERTY
@given(case=cases(max_n=2000), exhaustive=st.booleans())
def test_decode_into_matches_decode(case: Case, exhaustive: bool) -> None:
    enc = PlanesZstdCodec(exhaustive=exhaustive).encode(case.target, case.base, case.width)
    codec = PlanesZstdCodec()
    out = np.full(len(case.target), 0x5A, dtype=np.uint8)
    assert codec.decode_into(enc, case.base, out, case.width) is out
    assert out.tobytes() == case.target.tobytes()
    work = case.base.copy()  # in place: out is base
    assert codec.decode_into(enc, work, work, case.width).tobytes() == case.target.tobytes()
    assert work.tobytes() == case.target.tobytes()


def test_decode_into_full_needs_no_base() -> None:
    target = np.arange(400, dtype=np.uint8)
    out = np.zeros(400, dtype=np.uint8)
    PlanesZstdCodec().decode_into(PlanesZstdCodec().encode(target, None, 4), None, out, 4)
    assert out.tobytes() == target.tobytes()


def test_decode_into_refuses_bad_outputs() -> None:
    case = make_case(5, 4, 100, "few")
    enc = PlanesZstdCodec().encode(case.target, case.base, 4)
    codec = PlanesZstdCodec()
    readonly = np.zeros(400, np.uint8)
    readonly.flags.writeable = False
    wide = np.zeros(800, np.uint8)
    for bad in (np.zeros(100, np.uint32), np.zeros((4, 100), np.uint8), wide[::2], readonly):
        with pytest.raises(UsageError, match="out must be"):
            codec.decode_into(enc, case.base, cast(Bytes, bad), 4)
    both = np.concatenate([case.base, np.zeros(4, np.uint8)])
    with pytest.raises(UsageError, match="overlaps"):  # out starts one element into base
        codec.decode_into(enc, both[:400], both[4:], 4)
    with pytest.raises(CorruptObjectError, match="needs a base"):
        codec.decode_into(enc, case.base, np.zeros(404, np.uint8), 4)
    with pytest.raises(CorruptObjectError, match="whole"):
        codec.decode_into(enc, case.base[:398], np.zeros(398, np.uint8), 4)


@pytest.mark.parametrize("encoding", [SAME, SPARSE, DENSE, FULL])
def test_decode_into_leaves_out_alone_on_corrupt_payloads(encoding: Encoding) -> None:
    case = make_case(6, 2, 5000, "dense" if encoding in (DENSE, FULL) else "sparse")
    codec = PlanesZstdCodec(exhaustive=True)
    enc = codec.encode(case.target, case.base, 2)
    payload = enc.payload if enc.encoding == encoding else b"\x01"
    for bad in (payload[:-1], payload + b"\x00", b"\x07" + payload[1:]):
        work = case.base.copy()
        try:
            codec.decode_into(EncodedChunk(encoding, bad), work, work, 2)
        except CorruptObjectError:
            assert work.tobytes() == case.base.tobytes()


# -- kernels: the C extension and its numpy twin ------------------------------------------------


@contextmanager
def kernels(impl: ModuleType) -> Iterator[None]:
    """Run the codec on one implementation of the kernels."""
    saved = codec_module._K
    codec_module._K = cast(Any, impl)
    try:
        yield
    finally:
        codec_module._K = saved


def test_the_c_kernels_are_built_and_used() -> None:
    if os.environ.get("DELTASYNC_NO_KERNELS"):
        assert codec_module.KERNELS == "numpy"
        return
    assert c_kernels is not None, "deltasync.format._kernels was not built: pip install -e . needs a C compiler"
    assert codec_module.KERNELS == "c"


def _same_outcome(calls: list[Any]) -> Any:
    """Call each thunk; all must raise ValueError or all return the same value."""
    results: list[object] = []
    for call in calls:
        try:
            results.append(call())
        except ValueError:
            results.append(ValueError)
    assert all(r == results[0] for r in results), results
    return results[0]


@PROPERTY
@given(case=cases(max_n=4000), limit_fraction=st.sampled_from([0.0, 0.3, 1.0]))
def test_kernels_agree(case: Case, limit_fraction: float) -> None:
    w, n = case.width, case.n
    limit = int(limit_fraction * n)
    scans = [k.scan(case.target, case.base, w, limit) for k in KERNEL_IMPLS]
    assert all(sc == scans[0] for sc in scans)
    count, idx, tv, bv = scans[0]
    assert count == int(np.count_nonzero(case.target.view(UINT[w]) != case.base.view(UINT[w])))
    if idx is None or tv is None or bv is None or count == 0:
        return
    rice = _same_outcome([lambda k=k: k.rice_encode(idx) for k in KERNEL_IMPLS])
    assert _same_outcome([lambda k=k: k.rice_decode(rice[1], count, rice[0], n) for k in KERNEL_IMPLS]) == idx
    packed = _same_outcome([lambda k=k: k.pack2(tv, bv, w) for k in KERNEL_IMPLS])
    values = _same_outcome([lambda k=k: k.unpack2(packed[0], count, packed[1], packed[2], packed[3], w) for k in KERNEL_IMPLS])
    outs = []
    for k in KERNEL_IMPLS:
        out = np.zeros_like(case.base)
        k.scatter(out, case.base, idx, values, w, 1)
        outs.append(out.tobytes())
        work = case.base.copy()
        k.scatter(work, None, idx, values, w, 1)
        outs.append(work.tobytes())
        # apply2: the same changes applied straight from their 2-bit streams
        out = np.zeros_like(case.base)
        k.apply2(out, case.base, idx, packed[0], packed[1], packed[2], packed[3], w)
        outs.append(out.tobytes())
        work = case.base.copy()
        k.apply2(work, None, idx, packed[0], packed[1], packed[2], packed[3], w)
        outs.append(work.tobytes())
    assert outs == [case.target.tobytes()] * len(outs)


@PROPERTY
@given(case=cases(max_n=3000), exhaustive=st.booleans())
def test_payloads_are_the_same_with_either_kernels(case: Case, exhaustive: bool) -> None:
    codec = PlanesZstdCodec(exhaustive=exhaustive)
    payloads = []
    for impl in KERNEL_IMPLS:
        with kernels(impl):
            enc = codec.encode(case.target, case.base, case.width)
            payloads.append(enc)
            assert codec.decode(enc, case.base, case.width, len(case.target)).tobytes() == case.target.tobytes()
    assert all(p == payloads[0] for p in payloads)


def _mutate(data: bytes, draws: st.DataObject) -> bytes:
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


@PROPERTY
@given(case=cases(max_n=1500), data=st.data())
def test_kernels_refuse_the_same_damaged_streams(case: Case, data: st.DataObject) -> None:
    w, n = case.width, case.n
    count, idx, tv, bv = _kernels_py.scan(case.target, case.base, w, n)
    if not count or idx is None or tv is None or bv is None:
        return
    k, rice = _kernels_py.rice_encode(idx)
    bad_rice = _mutate(rice, data)
    bad_k = data.draw(st.sampled_from([k, k, max(0, k - 1), k + 1, 31, 32]))
    _same_outcome([lambda m=m: m.rice_decode(bad_rice, count, bad_k, n) for m in KERNEL_IMPLS])
    symbols, ek, prefix, suffix = _kernels_py.pack2(tv, bv, w)
    streams = [symbols, prefix, suffix]
    which = data.draw(st.integers(0, 2))
    streams[which] = _mutate(streams[which], data)
    bad_ek = data.draw(st.sampled_from([ek, ek, ek + 1, max(0, ek - 1), 8 * w - 1, 8 * w]))
    _same_outcome([lambda m=m: m.unpack2(streams[0], count, bad_ek, streams[1], streams[2], w) for m in KERNEL_IMPLS])

    def apply2(impl: ModuleType) -> bytes:
        work = case.base.copy()
        try:
            impl.apply2(work, None, idx, streams[0], bad_ek, streams[1], streams[2], w)
        except ValueError:
            assert work.tobytes() == case.base.tobytes(), "apply2 wrote out before refusing its streams"
            raise
        return work.tobytes()

    _same_outcome([lambda m=m: apply2(m) for m in KERNEL_IMPLS])


@pytest.mark.parametrize("spread", [0, 1, 3, 7, 12, 20, 25, 26, 31])
@pytest.mark.parametrize("m", [1, 15, 16, 17, 33, 200])
def test_rice_decoders_agree_for_every_parameter(spread: int, m: int) -> None:
    """Gaps of every size (so that rice_encode picks every k, on both sides of the vector path's
    k <= 25), code counts around its 16-code steps; and the last position one past the chunk."""
    rng = np.random.default_rng(1000 * spread + m)
    top = min(1 << (spread + 1), (1 << 32) // (m + 1) - 1)
    idx = np.cumsum(rng.integers(0, top, m, dtype=np.int64) + 1) - 1
    data = idx.astype(np.uint32).tobytes()
    k, rice = _kernels_py.rice_encode(data)
    n = int(idx[-1]) + 1
    assert _same_outcome([lambda impl=impl: impl.rice_decode(rice, m, k, n) for impl in KERNEL_IMPLS]) == data
    assert _same_outcome([lambda impl=impl: impl.rice_decode(rice, m, k, n - 1) for impl in KERNEL_IMPLS]) is ValueError


@pytest.mark.skipif(c_kernels is None or getattr(c_kernels, "simd", "") != "avx512bw", reason="no AVX-512 here")
def test_the_sse2_scan_agrees_with_the_avx512_one() -> None:
    """The scan picks its SIMD at import; run the SSE2 one in a child process and compare."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from deltasync.format import _kernels as k\n"
        "assert k.simd == 'sse2'\n"
        "for w in (1, 2, 4, 8):\n"
        "    rng = np.random.default_rng(w)\n"
        "    b = rng.integers(0, 256, 8 * 1000 + w * 37, dtype=np.uint8)\n"
        "    t = b.copy(); t[rng.random(len(t)) < 0.02] ^= 1\n"
        "    sys.stdout.write(repr(k.scan(t, b, w, len(t))) + '\\n')\n"
    )
    assert c_kernels is not None
    env = dict(os.environ, DELTASYNC_NO_AVX512="1")
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = []
    for w in (1, 2, 4, 8):
        rng = np.random.default_rng(w)
        b = rng.integers(0, 256, 8 * 1000 + w * 37, dtype=np.uint8)
        t = b.copy()
        t[rng.random(len(t)) < 0.02] ^= 1
        expected.append(repr(c_kernels.scan(t, b, w, len(t))))
    assert child.stdout.splitlines() == expected


_ENCODER_CASES = (
    "import numpy as np\n"
    "def cases():\n"
    "    rng = np.random.default_rng(7)\n"
    "    for m in (1, 7, 8, 9, 16, 17, 23, 24, 25, 40, 41, 1000, 20000):\n"
    "        for shape in range(4):\n"
    "            if shape == 0: gaps = rng.geometric(rng.uniform(0.01, 0.9), m) - 1\n"
    "            elif shape == 1: gaps = rng.integers(0, 1 << int(rng.integers(1, 18)), m)\n"
    "            elif shape == 2:\n"
    "                gaps = rng.geometric(0.1, m) - 1\n"
    "                gaps[rng.random(m) < 0.05] += rng.integers(100, 1 << 16)\n"
    "            else: gaps = np.where(rng.random(m) < 0.5, 0, rng.integers(0, 3000, m))\n"
    "            idx = (np.cumsum(gaps + 1) - 1).astype(np.uint32).tobytes()\n"
    "            for w in (1, 2, 4, 8):\n"
    "                u = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[w]\n"
    "                b = rng.integers(0, 1 << min(8 * w, 62), m, dtype=np.uint64).astype(u)\n"
    "                d = rng.integers(1, 1 << int(rng.integers(1, 8 * w)), m, dtype=np.uint64).astype(u)\n"
    "                d[rng.random(m) < 0.5] = 1\n"
    "                t = b + np.where(rng.random(m) < 0.5, d, -d).astype(u)\n"
    "                yield idx, t.tobytes(), b.tobytes(), w\n"
    "def outputs(k):\n"
    "    for idx, t, b, w in cases():\n"
    "        sample = k.scan_sampled(t, b, w, len(t))\n"
    "        values = b[: len(b) // 3 // w * w]\n"
    "        yield repr((k.rice_encode(idx), k.pack2(t, b, w), sample, k.class_thresholds(b, w, values, 6, 128),\n"
    "                    k.class_thresholds_sampled(sample[4], w, values, 6, 128)))\n"
)


@pytest.mark.skipif(c_kernels is None or getattr(c_kernels, "simd", "") != "avx512bw", reason="no AVX-512 here")
def test_the_portable_encoders_agree_with_the_avx512_ones() -> None:
    """rice_encode (unary codes eight at a time, low bits by pext), pack2, scan_sampled and the
    class thresholds pick their paths at import; run the portable ones in a child process and
    compare, on gaps of every shape (long codes that leave the vector path, counts around its
    steps)."""
    import subprocess
    import sys

    code = _ENCODER_CASES + (
        "import sys\n"
        "from deltasync.format import _kernels as k\n"
        "assert k.simd == 'sse2'\n"
        "for line in outputs(k): sys.stdout.write(line + '\\n')\n"
    )
    # the child imports this very build (the tests run in a temporary working directory)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(codec_module.__file__))))
    env = dict(os.environ, DELTASYNC_NO_AVX512="1", PYTHONPATH=root)
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    namespace: dict[str, Any] = {}
    exec(_ENCODER_CASES, namespace)
    expected = list(namespace["outputs"](c_kernels))
    assert len(expected) == 13 * 4 * 4
    assert child.stdout.splitlines() == expected
    assert list(namespace["outputs"](_kernels_py)) == expected


def _expg_bits(es: list[int], k: int) -> int:
    return sum(2 * (((e >> k) + 1).bit_length() - 1) + 1 + k for e in es)


@pytest.mark.parametrize("width", WIDTHS)
def test_escape_order_is_the_cheapest(width: int) -> None:
    """pack2's exp-Golomb order against a brute force over every order, on escapes with all-ones
    and power-of-two patterns (where bit_length((e >> k) + 1) jumps) and the widest values."""
    rng = np.random.default_rng(width)
    top = (1 << (8 * width)) - 5  # the widest escape: z = 2**(8 * width) - 1
    pool = [0, 1, 2, 3, 7, 8, 15, 16, top, top - 1, top // 2, (top + 5) // 2 - 1]
    pool += [(1 << j) - 1 for j in range(1, 8 * width)] + [1 << j for j in range(8 * width - 1)]
    for trial in range(40):
        size = int(rng.integers(1, 60))
        if trial % 2:
            raw = rng.integers(0, 1 << min(62, 8 * width), size, dtype=np.int64) >> int(rng.integers(0, 8 * width))
            es = [min(top, int(x)) for x in raw]
        else:
            es = [pool[int(i)] for i in rng.integers(0, len(pool), size)]
        zs = np.array([e + 4 for e in es], dtype=np.uint64).astype(UINT[width])
        tv = _kernels_py.unzigzag(zs).tobytes()  # base 0: the change is the target itself
        bv = bytes(len(tv))
        costs = [_expg_bits(es, k) for k in range(8 * width)]
        best = costs.index(min(costs))
        for impl in KERNEL_IMPLS:
            _, k, _, _ = impl.pack2(tv, bv, width)
            assert costs[k] == costs[best] and k == best, (impl.__name__, es, k, best)


# -- codec version 2: positions in magnitude classes of the base --------------------------------


def _weights_step(rng: np.random.Generator, n: int, changed: float, width: int = 2) -> tuple[Bytes, Bytes]:
    """bf16 (or fp32) weights of mixed magnitudes and a step that changes small ones more often, as
    an AdamW step of a bf16 cast does (the chance of a change grows as the ulp shrinks)."""
    w32 = (rng.normal(0, 1, n) * np.exp(rng.normal(-4, 1.5, n))).astype(np.float32)
    step = w32 + rng.normal(0, changed * 1e-5, n).astype(np.float32)
    if width == 2:
        base = (w32.view(np.uint32) >> 16).astype(np.uint16)
        target = (step.view(np.uint32) >> 16).astype(np.uint16)
    else:
        keep = np.uint32(0xFFFF)  # the low bits stay: changes as coarse as a bf16 cast's
        base, target = w32.view(np.uint32), (step.view(np.uint32) & ~keep) | (w32.view(np.uint32) & keep)
    return target.view(np.uint8).copy(), base.view(np.uint8).copy()


def test_magnitude_classes_code_positions_of_weight_like_changes() -> None:
    rng = np.random.default_rng(3)
    for width in (2, 4):
        target, base = _weights_step(rng, 200_000, 0.5, width)
        v2, v1 = PlanesZstdCodec(max_classes=6), PlanesZstdCodec(max_classes=0)
        enc2, enc1 = v2.encode(target, base, width), v1.encode(target, base, width)
        assert enc2.encoding == enc1.encoding == SPARSE
        assert _sparse_header(enc2.payload)[1] == 3, "magnitude classes chosen"
        assert _sparse_header(enc1.payload)[1] != 3
        assert len(enc2.payload) < 0.9 * len(enc1.payload)
        for impl in KERNEL_IMPLS:
            with kernels(impl):
                assert v2.encode(target, base, width) == enc2  # both kernels write the same bytes
                assert v2.decode(enc2, base, width, len(base)).tobytes() == target.tobytes()
                out = base.copy()
                v2.decode_into(enc2, out, out, width)  # in place
                assert out.tobytes() == target.tobytes()
        # version 1 payloads still decode with a version 2 codec; a version 1 codec refuses classes
        assert v2.decode(enc1, base, width, len(base)).tobytes() == target.tobytes()
        with pytest.raises(CorruptObjectError, match="codec version 1"):
            PlanesZstdCodec(max_classes=0, full_coder=False).decode(enc2, base, width, len(base))
        assert v1.decode(enc2, base, width, len(base)).tobytes() == target.tobytes()  # version 3 reads classes
        # against another base the classes differ: refused or caught by the chunk digest, never silent
        other = base.copy()
        other[::7] ^= 0x40
        try:
            wrong = v2.decode(enc2, other, width, len(base))
        except CorruptObjectError:
            pass
        else:
            assert wrong.tobytes() != target.tobytes()
        with pytest.raises(UsageError, match="does not determine"):
            decode_reverse(v2, enc2, target, width)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5000), changed=st.floats(0.01, 5.0),
       max_classes=st.integers(0, MAX_CLASSES), exhaustive=st.booleans())
def test_magnitude_classes_round_trip(seed: int, n: int, changed: float, max_classes: int, exhaustive: bool) -> None:
    target, base = _weights_step(np.random.default_rng(seed), n, changed)
    codec = PlanesZstdCodec(max_classes=max_classes, exhaustive=exhaustive)
    encs = []
    for impl in KERNEL_IMPLS:
        with kernels(impl):
            enc = codec.encode(target, base, 2)
            encs.append(enc)
            assert codec.decode(enc, base, 2, len(base)).tobytes() == target.tobytes()
    assert all(e == encs[0] for e in encs)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_corrupt_class_payloads_are_refused_or_decode_to_other_bytes(seed: int, data: st.DataObject) -> None:
    target, base = _weights_step(np.random.default_rng(seed), 4000, 2.0)
    codec = PlanesZstdCodec(max_classes=6)
    enc = codec.encode(target, base, 2)
    bad = EncodedChunk(enc.encoding, _mutate(enc.payload, data))
    results: list[bytes | None] = []
    for impl in KERNEL_IMPLS:
        with kernels(impl):
            try:
                results.append(codec.decode(bad, base, 2, len(base)).tobytes())
            except CorruptObjectError:
                results.append(None)
    assert results[0] == results[-1]  # both kernels refuse the same inputs


@pytest.mark.parametrize("kind", ["dense", "full", "bitmap"])
def test_a_zstd_section_with_trailing_bytes_is_refused(kind: str) -> None:
    # Decoding accepts exactly what encoding writes: one zstd frame per section, nothing after it.
    rng = np.random.default_rng(4)
    base = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    target = base.copy()
    if kind == "dense":
        codec = PlanesZstdCodec(max_classes=0, full_coder=False)
        target[::2] ^= 1
        enc = codec.encode(target, base, 2)
        assert enc.encoding == DENSE
        bad = EncodedChunk(DENSE, enc.payload + b"\x00")
    elif kind == "full":
        codec = PlanesZstdCodec(full_coder=False)
        enc = codec.encode(target, None, 2)
        bad = EncodedChunk(FULL, enc.payload + zstandard.ZstdCompressor().compress(b"x"))  # a second frame
    else:
        codec = PlanesZstdCodec(max_classes=0, full_coder=False)
        target.view(np.uint16)[: len(target) // 10] ^= 1  # a run of 20% of the elements: a bitmap wins
        enc = codec.encode(target, base, 2)
        assert enc.encoding == SPARSE and _sparse_header(enc.payload)[1] == BITMAP
        head = SPARSE_HEADER.unpack_from(enc.payload)
        pos_len = head[5]
        body = enc.payload[SPARSE_HEADER.size :]
        grown = SPARSE_HEADER.pack(*head[:5], pos_len + 1) + body[:pos_len] + b"\x00" + body[pos_len:]
        bad = EncodedChunk(SPARSE, grown)
    assert np.array_equal(codec.decode(enc, base, 2, len(base)), target)
    out = base.copy()
    with pytest.raises(CorruptObjectError):
        codec.decode_into(bad, base, out, 2)
    assert np.array_equal(out, base)


def test_changed_within_gives_the_changes_up_to_a_limit_and_none_past_it() -> None:
    """``changed_within`` (the engines' diff): the bit differences and the target's bytes there
    while at most ``limit`` elements differ, None past it, for every width."""
    from deltasync.format.codec import changed_within

    g = np.random.default_rng(12)
    for width, dt in ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64)):
        base = g.integers(0, 1 << (8 * width - 1), size=4000, dtype=np.uint64).astype(dt)
        target = base.copy()
        at = np.sort(g.choice(len(base), size=40, replace=False))
        target[at] = np.bitwise_xor(target[at], np.ones(len(at), dtype=dt))
        found = changed_within(target.view(np.uint8), base.view(np.uint8), width, 40)
        assert found is not None
        idx, tv = found
        assert idx.dtype == np.int64 and idx.tolist() == at.tolist()
        assert tv.view(dt).tolist() == target[at].tolist()
        assert changed_within(target.view(np.uint8), base.view(np.uint8), width, 39) is None
        same = changed_within(base.view(np.uint8), base.copy().view(np.uint8), width, 0)
        assert same is not None and [len(x) for x in same] == [0, 0]
    with pytest.raises(UsageError):
        changed_within(np.zeros(8, dtype=np.uint8), np.zeros(4, dtype=np.uint8), 2, 4)


def test_changed_elements_are_the_bit_differences_with_both_values() -> None:
    """``changed_elements``: the positions whose bit patterns differ (a signed zero and a NaN
    payload count, equal NaNs do not), and each side's bytes there, for every width."""
    from deltasync.format.codec import changed_elements

    g = np.random.default_rng(11)
    for width, dt in ((1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64)):
        base = g.integers(0, 1 << (8 * width - 1), size=5000, dtype=np.uint64).astype(dt)
        target = base.copy()
        at = np.sort(g.choice(len(base), size=61, replace=False))
        target[at] = np.bitwise_xor(target[at], np.ones(len(at), dtype=dt))
        idx, tv, bv = changed_elements(target.view(np.uint8), base.view(np.uint8), width)
        assert idx.dtype == np.int64 and idx.tolist() == at.tolist()
        assert tv.view(dt).tolist() == target[at].tolist() and bv.view(dt).tolist() == base[at].tolist()
        none = changed_elements(base.view(np.uint8), base.copy().view(np.uint8), width)
        assert [len(x) for x in none] == [0, 0, 0]
    f = np.array([0.0, np.nan, 1.0], dtype=np.float32)
    h = np.array([-0.0, np.nan, 1.0], dtype=np.float32)
    assert changed_elements(h.view(np.uint8), f.view(np.uint8), 4)[0].tolist() == [0]
    with pytest.raises(UsageError):
        changed_elements(np.zeros(6, dtype=np.uint8), np.zeros(6, dtype=np.uint8), 4)
    with pytest.raises(UsageError):
        changed_elements(np.zeros(8, dtype=np.uint8), np.zeros(4, dtype=np.uint8), 2)

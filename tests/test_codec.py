"""The chunk codec: lossless round trips, the choice of encoding, chunking, hostile payloads."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltasync.codec import (
    DENSE,
    ENCODING_NAMES,
    FULL,
    SAME,
    SPARSE,
    EncodedChunk,
    Encoding,
    PlanesZstdCodec,
    codec_from_spec,
    planes,
    unplanes,
)
from deltasync.errors import CorruptObjectError, UsageError

Bytes = npt.NDArray[np.uint8]

WIDTHS = (1, 2, 4, 8)
UINT: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

# Payload layouts, as documented in deltasync/codec.py (codec_version 1).
SPARSE_HEADER = struct.Struct("<BBBBQQ")
U64 = struct.Struct("<Q")
XOR, ZIGZAG = 0, 1
BITMAP, GAPS = 0, 1

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
    assert (coding, count) == (GAPS, len(idx))
    assert len(enc.payload) < 200


def test_moderate_density_uses_a_bitmap() -> None:
    n = 16384
    rng = np.random.default_rng(8)
    base = rng.integers(0, 1 << 32, n, dtype=np.uint32)
    target = base.copy()
    idx = np.flatnonzero(rng.random(n) < 0.2)
    target[idx] += np.uint32(1)
    enc = roundtrip(PlanesZstdCodec(), target.view(np.uint8), base.view(np.uint8), 4)
    assert enc.encoding == SPARSE
    transform, coding, _, _, count, _ = _sparse_header(enc.payload)
    assert (transform, coding, count) == (ZIGZAG, BITMAP, len(idx))


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
            pos_len: int | None = None) -> EncodedChunk:
    header = SPARSE_HEADER.pack(transform, coding, 1, 0, count, len(positions) if pos_len is None else pos_len)
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


HOSTILE_SPARSE: dict[str, EncodedChunk] = {
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
    name, version = PlanesZstdCodec.name, PlanesZstdCodec.codec_version
    codec = codec_from_spec(name, version, 5, 4096, 2)
    assert codec == PlanesZstdCodec(zstd_level=5, chunk_bytes=4096, full_zstd_level=2)
    # Manifests from before full_zstd_level was recorded hold 0 (unset): full payloads used zstd_level.
    assert codec_from_spec(name, version, 5, 4096, 0).full_zstd_level == 5
    with pytest.raises(CorruptObjectError, match="unknown codec"):
        codec_from_spec("someone.else", 1, 3, 4096, 1)
    with pytest.raises(CorruptObjectError, match="unknown codec"):
        codec_from_spec(name, 2, 3, 4096, 1)
    with pytest.raises(CorruptObjectError, match="bad codec parameters"):
        codec_from_spec(name, 1, 3, 100, 1)
    with pytest.raises(CorruptObjectError, match="bad codec parameters"):
        codec_from_spec(name, 1, 3, 4096, 30)

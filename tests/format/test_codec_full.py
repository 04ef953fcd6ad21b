"""Full payloads of codec version 3: byte planes (rotated one bit where that helps), each raw,
zstd- or rANS-coded; the C coder (deltasync.format._entropy) against its numpy twin; old layouts."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterator
from types import ModuleType

import numpy as np
import numpy.typing as npt
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings, strategies as st

from deltasync import CorruptObjectError, PlanesZstdCodec, Publisher, PublisherConfig, Repository, Subscriber
from deltasync.format import _entropy_py, codec as codec_mod
from deltasync.format.codec import CODEC_VERSIONS, FULL, EncodedChunk, codec_from_spec

Bytes = npt.NDArray[np.uint8]

WIDTHS = (1, 2, 4, 8)
UINT: dict[int, type[np.unsignedinteger]] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
PLANE_HEADER = struct.Struct("<BI")  # as documented in deltasync/format/codec.py
RAW, ZSTD, RANS = 0, 1, 2
PLANES, ROTATED = 0, 1
SCALE, LANES = 4096, 32

c_entropy: ModuleType | None
try:
    from deltasync.format import _entropy as c_entropy
except ImportError:  # pragma: no cover - the extension is built by every normal install
    c_entropy = None
IMPLS: list[ModuleType] = [_entropy_py] + ([c_entropy] if c_entropy is not None else [])
needs_c = pytest.mark.skipif(c_entropy is None, reason="the deltasync.format._entropy extension is not built")

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Bit patterns a float codec gets wrong when it compares values: signed zeros, infinities,
# NaNs with payloads, subnormals.
SPECIALS: dict[int, list[int]] = {
    1: [0x00, 0x80, 0x7F, 0xFF, 0x7C, 0xFC, 0x01, 0x81],
    2: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC1, 0x0001, 0x8001, 0x7C00, 0x7E01],
    4: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC12345, 0x00000001],
    8: [0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000, 0x7FF0000000000001,
        0xFFF8DEADBEEF0000, 1],
}
KINDS = ("random", "constant", "specials", "all256", "skewed", "outliers", "repeats")


@pytest.fixture(params=[m.__name__.rsplit(".", 1)[1] for m in IMPLS])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The codec's full-payload coder: the numpy twin, then the C extension (where built)."""
    module = next(m for m in IMPLS if m.__name__.endswith(request.param))
    monkeypatch.setattr(codec_mod, "_E", module)
    yield module


def weights(rng: np.random.Generator, width: int, n: int) -> Bytes:
    """Trained-weight-like bit patterns: bf16 (width 2), fp32, fp64; fp8 as bf16's high byte."""
    w = (rng.normal(0, 1, n) * np.exp(rng.normal(-4, 1, n))).astype(np.float32)
    if width == 4:
        return w.view(np.uint8)
    if width == 8:
        return w.astype(np.float64).view(np.uint8)
    bf16 = (torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    if width == 2:
        return bf16.view(np.uint8)
    return (bf16 >> 8).astype(np.uint8)


def make(kind: str, width: int, n: int, seed: int = 0) -> Bytes:
    rng = np.random.default_rng(seed)
    u = UINT[width]
    if kind == "random":
        return rng.integers(0, 256, n * width, dtype=np.uint8)
    if kind == "constant":
        return np.full(n, 0x3F80 & int(np.iinfo(u).max), dtype=u).view(np.uint8)
    if kind == "specials":
        return np.array(SPECIALS[width], dtype=u)[rng.integers(0, len(SPECIALS[width]), n)].view(np.uint8)
    if kind == "all256":  # every byte value in every plane, whichever way it is cut
        cols = [np.resize(rng.permutation(256), n) for _ in range(width)]
        return np.stack(cols, axis=1).astype(np.uint8).reshape(-1)
    if kind == "skewed":
        return weights(rng, width, n)
    if kind == "outliers":  # one value almost everywhere, many rare ones: the table's 1/4096 floor
        v = np.zeros(n, dtype=u)
        hit = rng.random(n) < 0.01
        v[hit] = rng.integers(0, 256, int(hit.sum()), dtype=np.uint8).astype(u) * u(0x0101010101010101 & int(np.iinfo(u).max))
        return v.view(np.uint8)
    assert kind == "repeats"  # a block over and over: zstd sees it, an order-0 coder does not
    block = rng.integers(0, 256, 777 * width, dtype=np.uint8)
    return np.resize(block, n * width)


def parse(payload: bytes, width: int) -> tuple[int, list[tuple[int, bytes]]]:
    """(method, [(plane coding, section)]) of a version 3 full payload, per the documented layout."""
    at, planes = 1, []
    for _ in range(width):
        coding, length = PLANE_HEADER.unpack_from(payload, at)
        planes.append((coding, payload[at + PLANE_HEADER.size : at + PLANE_HEADER.size + length]))
        at += PLANE_HEADER.size + length
    assert at == len(payload)
    return payload[0], planes


def build(method: int, planes: list[tuple[int, bytes]]) -> bytes:
    return bytes([method]) + b"".join(PLANE_HEADER.pack(c, len(s)) + s for c, s in planes)


def reference_rans_decode(section: bytes, n: int) -> bytes:
    """rANS plane decoding written from codec.py's docstring alone, one symbol at a time."""
    present = [s for s in range(256) if section[s // 8] >> (s % 8) & 1]
    freqs = struct.unpack_from(f"<{len(present)}H", section, 32)
    assert sum(freqs) == SCALE
    cum, starts = 0, {}
    for s, f in zip(present, freqs, strict=True):
        starts[s] = (cum, f)
        cum += f
    at = 32 + 2 * len(present)
    x = list(struct.unpack_from(f"<{LANES}I", section, at))
    at += 4 * LANES
    out = bytearray()
    for i in range(n):
        v = x[i % LANES]
        slot = v % SCALE
        s = next(s for s, (c, f) in starts.items() if c <= slot < c + f)
        c, f = starts[s]
        v = f * (v >> 12) + slot - c
        if v < 1 << 16:
            v = v << 16 | struct.unpack_from("<H", section, at)[0]
            at += 2
        x[i % LANES] = v
        out.append(s)
    assert at == len(section) and all(v == 1 << 16 for v in x)
    return bytes(out)


def roundtrip(target: Bytes, width: int, codec: PlanesZstdCodec | None = None) -> EncodedChunk:
    codec = codec or PlanesZstdCodec()
    enc = codec.encode(target, None, width)
    assert enc.encoding == FULL
    assert len(enc.payload) <= codec.max_payload(len(target))
    out = np.full(len(target), 0x5A, dtype=np.uint8)
    assert codec.decode_into(enc, None, out, width) is out
    assert out.tobytes() == target.tobytes()
    return enc


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 33, 1000, 20_000])
def test_round_trip(impl: ModuleType, width: int, kind: str, n: int) -> None:
    enc = roundtrip(make(kind, width, n), width)
    method, planes = parse(enc.payload, width)
    assert method in ((PLANES,) if width == 1 else (PLANES, ROTATED))
    for coding, section in planes:
        if coding == RANS:
            assert len(section) >= 32 + 2 + 4 * LANES


def test_empty_chunk_round_trips(impl: ModuleType) -> None:
    for width in WIDTHS:
        enc = roundtrip(np.zeros(0, np.uint8), width)
        assert parse(enc.payload, width) == (PLANES, [(RAW, b"")] * width)


def test_payload_follows_the_documented_layout(impl: ModuleType) -> None:
    """The codings chosen where one clearly wins, and rANS sections decode by the docstring."""
    n = 20_000
    _, planes = parse(roundtrip(make("random", 4, n), 4).payload, 4)
    assert [c for c, _ in planes] == [RAW] * 4  # nothing to save: stored
    _, planes = parse(roundtrip(make("repeats", 2, n), 2).payload, 2)
    assert [c for c, _ in planes] == [ZSTD] * 2  # repeats only zstd sees
    target = make("skewed", 2, n)
    method, planes = parse(roundtrip(target, 2).payload, 2)
    assert method == ROTATED  # bf16: the exponent alone in the top plane
    assert planes[1][0] == RANS and planes[0][0] == RAW  # flat sign + mantissa: raw
    u = target.view(np.uint16)
    assert reference_rans_decode(planes[1][1], n) == (((u << 1) | (u >> 15)) >> 8).astype(np.uint8).tobytes()


def test_signed_zeros_and_nan_payloads_survive(impl: ModuleType) -> None:
    for width in WIDTHS:
        target = make("specials", width, 5000, seed=width)
        assert len(np.unique(target.view(UINT[width]))) == len(SPECIALS[width])
        roundtrip(target, width)


def test_bf16_weights_are_smaller_than_zstd_planes() -> None:
    w = np.random.default_rng(2).normal(0, 0.02, 1 << 20).astype(np.float32)
    target = torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    old = len(PlanesZstdCodec(full_coder=False).encode(target, None, 2).payload)
    new = len(roundtrip(target, 2).payload)
    assert new <= 0.97 * old


@PROPERTY
@given(data=st.binary(max_size=3000), width=st.sampled_from(WIDTHS), level=st.integers(1, 5))
def test_any_bytes_round_trip(data: bytes, width: int, level: int) -> None:
    target = np.frombuffer(data[: len(data) - len(data) % width], dtype=np.uint8)
    roundtrip(target, width, PlanesZstdCodec(full_zstd_level=level))


# -- the C coder and its numpy twin --------------------------------------------------------------


def _freqs(plane: bytes) -> bytes:
    counts = np.bincount(np.frombuffer(plane, dtype=np.uint8), minlength=256).astype(np.uint64)
    return codec_mod._rans_freqs(counts).astype("<u4").tobytes()


@needs_c
@PROPERTY
@given(data=st.binary(max_size=2000), width=st.sampled_from(WIDTHS), rotate=st.booleans(),
       skew=st.integers(0, 3))
def test_c_and_numpy_are_byte_identical(data: bytes, width: int, rotate: bool, skew: int) -> None:
    assert c_entropy is not None
    raw = np.frombuffer(data[: len(data) - len(data) % width], dtype=np.uint8)
    raw = np.right_shift(raw, np.uint8(skew), dtype=np.uint8)  # fewer, more skewed byte values
    split = c_entropy.split(raw, width, rotate)
    assert split == _entropy_py.split(raw, width, rotate)
    assert c_entropy.counts(raw, width, rotate) == _entropy_py.counts(raw, width, rotate) == split[1]
    for m in IMPLS:
        out = np.zeros(len(raw), np.uint8)
        m.join(split[0], out, width, rotate)
        assert out.tobytes() == raw.tobytes()
    plane = raw.tobytes()
    if plane:
        freqs = _freqs(plane)
        stream = c_entropy.rans_encode(plane, freqs)
        assert stream == _entropy_py.rans_encode(plane, freqs)
        assert c_entropy.rans_decode(stream, freqs, len(plane)) == plane
        assert _entropy_py.rans_decode(stream, freqs, len(plane)) == plane


@needs_c
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_c_and_numpy_payloads_are_byte_identical(width: int, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    target = make(kind, width, 30_000, seed=3)
    payloads = []
    for m in IMPLS:
        monkeypatch.setattr(codec_mod, "_E", m)
        payloads.append(roundtrip(target, width).payload)
    assert payloads[0] == payloads[1]
    for m in IMPLS:  # each decodes what the other wrote
        monkeypatch.setattr(codec_mod, "_E", m)
        assert PlanesZstdCodec().decode(EncodedChunk(FULL, payloads[0]), None, width, len(target)).tobytes() == \
            target.tobytes()


def _outcome(fn: Callable[[], bytes]) -> bytes | str:
    try:
        return fn()
    except ValueError:
        return "refused"


@needs_c
@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), cut=st.integers(0, 40), flip=st.integers(0, 1 << 20), n_delta=st.integers(-2, 2))
def test_c_and_numpy_refuse_the_same_streams(seed: int, cut: int, flip: int, n_delta: int) -> None:
    assert c_entropy is not None
    rng = np.random.default_rng(seed)
    plane = make("skewed", 1, int(rng.integers(1, 400)), seed=seed % 1000).tobytes()
    freqs = _freqs(plane)
    stream = bytearray(c_entropy.rans_encode(plane, freqs))
    stream[flip % len(stream)] ^= 1 << (flip >> 17 & 7)
    bad = bytes(stream[: max(0, len(stream) - cut)])
    n = max(0, len(plane) + n_delta)
    results = [_outcome(lambda m=m: m.rans_decode(bad, freqs, n)) for m in (c_entropy, _entropy_py)]  # type: ignore[misc]
    assert results[0] == results[1]


@pytest.mark.parametrize("m", IMPLS, ids=lambda m: m.__name__)
def test_coder_refuses_bad_arguments(m: ModuleType) -> None:
    plane = b"\x01\x02\x02"
    good = _freqs(plane)
    for bad in (good[:-4], b"\x00" * 1024, np.full(256, 16, "<u4").tobytes()[:-4] + struct.pack("<I", 17)):
        with pytest.raises(ValueError):
            m.rans_encode(plane, bad)
        with pytest.raises(ValueError):
            m.rans_decode(m.rans_encode(plane, good), bad, 3)
    with pytest.raises(ValueError):  # a byte without a frequency cannot be coded
        m.rans_encode(b"\x03", good)
    with pytest.raises(ValueError):
        m.rans_decode(m.rans_encode(plane, good), good, -1)
    with pytest.raises(ValueError):
        m.split(b"\x00" * 3, 2, False)
    with pytest.raises(ValueError):
        m.split(b"\x00" * 4, 3, False)
    with pytest.raises(ValueError):
        m.join(b"\x00" * 4, np.zeros(2, np.uint8), 2, False)


# -- older layouts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
def test_version_1_and_2_full_payloads_still_decode(version: int) -> None:
    target = make("skewed", 2, 5000)
    codec = codec_from_spec(PlanesZstdCodec.name, version, 3, 4 << 20, 1)
    assert not codec.full_coder
    # zstd(planes(target)), as versions 1 and 2 wrote it
    old = zstandard.ZstdCompressor(level=1).compress(target.reshape(-1, 2).T.tobytes())
    assert codec.decode(EncodedChunk(FULL, old), None, 2, len(target)).tobytes() == target.tobytes()
    assert PlanesZstdCodec(full_coder=False).encode(target, None, 2).payload == old
    with pytest.raises(CorruptObjectError):  # a version 3 reader takes it for a method byte 0x28
        PlanesZstdCodec().decode(EncodedChunk(FULL, old), None, 2, len(target))


def test_codec_version_3() -> None:
    assert 3 in CODEC_VERSIONS
    assert PlanesZstdCodec().codec_version == 3
    assert PlanesZstdCodec(max_classes=6).codec_version == 3
    assert PlanesZstdCodec(max_classes=0, full_coder=False).codec_version == 1
    assert PlanesZstdCodec(max_classes=6, full_coder=False).codec_version == 2
    codec = codec_from_spec(PlanesZstdCodec.name, 3, 3, 4 << 20, 1)
    assert codec.full_coder and codec.max_classes >= 2  # decodes magnitude-class chunks too
    assert codec.codec_version == 3


# -- corrupt payloads ---------------------------------------------------------------------------


def _refused(payload: bytes, width: int, nbytes: int) -> bool:
    """Whether decoding is refused (CorruptObjectError), checking that a refusal leaves the
    output as it was and that an accepted payload fills it."""
    out = np.full(nbytes, 0xA5, dtype=np.uint8)
    try:
        PlanesZstdCodec().decode_into(EncodedChunk(FULL, payload), None, out, width)
    except CorruptObjectError:
        assert (out == 0xA5).all()
        return True
    return False


def _rans_payload(n: int = 5000) -> tuple[Bytes, bytes]:
    """A bf16 chunk whose exponent plane is rANS-coded, and its payload."""
    target = make("skewed", 2, n, seed=5)
    payload = PlanesZstdCodec().encode(target, None, 2).payload
    assert [c for c, _ in parse(payload, 2)[1]] == [RAW, RANS]
    return target, payload


def test_truncated_payloads_are_corrupt(impl: ModuleType) -> None:
    for width, kind in ((2, "skewed"), (4, "repeats"), (1, "skewed")):
        target = make(kind, width, 700)
        payload = PlanesZstdCodec().encode(target, None, width).payload
        for cut in range(len(payload)):
            assert _refused(payload[:cut], width, len(target)), cut
        assert _refused(payload + b"\x00", width, len(target))


def test_bit_flips_are_corrupt_or_harmless(impl: ModuleType) -> None:
    """Flipped header bits are refused (but the method's low bit, which only unrotates); in a
    rANS section nearly every flip ends the decoder in states other than 2^16. No payload is
    a checksum: what slips through decodes to other bits, which the chunk digest refuses."""
    target, payload = _rans_payload()
    start = len(payload) - len(parse(payload, 2)[1][1][1])  # the rANS section
    headers = [*range(0, 1 + PLANE_HEADER.size), *range(start - PLANE_HEADER.size, start)]
    for at in headers:
        for bit in range(8):
            bad = bytearray(payload)
            bad[at] ^= 1 << bit
            assert _refused(bytes(bad), 2, len(target)) or (at, bit) == (0, 0)
    flips = [(at, bit) for at in range(start, len(payload), 3) for bit in (0, 6)]
    caught = 0
    for at, bit in flips:
        bad = bytearray(payload)
        bad[at] ^= 1 << bit
        caught += _refused(bytes(bad), 2, len(target))
    assert caught >= 0.95 * len(flips)


def test_bad_headers_and_tables_are_corrupt(impl: ModuleType) -> None:
    target, payload = _rans_payload()
    nbytes = len(target)
    method, planes = parse(payload, 2)
    (raw_c, raw_s), (_, section) = planes
    k = bin(int.from_bytes(section[:32], "little")).count("1")
    table, stream = section[32 : 32 + 2 * k], section[32 + 2 * k :]
    freqs = list(struct.unpack(f"<{k}H", table))

    def with_section(s: bytes) -> bytes:
        return build(method, [(raw_c, raw_s), (RANS, s)])

    def table_of(fs: list[int]) -> bytes:
        return struct.pack(f"<{len(fs)}H", *fs)

    first = freqs.index(max(freqs))
    minus = freqs.copy()
    minus[first] -= 1
    zero = freqs.copy()
    zero[first], zero[(first + 1) % k] = 0, zero[(first + 1) % k] + zero[first]
    states = bytearray(stream)
    states[0:4] = struct.pack("<I", 0xFFFF)  # a state below 2^16
    cases = {
        "empty": b"",
        "unknown method": build(7, planes),
        "unknown plane coding": build(method, [(3, raw_s), planes[1]]),
        "raw plane too short": build(method, [(RAW, raw_s[:-1]), planes[1]]),
        "zstd plane of another size": build(method, [(ZSTD, zstandard.ZstdCompressor().compress(raw_s + b"\0")), planes[1]]),
        "zstd plane garbage": build(method, [(ZSTD, b"\x28\xb5\x2f\xfd junk"), planes[1]]),
        "frequencies sum short": with_section(section[:32] + table_of(minus) + stream),
        "a present value with frequency 0": with_section(section[:32] + table_of(zero) + stream),
        "bitmap names one more value": with_section(
            (int.from_bytes(section[:32], "little") | 1 << 255).to_bytes(32, "little") + table + stream),
        "table cut": with_section(section[:40]),
        "stream cut to its states": with_section(section[: 32 + 2 * k + 4 * LANES]),
        "state out of range": with_section(section[: 32 + 2 * k] + bytes(states)),
        "odd stream": with_section(section + b"\x00"),
        "one word more": with_section(section + b"\x00\x00"),
        "plane header cut": payload[:1] + PLANE_HEADER.pack(RAW, nbytes // 2)[:3],
        "plane longer than the payload": build(method, [(RAW, raw_s), (RANS, section)])[:-1],
    }
    for name, bad in cases.items():
        assert _refused(bad, 2, nbytes), name
    assert _refused(build(ROTATED, [(RAW, bytes(100))]), 1, 100)  # no rotation for width 1
    assert not _refused(build(PLANES, [(RAW, bytes(100))]), 1, 100)
    rans_empty = build(PLANES, [(RANS, section)])
    with pytest.raises(CorruptObjectError):  # rANS for an empty plane is never written
        PlanesZstdCodec().decode(EncodedChunk(FULL, rans_empty[:1] + PLANE_HEADER.pack(RANS, 0)), None, 1, 0)
    # The same sections, well formed, decode: the cases above differ in what they break.
    assert not _refused(with_section(section), 2, nbytes)


# -- end to end ---------------------------------------------------------------------------------


def test_version_3_manifests_publish_and_pull(memory_repo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(21)
    w = (rng.normal(0, 0.02, 200_000)).astype(np.float32)
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")], dtype=torch.float32)
    states = []
    for _ in range(2):
        states.append({
            "w": torch.from_numpy(w.copy()).to(torch.bfloat16),
            "m": torch.from_numpy(w[:5000].copy()),
            "d": torch.from_numpy(w[:777].astype(np.float64)),
            "q": torch.from_numpy((w[:3000] * 1000).astype(np.int8)),
            "s": specials.clone(),
        })
        w = w + rng.normal(0, 1e-3, len(w)).astype(np.float32)
    pub = Publisher(memory_repo_url, PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=64 << 10), progress=False))
    for s in states:
        pub.publish(s)
    repo = Repository(memory_repo_url)
    assert repo.manifest(1).pb.codec.codec_version == 3
    fulls = [c for t in repo.manifest(1).pb.tensors for c in t.chunks if c.encoding == FULL]
    assert len(fulls) > 5
    for m in IMPLS:
        monkeypatch.setattr(codec_mod, "_E", m)
        sub = Subscriber(memory_repo_url)
        for v, s in enumerate(states, start=1):
            got = sub.pull(v)
            for name, t in s.items():
                assert got[name].dtype == t.dtype
                assert got[name].view(torch.uint8).numpy().tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes()


# -- size and speed on real data ----------------------------------------------------------------


@pytest.mark.slow
def test_numpy_twin_codes_a_4_mib_chunk_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_mod, "_E", _entropy_py)
    target = make("skewed", 2, 2 << 20)
    start = time.perf_counter()
    roundtrip(target, 2)
    assert time.perf_counter() - start < 30


@pytest.mark.slow
def test_minilm_snapshot_is_at_least_1_5x_smaller() -> None:
    """Pretrained all-MiniLM-L6-v2 in bf16 (the bench extra's weights): full payloads over the
    real per-tensor chunks."""
    pytest.importorskip("all_minilm_l6_v2")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from benchmarks.minilm_stream import model_dir

    state = safetensors_torch.load_file(str(model_dir() / "model.safetensors"))
    codec = PlanesZstdCodec()
    raw = stored = 0
    for t in state.values():
        b = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8).reshape(-1)
        for off, length in codec.chunk_ranges(len(b), 2):
            raw += length
            stored += len(codec.encode(b[off : off + length], None, 2).payload)
    assert raw / stored >= 1.5


def _mutate(rng: np.random.Generator, payload: bytes) -> bytes:
    """One of: bit flips, a cut, bytes appended, a byte inserted or deleted, or a 1-8 byte field
    overwritten with 0, 1, all ones, 2^16, 2^31 or 4096 (half of them in the first 200 bytes)."""
    p = bytearray(payload)
    kind = int(rng.integers(0, 5))
    at = int(rng.integers(0, len(p)))
    if kind == 0:
        for _ in range(int(rng.integers(1, 4))):
            p[int(rng.integers(0, len(p)))] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:
        del p[at:]
    elif kind == 2:
        p += bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8))
    elif kind == 3:
        p[at : at + 1] = b"" if rng.random() < 0.5 else bytes([int(rng.integers(0, 256))])
    else:
        at = int(rng.integers(0, min(len(p), 200) if rng.random() < 0.5 else len(p)))
        size = int(rng.choice([1, 2, 4, 8]))
        value = int(rng.choice([0, 1, (1 << 64) - 1, 1 << 16, 1 << 31, SCALE])) & ((1 << 8 * size) - 1)
        p[at : at + size] = value.to_bytes(size, "little")[: len(p) - at]
    return bytes(p)


@needs_c
def test_mutated_payloads_are_refused_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutated version 3 full payloads (raw, zstd and rANS planes, rotated or not, at every
    width) are refused by both coders alike, refusals leave ``out`` as it was, and what slips
    through (raw bytes) decodes alike."""
    rng = np.random.default_rng(11)
    sources = [(width, make(kind, width, n, seed=width))
               for width in WIDTHS for kind, n in (("skewed", 5000), ("outliers", 300), ("repeats", 40))]
    codec = PlanesZstdCodec()
    payloads = [(width, target, codec.encode(target, None, width).payload) for width, target in sources]
    assert {c for width, _, p in payloads for c, _ in parse(p, width)[1]} == {RAW, ZSTD, RANS}
    refused = 0
    for trial in range(300):
        width, target, payload = payloads[trial % len(payloads)]
        bad = _mutate(rng, payload)
        outcomes: list[bytes | None] = []
        for module in IMPLS:
            monkeypatch.setattr(codec_mod, "_E", module)
            out = np.full(len(target), 0xA5, dtype=np.uint8)
            try:
                codec.decode_into(EncodedChunk(FULL, bad), None, out, width)
                outcomes.append(out.tobytes())
            except CorruptObjectError:
                assert (out == 0xA5).all()
                outcomes.append(None)
        assert outcomes[0] == outcomes[1], trial
        refused += outcomes[0] is None
    assert refused >= 200

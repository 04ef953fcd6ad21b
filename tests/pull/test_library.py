"""Publisher.publish / Subscriber.pull: bit-exact versions, planning, corruption, races, commit order."""

from __future__ import annotations

import math
import tempfile
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from deltasync import (
    ChecksumMismatchError,
    CorruptObjectError,
    PlanesZstdCodec,
    Publisher,
    PublisherConfig,
    Repository,
    RepositoryNotFoundError,
    Subscriber,
    UsageError,
    VersionConflictError,
    VersionNotFoundError,
)
from deltasync.errors import EmptyRepositoryError
from deltasync.format import dtypes as ds_dtypes
from deltasync.format.codec import FULL, SAME
from deltasync.format.manifest import manifest_key, seal
from deltasync.ops.verify import verify_repository
from deltasync.storage import open_store
from deltasync.v1 import manifest_pb2 as pb

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

State = dict[str, torch.Tensor]
Expected = dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]

ALL_DTYPES: list[torch.dtype] = [
    d for name in ds_dtypes._TORCH_NAMES if isinstance(d := getattr(torch, name, None), torch.dtype)
]
FLOAT_BITS: dict[torch.dtype, tuple[torch.dtype, list[int]]] = {
    torch.float32: (torch.int32, [0, -(1 << 31), 0x7F800000, 0x7FC00000, 0x7F800001, -0x3EDCBA,
                                  0x7FFFFFFF, 1, -(1 << 31) + 1, 0x3F800000]),
    torch.float16: (torch.int16, [0, -0x8000, 0x7C00, 0x7E00, 0x7C01, -0x01FF, 1, 0x3C00]),
    torch.bfloat16: (torch.int16, [0, -0x8000, 0x7F80, 0x7FC0, 0x7F81, -0x3F, 1, 0x3F80]),
    torch.float64: (torch.int64, [0, -(1 << 63), 0x7FF0000000000000, 0x7FF8000000000000,
                                  0x7FF0000000000001, -0x21524111_0000, 1, 0x3FF0000000000000]),
}


# -- helpers ---------------------------------------------------------------------------------


def random_tensor(rng: np.random.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of random bit patterns (bools are 0 or 1)."""
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        raw = rng.integers(0, 2, n, dtype=np.uint8)
    else:
        raw = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return b"" if flat.numel() == 0 else flat.view(torch.uint8).numpy().tobytes()


def expected_of(state: Mapping[str, torch.Tensor]) -> Expected:
    return {k: (v.dtype, tuple(v.shape), bits(v)) for k, v in state.items()}


def assert_bit_exact(got: Mapping[str, torch.Tensor], want: Expected) -> None:
    assert sorted(got) == sorted(want)
    for name, (dtype, shape, raw) in want.items():
        t = got[name]
        assert t.dtype == dtype, name
        assert tuple(t.shape) == shape, name
        assert t.is_contiguous(), name
        assert bits(t) == raw, f"bits of {name!r} differ"


def mutate(rng: np.random.Generator, t: torch.Tensor, fraction: float) -> torch.Tensor:
    """A copy of ``t`` with about ``fraction`` of its bytes XOR-ed with random non-zero bits."""
    raw = np.frombuffer(bytearray(bits(t)), dtype=np.uint8).copy()
    if raw.size:
        count = max(1, int(fraction * raw.size))
        idx = rng.choice(raw.size, size=min(count, raw.size), replace=False)
        flips = rng.integers(1, 256, len(idx), dtype=np.uint8)
        if t.dtype == torch.bool:
            flips = np.ones(len(idx), dtype=np.uint8)
        raw[idx] ^= flips
    if t.numel() == 0:
        return t.clone()
    return torch.from_numpy(raw).view(t.dtype).reshape(t.shape)


def config(chunk_bytes: int = 1024, **kwargs: Any) -> PublisherConfig:
    return PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=chunk_bytes), progress=False, **kwargs)


def kind(repo: Repository, version: int) -> str:
    return "S" if repo.manifest(version).is_snapshot else "D"


def delta_chunks(repo: Repository, version: int) -> list[tuple[pb.Tensor, int, pb.Chunk]]:
    return [
        (t, i, c) for t in repo.manifest(version).pb.tensors for i, c in enumerate(t.chunks) if c.encoding != SAME
    ]


@contextmanager
def scratch_repo(store_kind: str) -> Iterator[str]:
    """A repository URL for use inside a hypothesis test (no function-scoped fixtures there)."""
    if store_kind == "local":
        with tempfile.TemporaryDirectory() as d:
            yield str(Path(d) / "repo")
    else:
        url = f"memory://hyp-{uuid.uuid4().hex}"
        try:
            yield url
        finally:
            store = open_store(url)
            for key in list(store.list()):
                store.delete(key)


# -- round trips over every dtype and layout ------------------------------------------------------


def layouts(rng: np.random.Generator, dtype: torch.dtype) -> tuple[State, Expected]:
    """Contiguous, transposed, sliced, 0-d and empty tensors; expected bits computed with numpy."""
    isz = dtype.itemsize
    rows, cols = 5, 7
    raw = rng.integers(0, 2 if dtype == torch.bool else 256, (rows, cols, isz), dtype=np.uint8)
    base = torch.from_numpy(raw.reshape(rows, cols * isz).copy()).view(dtype)
    assert tuple(base.shape) == (rows, cols)
    name = str(dtype).removeprefix("torch.")
    state: State = {
        f"{name}/contiguous": base,
        f"{name}/transposed": base.t(),
        f"{name}/sliced": base[1:, ::2],
        f"{name}/0d": base[1, 2],
        f"{name}/empty": base[:, :0],
        f"{name}/empty3d": torch.empty((2, 0, 3), dtype=dtype),
        f"{name}/long": random_tensor(rng, dtype, (300,)),
    }
    expected: Expected = {
        f"{name}/contiguous": (dtype, (rows, cols), raw.tobytes()),
        f"{name}/transposed": (dtype, (cols, rows), raw.transpose(1, 0, 2).tobytes()),
        f"{name}/sliced": (dtype, (rows - 1, (cols + 1) // 2), raw[1:, ::2, :].tobytes()),
        f"{name}/0d": (dtype, (), raw[1, 2, :].tobytes()),
        f"{name}/empty": (dtype, (rows, 0), b""),
        f"{name}/empty3d": (dtype, (2, 0, 3), b""),
        f"{name}/long": (dtype, (300,), bits(state[f"{name}/long"])),
    }
    return state, expected


def test_every_dtype_is_covered() -> None:
    assert len(ALL_DTYPES) >= 20
    for d in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64,
              torch.complex128, torch.bool, torch.uint64):
        assert d in ALL_DTYPES


@pytest.mark.parametrize("chunk_bytes", [64, 4096])
def test_every_dtype_and_layout_roundtrips(repo_url: str, chunk_bytes: int) -> None:
    rng = np.random.default_rng(chunk_bytes)
    state1: State = {}
    want1: Expected = {}
    for dtype in ALL_DTYPES:
        s, e = layouts(rng, dtype)
        state1.update(s)
        want1.update(e)
    # Tiny random chunks barely compress as deltas; keep version 2 a delta whatever its size.
    pub = Publisher(repo_url, config(chunk_bytes, max_delta_fraction=10.0))
    assert pub.publish(state1) == 1
    # The publisher copies what it needs: changing the caller's tensors afterwards is harmless.
    state2 = {k: mutate(rng, v, 0.05) for k, v in state1.items()}
    want2 = expected_of(state2)
    assert pub.publish(state2) == 2
    repo = Repository(repo_url)
    assert (kind(repo, 1), kind(repo, 2)) == ("S", "D")
    sub = Subscriber(repo_url)
    assert_bit_exact(sub.pull(1), want1)
    got = sub.pull(2)
    assert_bit_exact(got, want2)
    assert got.plan.base == 1
    assert_bit_exact(Subscriber(repo_url).pull(2), want2)
    assert_bit_exact(Subscriber(repo_url).pull(), want2)


@pytest.mark.parametrize("dtype", list(FLOAT_BITS))
def test_signed_zeros_and_nan_payloads_roundtrip(repo_url: str, dtype: torch.dtype) -> None:
    int_dtype, patterns = FLOAT_BITS[dtype]
    pat = torch.tensor(patterns, dtype=int_dtype).repeat(40)
    v1 = pat.view(dtype)
    v2 = torch.roll(pat, 1).view(dtype)  # every element becomes another special pattern
    sign = torch.tensor(-(1 << (8 * dtype.itemsize - 1)), dtype=int_dtype)
    v3 = (torch.roll(pat, 1) ^ sign).view(dtype)  # -0.0 <-> +0.0, NaN and inf sign bits
    pub = Publisher(repo_url, config(64, max_delta_fraction=10.0))  # periodic data: tiny snapshot
    wants = []
    for t in (v1, v2, v3):
        wants.append(expected_of({"w": t}))
        pub.publish({"w": t.clone()})
    repo = Repository(repo_url)
    assert kind(repo, 3) == "D" and delta_chunks(repo, 3)  # equal as floats is not equal as bits
    sub = Subscriber(repo_url)
    for v in (3, 1, 2, 3):
        assert_bit_exact(sub.pull(v), wants[v - 1])


def test_publisher_copies_its_input(memory_repo_url: str) -> None:
    t = torch.arange(1000, dtype=torch.float32)
    pub = Publisher(memory_repo_url, config(256))
    pub.publish({"t": t})
    want1 = expected_of({"t": t})
    t[::7] += 1  # in place, after publishing
    pub.publish({"t": t})
    assert_bit_exact(Subscriber(memory_repo_url).pull(1), want1)
    assert_bit_exact(Subscriber(memory_repo_url).pull(2), expected_of({"t": t}))


def test_scribbling_on_pulled_tensors_only_costs_a_repair(memory_repo_url: str) -> None:
    rng = np.random.default_rng(5)
    s1 = {"t": random_tensor(rng, torch.bfloat16, (64, 64))}
    s2 = {"t": mutate(rng, s1["t"], 0.01)}
    pub = Publisher(memory_repo_url, config(512))
    pub.publish(s1)
    pub.publish(s2)
    sub = Subscriber(memory_repo_url)
    got1 = sub.pull(1)
    got1["t"].zero_()  # results may share memory with the next pull's base: never trusted blindly
    assert_bit_exact(sub.pull(2), expected_of(s2))
    assert_bit_exact(sub.pull(2), expected_of(s2))


# -- streams of versions ---------------------------------------------------------------------------


def test_every_kth_version_is_a_snapshot(repo_url: str) -> None:
    rng = np.random.default_rng(1)
    pub = Publisher(repo_url, config(256, snapshot_every=3))
    state = {"a": random_tensor(rng, torch.bfloat16, (40, 40)), "b": random_tensor(rng, torch.float32, (100,))}
    wants = []
    for _ in range(8):
        state = {k: mutate(rng, v, 0.01) for k, v in state.items()}
        wants.append(expected_of(state))
        result = pub.publish(state)
    repo = Repository(repo_url)
    assert repo.versions() == list(range(1, 9))
    assert "".join(kind(repo, v) for v in repo.versions()) == "SDDSDDSD"
    for v in repo.versions():
        info = repo.manifest(v)
        assert info.pb.snapshot == v - (v - 1) % 3
        if v > 1:
            assert info.parent == v - 1
    assert result.kind == "delta" and result.parent == 7
    order = list(range(1, 9))
    rng.shuffle(order)
    sub = Subscriber(repo_url)
    for v in order:
        assert_bit_exact(sub.pull(v), wants[v - 1])
        assert_bit_exact(Subscriber(repo_url).pull(v), wants[v - 1])


@pytest.mark.parametrize("fraction", [0.5, 10.0])
def test_large_delta_becomes_a_snapshot(repo_url: str, fraction: float) -> None:
    rng = np.random.default_rng(2)
    pub = Publisher(repo_url, config(1024, max_delta_fraction=fraction))
    s1 = {"w": random_tensor(rng, torch.float32, (4096,)), "b": random_tensor(rng, torch.bfloat16, (512,))}
    s2 = {k: mutate(rng, v, 0.001) for k, v in s1.items()}
    s3 = {k: random_tensor(rng, v.dtype, tuple(v.shape)) for k, v in s2.items()}  # every element changes
    for s in (s1, s2, s3):
        pub.publish(s)
    repo = Repository(repo_url)
    kinds = "".join(kind(repo, v) for v in repo.versions())
    assert kinds == ("SDS" if fraction < 1 else "SDD")
    for v, s in zip((1, 2, 3), (s1, s2, s3), strict=True):
        assert_bit_exact(Subscriber(repo_url).pull(v), expected_of(s))
    report = verify_repository(repo_url)
    assert report.versions == [1, 2, 3]
    assert report.notes == []  # the abandoned delta attempt left no packs behind


def test_abandoned_delta_keeps_packs_shared_with_committed_versions(repo_url: str) -> None:
    """Packs are content-addressed: a retried-as-snapshot delta must not delete a pack that an
    earlier version committed with the very same bytes (here: a change, then its exact undo)."""
    rng = np.random.default_rng(3)
    n = 1 << 18
    a = torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
    b = torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))
    mask = torch.from_numpy(((rng.random(n) < 0.3) * rng.integers(1, 256, n)).astype(np.uint8))
    s1 = {"a": a.clone(), "b": b.clone()}
    s2 = {"a": a ^ mask, "b": b.clone()}  # delta pack: XOR of a
    s3 = {"a": a.clone(), "b": torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))}  # same XOR, then too big
    pub = Publisher(repo_url, config(4096, pack_bytes=1 << 16, max_delta_fraction=0.5))
    for s in (s1, s2, s3):
        pub.publish(s)
    repo = Repository(repo_url)
    assert "".join(kind(repo, v) for v in repo.versions()) == "SDS"
    for v, s in zip((1, 2, 3), (s1, s2, s3), strict=True):
        assert_bit_exact(Subscriber(repo_url).pull(v), expected_of(s))
    verify_repository(repo_url)


def test_tensors_added_removed_reshaped_retyped(repo_url: str) -> None:
    rng = np.random.default_rng(4)
    s1: State = {
        "reshaped": random_tensor(rng, torch.float32, (16, 16)),
        "retyped_same_width": random_tensor(rng, torch.bfloat16, (300,)),
        "retyped_other_width": random_tensor(rng, torch.float32, (64,)),
        "resized": random_tensor(rng, torch.int64, (50,)),
        "removed": random_tensor(rng, torch.uint8, (1000,)),
        "kept": random_tensor(rng, torch.float16, (500,)),
    }
    s2: State = {
        "reshaped": mutate(rng, s1["reshaped"], 0.01).reshape(8, 32),
        "retyped_same_width": mutate(rng, s1["retyped_same_width"], 0.01).view(torch.float16),
        "retyped_other_width": s1["retyped_other_width"].view(torch.bfloat16),  # same bytes, width 2
        "resized": random_tensor(rng, torch.int64, (60,)),
        "added": random_tensor(rng, torch.complex64, (7, 3)),
        "kept": s1["kept"].clone(),
    }
    s3: State = {**s2, "removed": random_tensor(rng, torch.uint8, (1000,)), "kept": mutate(rng, s2["kept"], 0.02)}
    pub = Publisher(repo_url, config(128))
    for s in (s1, s2, s3):
        pub.publish(s)
    repo = Repository(repo_url)
    assert "".join(kind(repo, v) for v in repo.versions()) == "SDD"
    t2 = repo.manifest(2).entries()
    assert "removed" not in t2
    assert all(c.encoding == SAME for c in t2["kept"].chunks)
    for name in ("added", "resized", "retyped_other_width"):  # nothing to diff against: full
        assert {c.encoding for c in t2[name].chunks} == {FULL}, name
    for name in ("reshaped", "retyped_same_width"):  # same bytes per element: a real delta
        assert FULL not in {c.encoding for c in t2[name].chunks}, name
    assert tuple(t2["reshaped"].shape) == (8, 32) and t2["retyped_same_width"].dtype == "F16"
    sub = Subscriber(repo_url)
    for v in (2, 1, 3, 2, 3):
        assert_bit_exact(sub.pull(v), expected_of((s1, s2, s3)[v - 1]))


@pytest.mark.parametrize("chunk_bytes", [64, 72, 1000, 4096])
def test_tensors_span_many_chunks(repo_url: str, chunk_bytes: int) -> None:
    rng = np.random.default_rng(chunk_bytes)
    s1 = {
        "bf16": random_tensor(rng, torch.bfloat16, (25_001,)),
        "f64": random_tensor(rng, torch.float64, (37, 41)),
        "c128": random_tensor(rng, torch.complex128, (333,)),
        "u8": random_tensor(rng, torch.uint8, (9999,)),
    }
    s2 = {k: mutate(rng, v, 0.002) for k, v in s1.items()}
    pub = Publisher(repo_url, config(chunk_bytes))
    pub.publish(s1)
    pub.publish(s2)
    repo = Repository(repo_url)
    for v in (1, 2):
        for t in repo.manifest(v).pb.tensors:
            width = ds_dtypes.element_width(t.dtype)
            assert len(t.chunks) == -(-t.nbytes // (chunk_bytes - chunk_bytes % width))
    assert kind(repo, 2) == "D"
    encodings = {c.encoding for _, _, c in delta_chunks(repo, 2)}
    assert encodings and FULL not in encodings
    sub = Subscriber(repo_url)
    assert_bit_exact(sub.pull(1), expected_of(s1))
    assert_bit_exact(sub.pull(2), expected_of(s2))


OPS = ("same", "few", "many", "all", "add", "remove", "reshape", "retype", "retype-width")
STREAM_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.float64, torch.bool,
                 torch.float8_e4m3fn, torch.complex64, torch.uint16)


def apply_op(rng: np.random.Generator, state: State, op: str, counter: list[int]) -> State:
    out = dict(state)
    names = sorted(out)
    pick = names[int(rng.integers(len(names)))] if names else None
    if op == "add" or pick is None:
        counter[0] += 1
        dtype = STREAM_DTYPES[int(rng.integers(len(STREAM_DTYPES)))]
        shape = tuple(int(x) for x in rng.integers(0, 40, int(rng.integers(0, 3))))
        out[f"t{counter[0]}"] = random_tensor(rng, dtype, shape)
    elif op == "remove":
        del out[pick]
    elif op in ("few", "many", "all"):
        t = out[pick]
        out[pick] = (random_tensor(rng, t.dtype, tuple(t.shape)) if op == "all"
                     else mutate(rng, t, 0.005 if op == "few" else 0.3))
    elif op == "reshape":
        out[pick] = out[pick].reshape(-1)
    elif op == "retype":  # same element width, different meaning of the bits
        t = out[pick]
        same_width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if t.dtype not in (torch.bool, torch.complex64) and t.dim() > 0 and t.numel():
            out[pick] = t.view(same_width[t.dtype.itemsize])
    elif op == "retype-width":
        t = out[pick]
        if t.dtype not in (torch.bool, torch.complex64) and t.dim() > 0 and t.numel():
            out[pick] = t.contiguous().reshape(-1).view(torch.uint8)
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    store_kind=st.sampled_from(["local", "memory"]),
    chunk_bytes=st.sampled_from([64, 136, 1024, 4096]),
    snapshot_every=st.integers(1, 5),
    max_delta_fraction=st.sampled_from([0.5, 10.0]),
    ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=9),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_stream_of_versions_pulls_bit_exactly(
    store_kind: str, chunk_bytes: int, snapshot_every: int, max_delta_fraction: float,
    ops: list[str], seed: int, data: st.DataObject,
) -> None:
    rng = np.random.default_rng(seed)
    counter = [0]
    state: State = {}
    for _ in range(3):
        state = apply_op(rng, state, "add", counter)
    with scratch_repo(store_kind) as url:
        pub = Publisher(url, config(chunk_bytes, snapshot_every=snapshot_every,
                                    max_delta_fraction=max_delta_fraction))
        repo = Repository(url)
        wants: list[Expected] = []
        since_snapshot = 0
        for step, op in enumerate(["same", *ops]):
            if step:
                state = apply_op(rng, state, op, counter)
            wants.append(expected_of(state))
            v: int = pub.publish(state)
            assert v == step + 1
            info = repo.manifest(v)
            if v == 1 or since_snapshot + 1 >= snapshot_every:
                assert info.is_snapshot
            if info.is_snapshot:
                since_snapshot = 0
                assert all(c.encoding == FULL for t in info.pb.tensors for c in t.chunks)
            else:
                since_snapshot += 1
                assert info.parent == v - 1
                if op == "same":
                    assert info.pb.stored_bytes == 0
            assert len(repo.chain(v)) <= snapshot_every
        versions = list(range(1, len(wants) + 1))
        order = data.draw(st.permutations(versions), label="pull order")
        sub = Subscriber(url)
        for v in order:
            assert_bit_exact(sub.pull(v), wants[v - 1])
        for v in versions:
            assert_bit_exact(Subscriber(url).pull(v), wants[v - 1])
        verify_repository(url)


def test_interleaved_publisher_falls_back_to_a_snapshot(repo_url: str) -> None:
    rng = np.random.default_rng(6)
    a, b = Publisher(repo_url, config(256)), Publisher(repo_url, config(256))
    s1 = {"w": random_tensor(rng, torch.float32, (500,))}
    s2 = {"w": mutate(rng, s1["w"], 0.01)}
    s3 = {"w": mutate(rng, s2["w"], 0.01)}
    assert a.publish(s1) == 1
    assert b.publish(s2) == 2  # b has no bits in memory: a snapshot
    assert a.publish(s3) == 3  # a's bits are of version 1, not of the latest: a snapshot again
    repo = Repository(repo_url)
    assert "".join(kind(repo, v) for v in repo.versions()) == "SSS"
    assert repo.manifest(3).parent == 2
    for v, s in zip((1, 2, 3), (s1, s2, s3), strict=True):
        assert_bit_exact(Subscriber(repo_url).pull(v), expected_of(s))


def test_changing_chunk_size_between_versions(repo_url: str, tmp_path: Path) -> None:
    """A tensor whose chunks change with the chunk size cannot diff against the parent's chunks."""
    from safetensors.torch import save_file

    rng = np.random.default_rng(16)
    s1 = {"w": random_tensor(rng, torch.float32, (5000,)), "small": random_tensor(rng, torch.float32, (10,))}
    s2 = {"w": mutate(rng, s1["w"], 0.01), "small": mutate(rng, s1["small"], 0.1)}
    for name, s in (("c1", s1), ("c2", s2)):
        (tmp_path / name).mkdir()
        save_file(s, str(tmp_path / name / "model.safetensors"))
    Publisher(repo_url, config(64)).publish_dir(tmp_path / "c1")
    pub = Publisher(repo_url, config(4096, max_delta_fraction=10.0))  # "w" alone is as big as a snapshot
    v2 = pub.publish_dir(tmp_path / "c2", base_dir=tmp_path / "c1")
    info = Repository(repo_url).manifest(v2)
    assert not info.is_snapshot  # "small" is one chunk either way: still a delta
    tensors = info.entries()
    assert {c.encoding for c in tensors["w"].chunks} == {FULL}
    assert FULL not in {c.encoding for c in tensors["small"].chunks}
    # Library versions too: a Publisher with another chunk size starts over.
    v3 = Publisher(repo_url, config(1024)).publish(s1)
    sub = Subscriber(repo_url)
    for v, s in ((v2, s2), (1, s1), (v3, s1), (v2, s2)):
        assert_bit_exact(sub.pull(v), expected_of(s))


def test_explicit_version_ids(memory_repo_url: str) -> None:
    pub = Publisher(memory_repo_url, config())
    t = torch.ones(10)
    assert pub.publish({"t": t}, version=10, metadata={"step": "10"}) == 10
    assert pub.publish({"t": t * 2}) == 11
    repo = Repository(memory_repo_url)
    assert repo.versions() == [10, 11]
    assert repo.manifest(11).parent == 10 and repo.manifest(10).pb.metadata["step"] == "10"
    with pytest.raises(UsageError):
        pub.publish({"t": t}, version=11)
    with pytest.raises(UsageError):
        pub.publish({"t": t}, version=0)
    with pytest.raises(UsageError):
        pub.publish({"": t})
    assert_bit_exact(Subscriber(Repository(memory_repo_url)).pull(10), expected_of({"t": t}))
    assert_bit_exact(Subscriber(open_store(memory_repo_url)).pull(), expected_of({"t": t * 2}))


# -- planning --------------------------------------------------------------------------------------


def publish_stream(url: str, count: int, *, snapshot_every: int = 20, seed: int = 0) -> list[Expected]:
    rng = np.random.default_rng(seed)
    pub = Publisher(url, config(512, snapshot_every=snapshot_every))
    state = {"a": random_tensor(rng, torch.bfloat16, (64, 64)), "b": random_tensor(rng, torch.float32, (999,))}
    wants = []
    for _ in range(count):
        state = {k: mutate(rng, v, 0.01) for k, v in state.items()}
        wants.append(expected_of(state))
        pub.publish(state)
    return wants


def test_plan_from_nothing_starts_at_the_snapshot(repo_url: str) -> None:
    publish_stream(repo_url, 3)
    sub = Subscriber(repo_url)
    plan = sub.pull(3).plan
    repo = Repository(repo_url)
    assert plan.base is None and plan.target == 3 and plan.versions == (1, 2, 3)
    assert plan.fetch_bytes >= repo.manifest(1).pb.stored_bytes


def test_plan_of_the_next_version_is_its_delta(repo_url: str) -> None:
    wants = publish_stream(repo_url, 5)
    repo = Repository(repo_url)
    sub = Subscriber(repo_url)
    sub.pull(1)
    for v in range(2, 6):
        got = sub.pull(v)
        assert_bit_exact(got, wants[v - 1])
        plan = got.plan
        assert plan.base == v - 1 and plan.versions[-1] == v
        assert plan.fetch_bytes == sum(c.length for _, _, c in delta_chunks(repo, v))
        assert plan.fetch_bytes == repo.manifest(v).pb.stored_bytes
    plan = sub.pull(5).plan  # already there: nothing to fetch
    assert plan.base == 5 and plan.fetch_bytes == 0
    assert sub.pull(2).plan.base is None  # backwards: from the snapshot


def test_plan_skips_a_chain_that_a_newer_snapshot_cuts(repo_url: str) -> None:
    wants = publish_stream(repo_url, 5, snapshot_every=2)
    repo = Repository(repo_url)
    assert "".join(kind(repo, v) for v in repo.versions()) == "SDSDS"
    sub = Subscriber(repo_url)
    sub.pull(1)
    got = sub.pull(4)
    assert_bit_exact(got, wants[3])
    plan = got.plan
    assert plan.base is None and plan.versions == (3, 4)
    assert plan.fetch_bytes == repo.manifest(3).pb.stored_bytes + repo.manifest(4).pb.stored_bytes
    full_plan, _ = sub.plan(4, None)
    assert full_plan == plan


# -- corruption and missing things -----------------------------------------------------------------


def two_versions(url: str) -> tuple[Repository, list[Expected]]:
    rng = np.random.default_rng(12)
    s1 = {"w": random_tensor(rng, torch.bfloat16, (2048,)), "z": random_tensor(rng, torch.float32, (700,))}
    s2 = {"w": mutate(rng, s1["w"], 0.2), "z": mutate(rng, s1["z"], 0.02)}
    pub = Publisher(url, config(1024))
    pub.publish(s1)
    pub.publish(s2)
    repo = Repository(url)
    assert kind(repo, 2) == "D"
    return repo, [expected_of(s1), expected_of(s2)]


def rewrite(repo: Repository, key: str, change: Callable[[bytes], bytes]) -> None:
    store = repo.store
    store.put(key, change(store.get(key)))


def test_flipped_byte_in_a_delta_pack_names_version_tensor_and_chunk(local_repo_url: str) -> None:
    repo, wants = two_versions(local_repo_url)
    t, idx, c = delta_chunks(repo, 2)[3]
    key = repo.manifest(2).pb.packs[c.pack].key
    path = Path(local_repo_url) / key
    assert path.is_file() and path.parent.name == "packs"
    raw = bytearray(path.read_bytes())
    raw[c.offset + c.length // 2] ^= 0x5A
    path.write_bytes(bytes(raw))
    with pytest.raises((ChecksumMismatchError, CorruptObjectError)) as err:
        Subscriber(local_repo_url).pull(2)
    msg = str(err.value)
    assert "version 2" in msg and repr(t.name) in msg and f"chunk {idx}" in msg
    if isinstance(err.value, ChecksumMismatchError):
        assert (err.value.version, err.value.tensor, err.value.chunk) == (2, t.name, idx)
    sub = Subscriber(local_repo_url)
    assert_bit_exact(sub.pull(1), wants[0])  # the snapshot is intact
    with pytest.raises((ChecksumMismatchError, CorruptObjectError), match="version 2"):
        sub.pull(2)  # incremental from version 1 hits the same chunk
    verify_error = pytest.raises((ChecksumMismatchError, CorruptObjectError), match="version 2")
    with verify_error:
        verify_repository(local_repo_url)


def test_every_damaged_delta_chunk_is_caught(repo_url: str) -> None:
    repo, _ = two_versions(repo_url)
    chunks = delta_chunks(repo, 2)
    pristine = {p.key: repo.store.get(p.key) for p in repo.manifest(2).pb.packs}
    for t, idx, c in chunks[:: max(1, len(chunks) // 8)]:
        key = repo.manifest(2).pb.packs[c.pack].key
        damaged = bytearray(pristine[key])
        damaged[c.offset : c.offset + c.length] = bytes(b ^ 0xFF for b in damaged[c.offset : c.offset + c.length])
        repo.store.put(key, bytes(damaged))
        with pytest.raises((ChecksumMismatchError, CorruptObjectError)) as err:
            Subscriber(repo_url).pull(2)
        assert f"version 2, tensor {t.name!r}, chunk {idx}" in str(err.value)
        repo.store.put(key, pristine[key])


def test_truncated_pack_is_corrupt(repo_url: str) -> None:
    repo, wants = two_versions(repo_url)
    key = repo.manifest(2).pb.packs[0].key
    rewrite(repo, key, lambda data: data[: len(data) // 2])
    with pytest.raises(CorruptObjectError) as err:
        Subscriber(repo_url).pull(2)
    msg = str(err.value)
    assert "version 2" in msg and "tensor" in msg and "chunk" in msg
    assert_bit_exact(Subscriber(repo_url).pull(1), wants[0])
    with pytest.raises(CorruptObjectError, match="version 2"):
        verify_repository(repo_url)


def test_missing_pack_is_corrupt_and_named(repo_url: str) -> None:
    repo, wants = two_versions(repo_url)
    key = repo.manifest(2).pb.packs[0].key
    assert key not in {p.key for p in repo.manifest(1).pb.packs}
    repo.store.delete(key)
    with pytest.raises(CorruptObjectError, match=f"version 2, tensor .* chunk .*{key}.*missing"):
        Subscriber(repo_url).pull(2)
    assert_bit_exact(Subscriber(repo_url).pull(1), wants[0])
    with pytest.raises(CorruptObjectError, match="missing"):
        verify_repository(repo_url)


def test_manifest_without_full_zstd_level_still_reads(repo_url: str) -> None:
    """Manifests written before the codec recorded full_zstd_level hold protobuf's 0 there."""
    repo, wants = two_versions(repo_url)
    for v in (1, 2):
        m = pb.Manifest()
        m.ParseFromString(repo.store.get(manifest_key(v)))
        m.codec.ClearField("full_zstd_level")
        repo.store.put(manifest_key(v), seal(m))
    sub = Subscriber(repo_url)
    for v in (1, 2):
        assert_bit_exact(sub.pull(v), wants[v - 1])


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],
        lambda data: data[:-1],
        lambda data: b"",
        lambda data: b"\xff" * len(data),
        lambda data: bytes(np.random.default_rng(0).integers(0, 256, 200, dtype=np.uint8)),
    ],
    ids=["half", "last-byte", "empty", "ff", "garbage"],
)
def test_damaged_manifest_is_corrupt(repo_url: str, damage: Callable[[bytes], bytes]) -> None:
    repo, wants = two_versions(repo_url)
    rewrite(repo, manifest_key(2), damage)
    with pytest.raises(CorruptObjectError, match="manifest 2"):
        Subscriber(repo_url).pull(2)
    with pytest.raises(CorruptObjectError, match="manifest 2"):
        Subscriber(repo_url).pull()
    assert_bit_exact(Subscriber(repo_url).pull(1), wants[0])


def test_missing_version_and_repository(repo_url: str, tmp_path: Path) -> None:
    with pytest.raises(RepositoryNotFoundError):
        Subscriber(repo_url).pull()
    with pytest.raises(RepositoryNotFoundError):
        Subscriber(repo_url).pull(1)
    Repository(repo_url).create()
    with pytest.raises(EmptyRepositoryError):
        Subscriber(repo_url).pull()
    Publisher(repo_url, config()).publish({"t": torch.zeros(3)})
    with pytest.raises(VersionNotFoundError) as err:
        Subscriber(repo_url).pull(2)
    assert err.value.version == 2
    with pytest.raises(RepositoryNotFoundError):
        Subscriber(str(tmp_path / "no" / "such" / "repo")).pull(1)


# -- racing publishers -----------------------------------------------------------------------------


def race(url: str, states: list[State], monkeypatch: pytest.MonkeyPatch) -> tuple[list[int | None],
                                                                                 list[BaseException | None]]:
    """Publish ``states`` from as many fresh Publishers at once, all reaching commit together."""
    barrier = threading.Barrier(len(states), timeout=30)
    original = Repository.commit

    def commit_together(self: Repository, manifest: pb.Manifest, **kwargs: Any) -> Any:
        barrier.wait()  # every publisher has chosen its version id and uploaded its packs
        return original(self, manifest, **kwargs)

    monkeypatch.setattr(Repository, "commit", commit_together)
    results: list[int | None] = [None] * len(states)
    errors: list[BaseException | None] = [None] * len(states)

    def run(i: int) -> None:
        try:
            results[i] = Publisher(url, config(256)).publish(states[i])
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(states))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    monkeypatch.setattr(Repository, "commit", original)
    return results, errors


@pytest.mark.parametrize("existing", [0, 2])
def test_racing_publishers_exactly_one_wins(repo_url: str, existing: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(existing)
    if existing:
        publish_stream(repo_url, existing)
    states = [{"w": random_tensor(rng, torch.bfloat16, (3000,)), f"only{i}": torch.full((5,), float(i))}
              for i in range(3)]
    results, errors = race(repo_url, states, monkeypatch)
    target = existing + 1
    winners = [i for i, r in enumerate(results) if r is not None]
    assert len(winners) == 1 and results[winners[0]] == target
    for i, e in enumerate(errors):
        if i in winners:
            assert e is None
        else:
            assert isinstance(e, VersionConflictError) and e.version == target
    repo = Repository(repo_url)
    assert repo.versions() == list(range(1, target + 1)) and repo.latest() == target
    assert_bit_exact(Subscriber(repo_url).pull(target), expected_of(states[winners[0]]))
    report = verify_repository(repo_url)
    assert report.versions == list(range(1, target + 1))
    # A loser just publishes again, as the next version.
    loser = next(i for i in range(3) if i not in winners)
    assert Publisher(repo_url, config(256)).publish(states[loser]) == target + 1
    assert_bit_exact(Subscriber(repo_url).pull(target + 1), expected_of(states[loser]))


def test_unsynchronised_publishers_never_share_a_version(repo_url: str) -> None:
    rng = np.random.default_rng(13)
    pubs = [Publisher(repo_url, config(256)) for _ in range(2)]
    published: dict[int, Expected] = {}
    lock = threading.Lock()

    def run(p: Publisher, seed: int) -> None:
        r = np.random.default_rng(seed)
        state = {"w": random_tensor(r, torch.float16, (1000,))}
        for _ in range(5):
            state = {"w": mutate(r, state["w"], 0.01)}
            try:
                v = p.publish(state)
            except VersionConflictError:
                continue
            with lock:
                assert v not in published
                published[v] = expected_of(state)

    threads = [threading.Thread(target=run, args=(p, int(rng.integers(1 << 30)))) for p in pubs]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    repo = Repository(repo_url)
    assert repo.versions() == sorted(published)
    sub = Subscriber(repo_url)
    for v, want in published.items():
        assert_bit_exact(sub.pull(v), want)


# -- commit order ----------------------------------------------------------------------------------


def test_interrupted_publish_leaves_nothing_visible(repo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(14)
    pub = Publisher(repo_url, config(512))
    s1 = {"w": random_tensor(rng, torch.bfloat16, (4096,))}
    s2 = {"w": mutate(rng, s1["w"], 0.05)}
    pub.publish(s1)
    repo = Repository(repo_url)
    packs_before = set(repo.store.list("packs/"))

    def killed(self: Repository, manifest: pb.Manifest, **kwargs: Any) -> Any:
        raise KeyboardInterrupt("publisher killed before its manifest")

    monkeypatch.setattr(Repository, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        pub.publish(s2)
    monkeypatch.undo()

    fresh = Repository(repo_url)
    assert fresh.versions() == [1] and fresh.latest() == 1
    assert list(fresh.store.list("manifests/")) == [manifest_key(1)]
    assert set(fresh.store.list("packs/")) > packs_before  # the packs went first
    with pytest.raises(VersionNotFoundError):
        Subscriber(repo_url).pull(2)
    assert_bit_exact(Subscriber(repo_url).pull(), expected_of(s1))
    report = verify_repository(repo_url)
    assert report.versions == [1]
    assert any("referenced by no version" in n for n in report.notes)

    # The publisher recovers: the next attempt commits (as a snapshot: its base was dropped).
    assert pub.publish(s2) == 2
    assert fresh.manifest(2).is_snapshot
    assert_bit_exact(Subscriber(repo_url).pull(2), expected_of(s2))


def test_failed_upload_leaves_nothing_visible(repo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(15)
    pub = Publisher(repo_url, config(512, pack_bytes=1 << 16, max_delta_fraction=10.0))
    s1 = {"w": random_tensor(rng, torch.float32, (100_000,))}
    pub.publish(s1)
    store = pub.repo.store
    packs_before = set(store.list("packs/"))
    original = type(store).put
    calls = [0]

    def flaky(self: Any, key: str, data: Any, *, if_absent: bool = False) -> None:
        if key.startswith("packs/"):
            calls[0] += 1
            if calls[0] == 3:
                raise OSError("disk on fire")
        original(self, key, data, if_absent=if_absent)

    monkeypatch.setattr(type(store), "put", flaky)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OSError, match="disk on fire"):
            pub.publish({"w": random_tensor(rng, torch.float32, (100_000,))})
    monkeypatch.undo()
    assert Repository(repo_url).versions() == [1]
    assert set(store.list("packs/")) == packs_before  # what the attempt uploaded is removed again
    assert verify_repository(repo_url).notes == []
    assert_bit_exact(Subscriber(repo_url).pull(), expected_of(s1))


def weight_like_states(seed: int, n: int, versions: int) -> list[dict[str, torch.Tensor]]:
    """Versions of bf16 weights of many magnitudes moved by small fp32 steps: small weights
    (a small ulp) change more often, so magnitude classes win, as on a real AdamW stream."""
    rng = np.random.default_rng(seed)
    w = (rng.normal(0, 1, n) * np.exp(rng.normal(-4, 1.5, n))).astype(np.float32)
    states = []
    for _ in range(versions):
        states.append({"w": torch.from_numpy(w.copy()).to(torch.bfloat16), "v": torch.from_numpy(w[:999].copy())})
        w = w + rng.normal(0, 5e-6, n).astype(np.float32)
    return states


def test_codec_version_2_chain_pulls_forward_jumps_and_rolls_back(memory_repo_url: str) -> None:
    """A chain of magnitude-class deltas (codec version 2): pulled step by step, jumping from
    the snapshot, and back to an older version (whose class chunks rebuild from the chain)."""
    states = weight_like_states(11, 300_000, 4)
    cfg = PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=64 << 10, max_classes=6, full_coder=False), progress=False)
    pub = Publisher(memory_repo_url, cfg)
    for s in states:
        pub.publish(s)
    repo = Repository(memory_repo_url)
    assert repo.manifest(4).pb.codec.codec_version == 2
    classes = [c for t in repo.manifest(4).pb.tensors for c in t.chunks if c.encoding == pb.SPARSE]
    assert classes, "deltas were stored sparse"
    sub = Subscriber(memory_repo_url)
    for v, s in enumerate(states, start=1):
        assert_bit_exact(sub.pull(v), expected_of(s))
    assert_bit_exact(Subscriber(memory_repo_url).pull(4), expected_of(states[3]))
    assert_bit_exact(sub.pull(2), expected_of(states[1]))  # backwards from version 4


def test_default_codec_chain_through_snapshots_squashes_partial_pulls_and_rollbacks(memory_repo_url: str) -> None:
    """The default codec (version 3: magnitude classes, entropy-coded snapshots) on a chain with
    a snapshot inside it and squashes across it: forward step by step, a jump from nothing, a
    far-behind pull through a squash, a partial pull, and rollbacks, all bit-exact."""
    states = weight_like_states(12, 200_000, 7)
    cfg = PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=64 << 10), snapshot_every=4, squash_strides=(3,),
                          progress=False)
    pub = Publisher(memory_repo_url, cfg)
    for s in states:
        pub.publish(s)
    repo = Repository(memory_repo_url)
    assert [v for v in repo.versions() if repo.manifest(v).is_snapshot] == [1, 5]
    assert repo.squashes() and all(repo.manifest(v).pb.codec.codec_version == 3 for v in repo.versions())
    codings = [repo.store.get(repo.manifest(v).pb.packs[c.pack].key, (c.offset, c.length))[1]
               for v in (2, 3, 4, 6, 7) for t in repo.manifest(v).pb.tensors for c in t.chunks if c.encoding == pb.SPARSE]
    assert 3 in codings, "some positions coded in magnitude classes"
    sub = Subscriber(memory_repo_url)
    for v, s in enumerate(states, start=1):
        assert_bit_exact(sub.pull(v), expected_of(s))
    assert_bit_exact(Subscriber(memory_repo_url).pull(7), expected_of(states[6]))
    behind = Subscriber(memory_repo_url)
    assert_bit_exact(behind.pull(3), expected_of(states[2]))
    through = behind.pull(6)
    assert_bit_exact(through, expected_of(states[5]))
    assert (3, 6) in repo.squashes() and through.plan is not None and through.plan.squashes == ((3, 6),)
    partial = Subscriber(memory_repo_url).pull(7, tensors=["w"])
    assert sorted(partial) == ["w"] and torch.equal(partial["w"].view(torch.int16), states[6]["w"].view(torch.int16))
    assert_bit_exact(sub.pull(3), expected_of(states[2]))  # backwards across the snapshot
    assert_bit_exact(sub.pull(1), expected_of(states[0]))

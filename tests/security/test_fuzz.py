"""Hostile input: fuzzed manifests, chunk payloads and blobs, and hostile repositories end to end.

Properties:

* ``parse_manifest`` on any bytes either returns a manifest that is safe to use (see
  :func:`assert_safe`: the layout every consumer relies on holds) or raises
  CorruptObjectError, never another exception, within a bounded time and memory.
* ``PlanesZstdCodec.decode`` on any payload returns exactly ``nbytes`` bytes or raises
  CorruptObjectError.
* A pull from a repository holding a hostile manifest raises a DeltasyncError, writes
  nothing outside its output directory, and any file it does write matches its digest.

Inputs that once broke a property are kept in ``tests/fuzz_corpus/`` and replayed.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import shutil
import struct
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_helpers import make_state, step_state, write_checkpoint
from hypothesis import HealthCheck, given, settings, strategies as st

from deltasync import (
    CorruptObjectError,
    DeltasyncError,
    PlanesZstdCodec,
    Publisher,
    PublisherConfig,
    Subscriber,
)
from deltasync.errors import CheckpointError
from deltasync.format import dtypes as ds_dtypes
from deltasync.format.codec import DENSE, FULL, SAME, SPARSE, EncodedChunk
from deltasync.format.digest import DIGEST_SIZE, digest, version_digest
from deltasync.format.manifest import (
    MAX_TENSOR_BYTES,
    ManifestInfo,
    check_relpath,
    key_of,
    manifest_key,
    parse_manifest,
    seal,
)
from deltasync.repo.repository import Repository, blob_key
from deltasync.storage import open_store
from deltasync.v1 import manifest_pb2 as pb

CORPUS = Path(__file__).resolve().parent.parent / "fuzz_corpus"
SECONDS_PER_EXAMPLE = 2.0  # of CPU time (process_time): a bomb burns CPU, a loaded machine only stretches wall time
PEAK_BYTES_PER_EXAMPLE = 64 << 20

U64_EDGES = [0, 1, 7, 8, 255, 256, 4096, 2**31 - 1, 2**32, 2**44, 2**44 + 1, 2**63 - 1, 2**63, 2**64 - 1]
U32_EDGES = [0, 1, 2, 3, 2**31 - 1, 2**32 - 1]
I32_EDGES = [-(2**31), -1, 0, 1, 3, 19, 22, 23, 2**31 - 1]
BAD_PATHS = [
    "", ".", "..", "../x", "../../evil", "/abs", "/", "a/../../b", "a/./b", "a//b", "a/", "a\x00b", "\x00",
    "a\\..\\b", "..\\x", "C:\\x", ".deltasync", ".deltasync/state.json", "x/.deltasync/incoming/y", "a" * 5000,
]
DTYPES = ["", "F32", "BF16", "C128", "BOOL", "U64", "bf16", "F32 ", "\x00", "F8_E4M3", "NOPE"]

#: DELTASYNC_FUZZ_SCALE=N runs N times the examples, randomized (a longer fuzzing campaign).
SCALE = int(os.environ.get("DELTASYNC_FUZZ_SCALE", "1"))
SETTINGS = settings(deadline=None, derandomize=SCALE == 1, suppress_health_check=list(HealthCheck), database=None)


# -- seeds: real manifests of every kind ----------------------------------------------------------


CODEC = PlanesZstdCodec(chunk_bytes=512, exhaustive=True)
LAYOUT = (
    ("a.weight", (24, 16), torch.bfloat16),   # several chunks
    ("a.bias", (16,), torch.float32),
    ("b.weight", (8, 8), torch.bfloat16),
    ("c.scale", (3,), torch.float32),
)


@cache
def _seed_repos() -> tuple[str, str, Path]:
    """A library repository (snapshot, delta) and a directory repository (two shards + side files)."""
    lib = f"memory://fuzz-seeds-{uuid.uuid4().hex}"
    cfg = PublisherConfig(codec=CODEC, workers=2)
    state = make_state(1, LAYOUT)
    pub = Publisher(lib, cfg)
    pub.publish(state, metadata={"step": "1"})
    nxt = step_state(state, 2, fraction=0.05)
    nxt["b.weight"] = step_state({"b": state["b.weight"]}, 3, fraction=1.0)["b"]
    pub.publish(nxt)
    root = Path(tempfile.mkdtemp(prefix="deltasync-fuzz-"))
    atexit.register(shutil.rmtree, root, True)
    write_checkpoint(root / "ckpt", state, shards=2)
    dir_url = str(root / "dir-repo")
    Publisher(dir_url, cfg).publish_dir(root / "ckpt")
    return lib, dir_url, root


@cache
def seeds() -> tuple[bytes, ...]:
    lib, dir_url, _ = _seed_repos()
    out = [open_store(lib).get(manifest_key(v)) for v in (1, 2)]
    out.append(open_store(dir_url).get(manifest_key(1)))
    for data in out:
        parse_manifest(data)  # the seeds themselves are valid
    return tuple(out)


# -- what a consumer relies on in a manifest that passed validation -------------------------------


def assert_safe(info: ManifestInfo) -> None:
    m = info.pb
    paths = [f.path for f in m.files]
    assert len(set(paths)) == len(paths)
    for p in paths:
        assert check_relpath(p) == p
        assert not any(q.startswith(p + "/") for q in paths), f"{p!r} is both a file and a directory"
    files = {f.path: f for f in m.files}
    keys = [key_of(t) for t in m.tensors]
    assert len(set(keys)) == len(keys)
    layout: dict[str, list[pb.Tensor]] = {}
    for t in m.tensors:
        width = ds_dtypes.element_width(t.dtype)
        assert t.nbytes == math.prod(t.shape) * ds_dtypes.itemsize(t.dtype) <= MAX_TENSOR_BYTES
        ranges = info.codec.chunk_ranges(t.nbytes, width) if t.nbytes < 1 << 24 else None
        assert len(t.chunks) == (len(ranges) if ranges is not None else info.codec.chunk_count(t.nbytes, width))
        for c in t.chunks:
            assert len(c.target_digest) == DIGEST_SIZE
            assert c.encoding in (SAME, SPARSE, DENSE, FULL)
            if c.encoding != SAME:
                assert c.pack < len(m.packs) and c.offset + c.length <= m.packs[c.pack].size
        if m.files:
            assert t.file in files and files[t.file].kind == pb.File.SAFETENSORS, f"tensor {t.name!r} has no file"
            layout.setdefault(t.file, []).append(t)
        else:
            assert not t.file
    for path, f in files.items():
        if f.kind != pb.File.SAFETENSORS:
            continue
        assert len(f.header) >= 8 and struct.unpack_from("<Q", f.header)[0] == len(f.header) - 8
        end = 0
        for t in layout.get(path, []):  # in manifest order: the order the file's digest streams in
            assert t.data_offset == end, f"tensor {t.name!r} of {path} at {t.data_offset}, expected {end}"
            end += t.nbytes
        assert f.size == len(f.header) + end, f"{path}: size {f.size}, layout says {len(f.header) + end}"


def check_parse(data: bytes) -> ManifestInfo | None:
    """The manifest property: safe result or CorruptObjectError, bounded time and memory."""
    tracemalloc.start()
    start = time.process_time()  # CPU, not wall time: a loaded machine does not stretch it
    try:
        info = parse_manifest(data)
    except CorruptObjectError:
        info = None
    finally:
        elapsed = time.process_time() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert elapsed < SECONDS_PER_EXAMPLE, f"parse took {elapsed:.2f}s"
    assert peak < PEAK_BYTES_PER_EXAMPLE, f"parse peaked at {peak} bytes"
    if info is not None:
        assert_safe(info)
    return info


# -- byte-level mutations -------------------------------------------------------------------------


@st.composite
def mutated_bytes(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds())))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "overwrite", "delete"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[pos:]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[pos : pos + len(chunk)] = chunk
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 16))]
    return bytes(data)


@settings(SETTINGS, max_examples=300 * SCALE)
@given(st.one_of(mutated_bytes(), st.binary(max_size=512)))
def test_fuzz_manifest_bytes(data: bytes) -> None:
    check_parse(data)


# -- field-level mutations ------------------------------------------------------------------------


Op = Callable[[st.DrawFn, pb.Manifest], None]
OPS: list[Op] = []


def op(fn: Op) -> Op:
    OPS.append(fn)
    return fn


def _tensor(draw: st.DrawFn, m: pb.Manifest) -> pb.Tensor | None:
    return m.tensors[draw(st.integers(0, len(m.tensors) - 1))] if m.tensors else None


def _chunk(draw: st.DrawFn, m: pb.Manifest) -> pb.Chunk | None:
    t = _tensor(draw, m)
    return t.chunks[draw(st.integers(0, len(t.chunks) - 1))] if t is not None and t.chunks else None


def _file(draw: st.DrawFn, m: pb.Manifest) -> pb.File | None:
    return m.files[draw(st.integers(0, len(m.files) - 1))] if m.files else None


def _u64(draw: st.DrawFn) -> int:
    return draw(st.one_of(st.sampled_from(U64_EDGES), st.integers(0, 2**64 - 1), st.integers(0, 4096)))


def _digest(draw: st.DrawFn) -> bytes:
    return draw(st.sampled_from([b"", bytes(15), bytes(16), bytes(17), b"\xff" * 16, bytes(1000)]))


@op
def _shape(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (t := _tensor(draw, m)) is not None:
        dims = draw(st.lists(st.one_of(st.sampled_from(U64_EDGES), st.integers(0, 64)), max_size=70))
        t.ClearField("shape")
        t.shape.extend(dims)
        if draw(st.booleans()) and math.prod(dims) * ds_dtypes.ITEMSIZE.get(t.dtype, 1) < 2**64:
            t.nbytes = math.prod(dims) * ds_dtypes.ITEMSIZE.get(t.dtype, 1)  # consistent, maybe huge


@op
def _nbytes(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (t := _tensor(draw, m)) is not None:
        t.nbytes = _u64(draw)


@op
def _dtype(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (t := _tensor(draw, m)) is not None:
        t.dtype = draw(st.sampled_from(DTYPES))


@op
def _tensor_name(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (t := _tensor(draw, m)) is not None:
        names = ["", "\x00", "x" * 5000, "w@", "w@0", *(u.name for u in m.tensors)]
        t.name = draw(st.sampled_from(names))


@op
def _tensor_file(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (t := _tensor(draw, m)) is not None:
        t.file = draw(st.sampled_from(["", "nope.safetensors", *BAD_PATHS[:8], *(f.path for f in m.files)]))


@op
def _data_offset(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (t := _tensor(draw, m)) is not None:
        t.data_offset = draw(st.one_of(st.sampled_from(U64_EDGES), st.integers(0, 2 * t.nbytes + 8)))


@op
def _slice(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (t := _tensor(draw, m)) is not None:
        t.full_shape.extend(draw(st.lists(st.sampled_from([0, 1, 3, 16, 24, 2**44, 2**64 - 1]), max_size=3)))
        t.slice_offsets.extend(draw(st.lists(st.sampled_from([0, 1, 8, 2**63]), max_size=3)))


@op
def _move_tensor(draw: st.DrawFn, m: pb.Manifest) -> None:
    if len(m.tensors) > 1:
        i, j = draw(st.integers(0, len(m.tensors) - 1)), draw(st.integers(0, len(m.tensors) - 1))
        a, b = pb.Tensor(), pb.Tensor()
        a.CopyFrom(m.tensors[i])
        b.CopyFrom(m.tensors[j])
        if draw(st.booleans()):
            m.tensors[i].CopyFrom(b)
            m.tensors[j].CopyFrom(a)
        else:
            m.tensors[i].CopyFrom(b)  # duplicate


@op
def _many_tensors(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (t := _tensor(draw, m)) is not None:
        for i in range(draw(st.sampled_from([2, 300, 3000]))):
            u = m.tensors.add()
            u.CopyFrom(t)
            u.name = f"{t.name}.copy{i}"


@op
def _chunk_fields(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (c := _chunk(draw, m)) is not None:
        field = draw(st.sampled_from(["pack", "offset", "length", "encoding", "base_digest", "target_digest"]))
        if field == "pack":
            c.pack = draw(st.one_of(st.sampled_from(U32_EDGES), st.integers(0, len(m.packs) + 1)))
        elif field in ("offset", "length"):
            setattr(c, field, _u64(draw))
        elif field == "encoding":
            c.encoding = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 99, 2**31 - 1, -1]))  # type: ignore[assignment]
        else:
            setattr(c, field, _digest(draw))


@op
def _chunk_count(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (t := _tensor(draw, m)) is not None and t.chunks:
        if draw(st.booleans()):
            del t.chunks[draw(st.integers(0, len(t.chunks) - 1))]
        else:
            for _ in range(draw(st.sampled_from([1, 2, 1000]))):
                t.chunks.add().CopyFrom(t.chunks[0])


@op
def _file_path(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (f := _file(draw, m)) is not None:
        others = [g.path for g in m.files if g is not f]
        choices = [*BAD_PATHS, *others, *(o + "/x" for o in others), *(o.rsplit("/", 1)[0] for o in others if "/" in o)]
        old, f.path = f.path, draw(st.sampled_from(choices))
        if draw(st.booleans()):  # keep the tensors pointing at it, so only the path is wrong
            for t in m.tensors:
                if t.file == old:
                    t.file = f.path


@op
def _file_fields(draw: st.DrawFn, m: pb.Manifest) -> None:
    if (f := _file(draw, m)) is not None:
        field = draw(st.sampled_from(["kind", "size", "digest", "header", "blob_parts"]))
        if field == "kind":
            f.kind = draw(st.sampled_from([0, 1, 2, 3, 99]))  # type: ignore[assignment]
        elif field == "size":
            f.size = _u64(draw)
        elif field == "digest":
            f.digest = _digest(draw)
        elif field == "header":
            f.header = draw(st.sampled_from([b"", b"\x00" * 7, b"\x00" * 8, b"\xff" * 8 + b"{}", f.header[:-1],
                                             f.header + b" ", struct.pack("<Q", 2) + b"{}"]))
        else:
            f.blob_parts.append(_digest(draw))


@op
def _packs(draw: st.DrawFn, m: pb.Manifest) -> None:
    field = draw(st.sampled_from(["key", "size", "drop", "add"]))
    if field == "add" or not m.packs:
        m.packs.add(key="packs/" + "0" * 32 + ".pack", size=_u64(draw))
    elif field == "drop":
        del m.packs[-1]
    elif field == "key":
        m.packs[0].key = draw(st.sampled_from(["", "packs/../x.pack", "../packs/x", "/etc/passwd", "packs/" + "A" * 32
                                               + ".pack", "packs/" + "0" * 31 + ".pack", "manifests/" + "0" * 20 + ".pb"]))
    else:
        m.packs[draw(st.integers(0, len(m.packs) - 1))].size = _u64(draw)


@op
def _header_fields(draw: st.DrawFn, m: pb.Manifest) -> None:
    field = draw(st.sampled_from(["format", "version", "kind", "parent", "has_parent", "snapshot", "raw_bytes",
                                  "signature", "signing_key_id"]))
    if field in ("format",):
        m.format = draw(st.sampled_from(U32_EDGES))
    elif field == "kind":
        m.kind = draw(st.sampled_from([0, 1, 2, 3, 2**31 - 1]))  # type: ignore[assignment]
    elif field == "has_parent":
        m.has_parent = not m.has_parent
    elif field in ("signature", "signing_key_id"):
        setattr(m, field, draw(st.binary(max_size=80)))
    else:
        setattr(m, field, _u64(draw))


@op
def _codec(draw: st.DrawFn, m: pb.Manifest) -> None:
    field = draw(st.sampled_from(["name", "codec_version", "zstd_level", "chunk_bytes", "full_zstd_level"]))
    c = m.codec
    if field == "name":
        c.name = draw(st.sampled_from(["", "deltasync.planes-zstd2", "DELTASYNC.PLANES-ZSTD"]))
    elif field == "codec_version":
        c.codec_version = draw(st.sampled_from(U32_EDGES))
    elif field == "chunk_bytes":
        c.chunk_bytes = draw(st.sampled_from([0, 1, 8, 63, 64, 65, 72, 256, 1 << 30, (1 << 30) + 8, 2**64 - 1]))
    else:
        setattr(c, field, draw(st.sampled_from(I32_EDGES)))


def _fix_up(draw: st.DrawFn, m: pb.Manifest) -> None:
    """Repair the cheap cross-checks so the mutation reaches the deeper ones."""
    if draw(st.booleans()):
        raw = sum(t.nbytes for t in m.tensors)
        if raw < 2**64:
            m.raw_bytes = raw
    if draw(st.booleans()):
        m.version_digest = version_digest(c.target_digest for t in m.tensors for c in t.chunks)


@st.composite
def mutated_manifests(draw: st.DrawFn, seed_indices: tuple[int, ...] = (0, 1, 2)) -> bytes:
    m = pb.Manifest()
    m.ParseFromString(seeds()[draw(st.sampled_from(seed_indices))])
    for _ in range(draw(st.integers(1, 3))):
        draw(st.sampled_from(OPS))(draw, m)
    _fix_up(draw, m)
    return seal(m)  # a hostile store recomputes the whole-manifest digest: validation must hold on its own


@settings(SETTINGS, max_examples=400 * SCALE)
@given(mutated_manifests())
def test_fuzz_manifest_fields(data: bytes) -> None:
    check_parse(data)


CORPUS_MANIFESTS = sorted(CORPUS.glob("manifest-*.pb"))


def test_corpus_is_there() -> None:
    assert len(CORPUS_MANIFESTS) >= 5, "the corpus of fixed failures went missing"


@pytest.mark.parametrize("path", CORPUS_MANIFESTS, ids=lambda p: p.stem)
def test_corpus_replays(path: Path, hostile_repo: tuple[Path, Path]) -> None:
    m = pb.Manifest()
    m.ParseFromString(path.read_bytes())
    data = seal(m)  # a hostile store recomputes the whole-manifest digest: refused for what it holds
    with pytest.raises(CorruptObjectError) as refused:
        parse_manifest(data)
    assert "whole-manifest digest" not in str(refused.value)
    repo, sandbox = hostile_repo
    (sandbox / "work").mkdir(exist_ok=True)
    out = sandbox / "work" / f"out-{path.stem}"
    (repo / manifest_key(1)).write_bytes(data)
    with pytest.raises(CorruptObjectError):
        Subscriber(str(repo)).pull_to_dir(out)
    _pull_hostile(repo, sandbox, data, sandbox / f"out-{path.stem}")


# -- chunk payloads -------------------------------------------------------------------------------


@st.composite
def payload_cases(draw: st.DrawFn) -> tuple[EncodedChunk, np.ndarray | None, int, int]:
    width = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(0, 200))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.integers(0, 256, n * width, dtype=np.uint8)
    target = base.copy()
    changed = rng.random(n) < draw(st.sampled_from([0.01, 0.1, 0.5, 1.0]))
    target.reshape(n, width)[changed] = rng.integers(0, 256, (int(changed.sum()), width), dtype=np.uint8)
    use_base = draw(st.booleans())
    enc = PlanesZstdCodec(chunk_bytes=4096, exhaustive=True).encode(target, base if use_base else None, width)
    payload = bytearray(enc.payload)
    encoding = draw(st.sampled_from([enc.encoding, enc.encoding, SAME, SPARSE, DENSE, FULL, 0, 7]))
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["flip", "truncate", "u64", "byte", "random"]))
        pos = draw(st.integers(0, max(len(payload) - 1, 0)))
        if kind == "flip" and payload:
            payload[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del payload[pos:]
        elif kind == "u64" and len(payload) >= 8:
            at = draw(st.sampled_from([p for p in (4, 12, 20) if p + 8 <= len(payload)] or [0]))
            payload[at : at + 8] = struct.pack("<Q", draw(st.sampled_from([*U64_EDGES, n, n + 1, len(payload)])))
        elif kind == "byte" and payload:
            payload[draw(st.integers(0, min(3, len(payload) - 1)))] = draw(st.integers(0, 255))
        elif kind == "random":
            payload = bytearray(draw(st.binary(max_size=64)))
    nbytes = draw(st.sampled_from([n * width, n * width, max(n - 1, 0) * width, (n + 1) * width, n * width + 1]))
    base_arg = draw(st.sampled_from([base, base, None, base[: len(base) // 2]]))
    return EncodedChunk(encoding, bytes(payload)), base_arg, width, nbytes  # type: ignore[arg-type]


@settings(SETTINGS, max_examples=400 * SCALE)
@given(payload_cases())
def test_fuzz_chunk_decoder(case: tuple[EncodedChunk, np.ndarray | None, int, int]) -> None:
    chunk, base, width, nbytes = case
    start = time.process_time()  # CPU, not wall time: a loaded machine does not stretch it
    try:
        out = CODEC.decode(chunk, base, width, nbytes)
    except CorruptObjectError:
        return
    finally:
        assert time.process_time() - start < SECONDS_PER_EXAMPLE
    assert isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1 and len(out) == nbytes


@settings(SETTINGS, max_examples=100 * SCALE)
@given(st.one_of(st.binary(max_size=64), st.builds(lambda b, cut: _zstd_blob(b)[:cut], st.binary(max_size=64),
                                                   st.integers(0, 80))))
def test_fuzz_blob_decoder(packed: bytes) -> None:
    repo = _blob_repo()
    d = digest(b"expected")
    repo.store.put(blob_key(d), packed)
    try:
        data = repo.get_blob(d)
    except CorruptObjectError:
        return
    assert data == b"expected"


def _zstd_blob(data: bytes) -> bytes:
    import zstandard

    return bytes(zstandard.ZstdCompressor(write_content_size=True).compress(data))


@cache
def _blob_repo() -> Repository:
    return Repository(f"memory://fuzz-blobs-{uuid.uuid4().hex}")


# -- hostile repositories, end to end -------------------------------------------------------------


def _tree(root: Path) -> dict[str, tuple[int, float]]:
    out: dict[str, tuple[int, float]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            p = Path(dirpath) / name
            st_ = p.lstat()
            out[p.relative_to(root).as_posix()] = (st_.st_size, st_.st_mtime)
    return out


@pytest.fixture(scope="module")
def hostile_repo() -> Iterator[tuple[Path, Path]]:
    """A copy of the directory seed repository inside a sandbox, and the sandbox."""
    _, dir_url, _ = _seed_repos()
    sandbox = Path(tempfile.mkdtemp(prefix="deltasync-hostile-"))
    (sandbox / "outside").mkdir()
    (sandbox / "outside" / "victim.txt").write_text("keep me")
    shutil.copytree(dir_url, sandbox / "repo")
    yield sandbox / "repo", sandbox
    shutil.rmtree(sandbox, ignore_errors=True)


def _pull_hostile(repo: Path, sandbox: Path, manifest: bytes, out: Path) -> None:
    """Commit ``manifest`` as version 1 by writing the file directly, then pull it into ``out``."""
    (repo / manifest_key(1)).write_bytes(manifest)
    before = {k: v for k, v in _tree(sandbox).items() if not k.startswith(("repo/", out.name))}
    try:
        Subscriber(str(repo), workers=2).pull_to_dir(out)
    except DeltasyncError:
        pass
    else:  # accepted: every file written is the one the manifest describes, byte for byte
        info = parse_manifest(manifest)
        for f in info.pb.files:
            data = (out / f.path).read_bytes()
            assert digest(data) == f.digest, f"{f.path} does not match its digest"
    after = {k: v for k, v in _tree(sandbox).items() if not k.startswith(("repo/", out.name))}
    assert after == before, "a pull wrote outside its output directory"


def test_hostile_manifest_cannot_write_outside_the_output_dir(hostile_repo: tuple[Path, Path]) -> None:
    repo, sandbox = hostile_repo
    m = pb.Manifest()
    m.ParseFromString(seeds()[2])
    victim = next(f for f in m.files if f.kind == pb.File.BLOB)
    victim.path = "../../outside/evil"
    (sandbox / "work").mkdir(exist_ok=True)
    out = sandbox / "work" / "out"
    (repo / manifest_key(1)).write_bytes(seal(m))  # digest recomputed: the path check must refuse it
    with pytest.raises(CorruptObjectError, match=re.escape("unsafe file path '../../outside/evil'")):
        Subscriber(str(repo)).pull_to_dir(out)
    assert not (sandbox / "outside" / "evil").exists() and not (sandbox / "evil").exists()
    assert not [p for p in out.rglob("*") if p.is_file()]


@settings(SETTINGS, max_examples=60 * SCALE)
@given(data=mutated_manifests(seed_indices=(2,)))
def test_fuzz_pull_from_hostile_repository(hostile_repo: tuple[Path, Path], data: bytes) -> None:
    repo, sandbox = hostile_repo
    _pull_hostile(repo, sandbox, data, sandbox / f"out-{uuid.uuid4().hex[:8]}")


def test_symlink_in_output_dir_is_refused(hostile_repo: tuple[Path, Path], tmp_path: Path) -> None:
    repo, _ = hostile_repo
    (repo / manifest_key(1)).write_bytes(seeds()[2])
    info = parse_manifest(seeds()[2])
    nested = next(f.path for f in info.pb.files if "/" in f.path)
    out = tmp_path / "out"
    outside = tmp_path / "outside"
    outside.mkdir()
    (out / nested.split("/")[0]).parent.mkdir(parents=True)
    (out / nested.split("/")[0]).symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic link"):
        Subscriber(str(repo)).pull_to_dir(out)
    assert list(outside.iterdir()) == []
    assert not [p for p in out.rglob("*") if p.is_file() and ".deltasync" not in p.parts]

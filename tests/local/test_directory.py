"""Checkpoint directories end to end: Publisher.publish_dir and Subscriber.pull_to_dir.

Every round trip is checked byte for byte (sha256 of every file, same file set), across
snapshots and deltas, single-file and sharded checkpoints, with side files, and through
the failure paths: wrong base, stale cache, corrupt packs, corrupt inputs, damaged copies.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_helpers import (
    INDEX_NAME,
    State,
    make_state,
    safetensors_metadata,
    sha256_file,
    step_state,
    tree_digests,
    write_checkpoint,
    write_safetensors,
)

import deltasync.publish.publisher
import deltasync.repo.repository
from deltasync import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptObjectError,
    PlanesZstdCodec,
    Publisher,
    PublisherConfig,
    Repository,
    Subscriber,
    VersionNotFoundError,
)
from deltasync.local.cache import CachedStore
from deltasync.local.state import StateDB, read_local_state
from deltasync.pull.pipeline import ChunkPipeline
from deltasync.storage import LocalStore

CHUNK = 16 << 10  # several chunks per tensor, so chunk-level paths are exercised


def config(**kw: object) -> PublisherConfig:
    return PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=CHUNK), workers=2, progress=False, **kw)  # type: ignore[arg-type]



def snapshot_and_delta(tmp_path: Path) -> tuple[list[Path], Path]:
    """Two checkpoints published into tmp_path/repo: version 1 a snapshot, version 2 a delta."""
    ckpts = make_versions(tmp_path / "ckpt", 2)
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config())
    pub.publish_dir(ckpts[0])
    pub.publish_dir(ckpts[1], base_dir=ckpts[0])
    return ckpts, repo

def subscriber(repo: Path | str | Repository) -> Subscriber:
    return Subscriber(repo if isinstance(repo, Repository) else str(repo), workers=2, progress=False)


def all_paths(root: Path) -> set[str]:
    """Every file and directory under ``root``, including deltasync's state directory."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def outside_state(paths: set[str]) -> set[str]:
    return {p for p in paths if p != ".deltasync" and not p.startswith(".deltasync/")}


def kinds(repo: Path) -> list[str]:
    r = Repository(str(repo))
    return ["snapshot" if r.manifest(v).is_snapshot else "delta" for v in r.versions()]


def make_versions(root: Path, n: int, *, shards: int = 1, fraction: float = 0.01) -> list[Path]:
    """``n`` checkpoints of one training run, step-1..step-n, ~``fraction`` of elements changing per step.

    Step 2 carries an extra file the others lack, and step 3 is sharded one way more than
    the rest (when sharded), so file sets differ between versions.
    """
    state: State = make_state(seed=0)
    out: list[Path] = []
    for step in range(1, n + 1):
        if step > 1:
            state = step_state(state, seed=step, fraction=fraction)
        ckpt = root / f"step-{step}"
        n_shards = shards + 1 if shards > 1 and step == 3 else shards
        write_checkpoint(ckpt, state, shards=n_shards, metadata={"step": str(step)}, step=step)
        if step == 2:
            (ckpt / "rng_state.json").write_text(json.dumps({"seed": 1234}))
        out.append(ckpt)
    return out


# -- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 3], ids=["single", "sharded"])
@pytest.mark.parametrize("source", ["cache_dir", "base_dir"])
def test_round_trip_every_version_in_any_order(tmp_path: Path, shards: int, source: str) -> None:
    ckpts = make_versions(tmp_path / "ckpt", 4, shards=shards)
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config())
    cache = tmp_path / "cache"
    for i, ckpt in enumerate(ckpts):
        if source == "cache_dir":
            r = pub.publish_dir(ckpt, cache_dir=cache)
        else:
            r = pub.publish_dir(ckpt, base_dir=ckpts[i - 1] if i else None)
        assert r == i + 1 and r.version == i + 1 and isinstance(r, int)
        if i:  # ~1% of elements changed: deltas are far smaller than the snapshot
            assert r.kind == "delta" and r.parent == i
            assert r.stored_bytes < r.raw_bytes / 3
    assert kinds(repo) == ["snapshot", "delta", "delta", "delta"]
    if source == "cache_dir":
        assert tree_digests(cache) == tree_digests(ckpts[-1])
        state = read_local_state(cache)
        assert state is not None and state.version == 4

    out = tmp_path / "serving"
    (out / "user").mkdir(parents=True)
    (out / "user" / "notes.txt").write_text("not deltasync's")
    (out / "README.local").write_text("mine")
    mine = {"user/notes.txt", "README.local"}
    sub = subscriber(repo)
    for v in [4, 1, 3, 2, 2, 4, 1, 2, 3]:
        assert sub.pull_to_dir(out, v) == v
        expected = tree_digests(ckpts[v - 1])
        got = tree_digests(out)
        assert {k: d for k, d in got.items() if k not in mine} == expected, f"version {v}"
        assert set(got) == set(expected) | mine  # older versions' extra files are gone, the user's stay
        for rel in expected:
            if rel.endswith(".safetensors"):
                assert safetensors_metadata(out / rel) == {"format": "pt", "step": str(v)}
        assert not (out / ".deltasync" / "incoming").exists()
        state = read_local_state(out)
        assert state is not None and state.version == v
    assert (out / "user" / "notes.txt").read_text() == "not deltasync's"


def test_pull_latest_into_fresh_directory_and_nested_files(tmp_path: Path) -> None:
    ckpts = make_versions(tmp_path / "ckpt", 2, shards=2)
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config())
    pub.publish_dir(ckpts[0])
    pub.publish_dir(ckpts[1], base_dir=ckpts[0])
    out = tmp_path / "a" / "b" / "fresh"  # parents are created
    assert subscriber(repo).pull_to_dir(out) == 2
    digests = tree_digests(out)
    assert digests == tree_digests(ckpts[1])
    assert "extra/deep/notes.txt" in digests and INDEX_NAME in digests
    # Loading the result with the safetensors package gives the published tensors.
    from safetensors.torch import load_file

    loaded: dict[str, torch.Tensor] = {}
    for rel in digests:
        if rel.endswith(".safetensors"):
            loaded.update(load_file(str(out / rel)))
    original: dict[str, torch.Tensor] = {}
    for rel in digests:
        if rel.endswith(".safetensors"):
            original.update(load_file(str(ckpts[1] / rel)))
    assert loaded.keys() == original.keys()
    for k in loaded:
        assert torch.equal(loaded[k].view(torch.uint8), original[k].view(torch.uint8))


def test_same_version_again_fetches_nothing(tmp_path: Path) -> None:
    ckpts, repo = snapshot_and_delta(tmp_path)
    out = tmp_path / "out"
    sub = subscriber(repo)
    sub.pull_to_dir(out, 1)
    store = CachedStore(LocalStore(str(repo)))
    result = Subscriber(Repository(store), progress=False).update_dir(out, 2)
    assert result.rebuilt == 0 and result.walked > 0  # incremental: only the delta is fetched, applied in place
    assert store.fetched.get("packs", 0) <= Repository(str(repo)).manifest(2).pb.stored_bytes - _blob_bytes(repo, 2)
    store = CachedStore(LocalStore(str(repo)))
    assert Subscriber(Repository(store), progress=False).update_dir(out, 2).held
    assert store.fetched.get("packs", 0) == 0
    assert tree_digests(out) == tree_digests(ckpts[1])


def _blob_bytes(repo: Path, version: int) -> int:
    """Stored bytes of the blobs first written by ``version`` (zero when all were deduplicated)."""
    r = Repository(str(repo))
    stored = r.manifest(version).pb.stored_bytes
    packs = sum(p.size for p in r.manifest(version).pb.packs)
    return stored - packs


def test_odd_tensors_round_trip(tmp_path: Path) -> None:
    """Scalars, empty tensors, and every common dtype, including bit patterns floats would lose."""
    bits = np.array([0x0000, 0x8000, 0x7FC1, 0xFFFF, 0x7F80, 0x0001], dtype=np.uint16)
    state = {
        "scalar": torch.tensor(3.5, dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "nan_payloads": torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16),
        "ids": torch.arange(1000, dtype=torch.int64),
        "mask": torch.arange(77) % 3 == 0,
        "half": torch.linspace(-2, 2, 999, dtype=torch.float16),
        "double": torch.linspace(-2, 2, 3001, dtype=torch.float64),
        "bytes": torch.arange(4096, dtype=torch.uint8),
        "fp8": torch.linspace(-1, 1, 300).to(torch.float8_e4m3fn),
    }
    v1 = tmp_path / "v1"
    write_checkpoint(v1, state, metadata={"note": "odd"}, side_files=False)
    state2 = dict(state)
    state2["ids"] = state["ids"] + (torch.arange(1000) % 97 == 0).to(torch.int64)
    state2["double"] = state["double"] * 1.0000001
    v2 = tmp_path / "v2"
    write_checkpoint(v2, state2, metadata={"note": "odd"}, side_files=False)
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config())
    pub.publish_dir(v1)
    pub.publish_dir(v2, base_dir=v1)
    out = tmp_path / "out"
    for v, src in [(1, v1), (2, v2), (1, v1)]:
        subscriber(repo).pull_to_dir(out, v)
        assert tree_digests(out) == tree_digests(src)


def test_single_safetensors_file_as_input(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "ckpt" / "weights.safetensors", make_state(1), {"format": "pt"})
    (tmp_path / "ckpt" / "ignored.json").write_text("{}")  # only the named file is published
    repo = tmp_path / "repo"
    Publisher(str(repo), config()).publish_dir(path)
    out = tmp_path / "out"
    subscriber(repo).pull_to_dir(out)
    assert tree_digests(out) == {"weights.safetensors": sha256_file(path)}


def test_library_version_pulls_to_model_safetensors(tmp_path: Path) -> None:
    state = make_state(3)
    repo = tmp_path / "repo"
    Publisher(str(repo), config()).publish(state)
    out = tmp_path / "out"
    subscriber(repo).pull_to_dir(out)
    from safetensors.torch import load_file

    assert sorted(tree_digests(out)) == ["model.safetensors"]
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded.keys() == state.keys()
    for k, t in state.items():
        assert torch.equal(loaded[k].view(torch.uint8), t.view(torch.uint8))


# -- blobs ----------------------------------------------------------------------------------------


def test_blobs_are_deduplicated_across_versions(tmp_path: Path) -> None:
    ckpts = make_versions(tmp_path / "ckpt", 3)
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config())
    cache = tmp_path / "cache"
    for ckpt in ckpts:
        pub.publish_dir(ckpt, cache_dir=cache)
    blob_contents = {
        sha256_file(ckpt / rel)
        for ckpt in ckpts
        for rel in tree_digests(ckpt)
        if not rel.endswith(".safetensors")
    }
    stored = [p for p in (repo / "blobs").iterdir() if p.is_file()]
    assert len(stored) == len(blob_contents)  # config.json and tokenizer.json stored once
    # config.json and tokenizer.json are unchanged: every manifest names the same blob.
    r = Repository(str(repo))
    for name in ("config.json", "tokenizer.json"):
        parts = {
            tuple(f.blob_parts) for v in r.versions() for f in r.manifest(v).pb.files if f.path == name
        }
        assert len(parts) == 1
    # Versions 2 and 3 stored only their changed side files.
    assert _blob_bytes(repo, 3) < (ckpts[2] / "tokenizer.json").stat().st_size


def test_blob_spanning_several_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    part = 64 << 10
    monkeypatch.setattr(deltasync.repo.repository, "BLOB_PART_BYTES", part)
    monkeypatch.setattr(deltasync.publish.publisher, "BLOB_PART_BYTES", part)  # the publisher's copy of the name
    rng = np.random.default_rng(7)
    payload = rng.integers(0, 256, 5 * part + 123, dtype=np.uint8).tobytes()
    v1 = write_checkpoint(tmp_path / "v1", make_state(0), side_files=False)
    (v1 / "tokenizer.model").write_bytes(payload)
    (v1 / "empty.txt").write_bytes(b"")
    changed = bytearray(payload)
    changed[-10] ^= 0xFF  # only the last part differs
    v2 = write_checkpoint(tmp_path / "v2", make_state(0), side_files=False)
    (v2 / "tokenizer.model").write_bytes(bytes(changed))
    (v2 / "empty.txt").write_bytes(b"")
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config())
    pub.publish_dir(v1)
    blobs_after_v1 = len(list((repo / "blobs").iterdir()))
    pub.publish_dir(v2, base_dir=v1)
    r = Repository(str(repo))
    files = {f.path: f for f in r.manifest(1).pb.files}
    assert len(files["tokenizer.model"].blob_parts) == 6
    assert files["tokenizer.model"].size == len(payload)
    assert len(files["empty.txt"].blob_parts) == 0
    assert len(list((repo / "blobs").iterdir())) == blobs_after_v1 + 1  # one new part
    out = tmp_path / "out"
    for v, src in [(1, v1), (2, v2), (1, v1)]:
        subscriber(repo).pull_to_dir(out, v)
        assert tree_digests(out) == tree_digests(src)


# -- where the base comes from ---------------------------------------------------------------------


def test_wrong_base_dir_is_refused_and_nothing_is_committed(tmp_path: Path) -> None:
    ckpts = make_versions(tmp_path / "ckpt", 3)
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config())
    pub.publish_dir(ckpts[0])
    pub.publish_dir(ckpts[1], base_dir=ckpts[0])
    before = all_paths(repo / "manifests") | all_paths(repo / "packs")
    latest_ref = (repo / "refs" / "latest").read_bytes()
    with pytest.raises(CheckpointError, match=r"base copy of chunk \d+ does not match the parent version"):
        pub.publish_dir(ckpts[2], base_dir=ckpts[0])  # the latest version is 2, not 1
    assert Repository(str(repo)).versions() == [1, 2]
    assert (repo / "refs" / "latest").read_bytes() == latest_ref
    assert all_paths(repo / "manifests") | all_paths(repo / "packs") == before  # abandoned packs removed
    # A base directory without the parent's files is refused too.
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"base directory lacks model\.safetensors of version 2"):
        pub.publish_dir(ckpts[2], base_dir=tmp_path / "empty")
    assert Repository(str(repo)).versions() == [1, 2]
    # With the right base it goes through.
    assert pub.publish_dir(ckpts[2], base_dir=ckpts[1]) == 3
    out = tmp_path / "out"
    subscriber(repo).pull_to_dir(out)
    assert tree_digests(out) == tree_digests(ckpts[2])


def test_stale_cache_is_brought_forward(tmp_path: Path) -> None:
    ckpts = make_versions(tmp_path / "ckpt", 4)
    repo = tmp_path / "repo"
    cache_a, cache_b = tmp_path / "cache-a", tmp_path / "cache-b"
    Publisher(str(repo), config()).publish_dir(ckpts[0], cache_dir=cache_a)
    # An empty cache is filled from the repository first, then diffed against.
    Publisher(str(repo), config()).publish_dir(ckpts[1], cache_dir=cache_b)
    state = read_local_state(cache_a)
    assert state is not None and state.version == 1  # now stale: the latest is 2
    pub = Publisher(str(repo), config())
    result = pub.publish_dir(ckpts[2], cache_dir=cache_a)
    assert result == 3 and result.kind == "delta"
    state = read_local_state(cache_a)
    assert state is not None and state.version == 3
    assert tree_digests(cache_a) == tree_digests(ckpts[2])
    assert kinds(repo) == ["snapshot", "delta", "delta"]
    # A cache without deltasync state (someone's files) is rebuilt, not trusted.
    junk = tmp_path / "cache-c"
    write_checkpoint(junk, make_state(99))
    assert Publisher(str(repo), config()).publish_dir(ckpts[3], cache_dir=junk) == 4
    assert kinds(repo)[-1] == "delta"
    assert tree_digests(junk) == tree_digests(ckpts[3])
    out = tmp_path / "out"
    for v in (3, 4):
        subscriber(repo).pull_to_dir(out, v)
        assert tree_digests(out) == tree_digests(ckpts[v - 1])


# -- corruption -----------------------------------------------------------------------------------


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("target", ["delta", "snapshot"])
def test_corrupt_pack_leaves_out_dir_untouched(tmp_path: Path, target: str) -> None:
    ckpts, repo = snapshot_and_delta(tmp_path)
    r = Repository(str(repo))
    version = 2 if target == "delta" else 1
    packs = r.manifest(version).pb.packs
    assert len(packs) == 1
    out = tmp_path / "out"
    if target == "delta":
        subscriber(repo).pull_to_dir(out, 1)
    else:
        (out / "keep.txt").parent.mkdir(parents=True)
        (out / "keep.txt").write_text("keep")
    before_digests = tree_digests(out)
    before_state = read_local_state(out)
    before_paths = all_paths(out)
    _flip_middle_byte(repo / packs[0].key)

    with pytest.raises((ChecksumMismatchError, CorruptObjectError)) as info:
        subscriber(repo).pull_to_dir(out, version)
    msg = str(info.value)
    assert f"version {version}" in msg and "tensor '" in msg and "chunk " in msg, msg
    if isinstance(info.value, ChecksumMismatchError):
        assert info.value.version == version and info.value.chunk >= 0
    assert tree_digests(out) == before_digests and read_local_state(out) == before_state
    # Nothing changed outside the state directory (which keeps the staged work for a retry).
    assert outside_state(all_paths(out)) == outside_state(before_paths)
    # A pull of a version that does not need the bad pack still works.
    if target == "delta":
        subscriber(repo).pull_to_dir(out, 1)
        assert tree_digests(out) == tree_digests(ckpts[0])


def test_corrupt_blob_leaves_out_dir_untouched(tmp_path: Path) -> None:
    _, repo = snapshot_and_delta(tmp_path)
    out = tmp_path / "out"
    subscriber(repo).pull_to_dir(out, 1)
    before = tree_digests(out)
    r = Repository(str(repo))
    f = next(f for f in r.manifest(2).pb.files if f.path == "generation_config.json")
    blob = repo / "blobs" / f.blob_parts[0].hex()
    blob.write_bytes(b"\x00" + blob.read_bytes()[1:])
    with pytest.raises(CorruptObjectError, match=f"blobs/{f.blob_parts[0].hex()}"):
        subscriber(repo).pull_to_dir(out, 2)
    assert tree_digests(out) == before
    state = read_local_state(out)
    assert state is not None and state.version == 1


def test_missing_version(tmp_path: Path) -> None:
    ckpts = make_versions(tmp_path / "ckpt", 1)
    repo = tmp_path / "repo"
    Publisher(str(repo), config()).publish_dir(ckpts[0])
    with pytest.raises(VersionNotFoundError, match="version 7 not found"):
        subscriber(repo).pull_to_dir(tmp_path / "out", 7)


# -- bad inputs -----------------------------------------------------------------------------------


def _raw_safetensors(path: Path, header: bytes, data: bytes, *, hlen: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header) if hlen is None else hlen) + header + data)
    return path


def _header(entries: dict[str, object]) -> bytes:
    return json.dumps(entries).encode()


def _bad_garbage(d: Path) -> Path:
    return _raw_safetensors(d / "model.safetensors", b"{not json at all", b"")


def _bad_header_length(d: Path) -> Path:
    return _raw_safetensors(d / "model.safetensors", b"{}", b"", hlen=1 << 20)


def _bad_offsets_gap(d: Path) -> Path:
    h = _header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}})
    return _raw_safetensors(d / "model.safetensors", h, bytes(24))


def _bad_offsets_size(d: Path) -> Path:
    h = _header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}})
    return _raw_safetensors(d / "model.safetensors", h, bytes(8))


def _bad_truncated(d: Path) -> Path:
    path = write_safetensors(d / "model.safetensors", make_state(0))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    return path


def _bad_dtype(d: Path) -> Path:
    h = _header({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}})
    return _raw_safetensors(d / "model.safetensors", h, bytes(2))


def _bad_not_object(d: Path) -> Path:
    return _raw_safetensors(d / "model.safetensors", b"[1, 2]  ", b"")


def _bad_tiny(d: Path) -> Path:
    path = d / "model.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x01\x02")
    return path


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (_bad_garbage, "not JSON"),
        (_bad_header_length, "corrupt safetensors header"),
        (_bad_offsets_gap, "does not start at"),
        (_bad_offsets_size, "has 8 bytes, shape says 16"),
        (_bad_truncated, "truncated or padded"),
        (_bad_dtype, "unsupported dtype"),
        (_bad_not_object, "not a JSON object"),
        (_bad_tiny, "not a safetensors file"),
    ],
    ids=["garbage-json", "header-too-long", "offset-gap", "offset-size", "truncated", "dtype", "json-list",
         "tiny"],
)
def test_corrupt_safetensors_is_refused(
    tmp_path: Path, make: Callable[[Path], Path], pattern: str
) -> None:
    ckpt = tmp_path / "ckpt"
    bad = make(ckpt)
    (ckpt / "config.json").write_text("{}")
    repo = tmp_path / "repo"
    with pytest.raises(CheckpointError, match=pattern) as info:
        Publisher(str(repo), config()).publish_dir(ckpt)
    assert info.value.path == str(bad) and str(bad) in str(info.value)
    assert not repo.exists()  # refused before anything was written


def test_missing_and_empty_directories(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config())
    with pytest.raises(CheckpointError, match="no such checkpoint directory") as info:
        pub.publish_dir(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no \.safetensors files") as info:
        pub.publish_dir(tmp_path / "plain")
    assert str(tmp_path / "plain") in str(info.value)
    with pytest.raises(CheckpointError, match=r"not a checkpoint directory or \.safetensors file"):
        pub.publish_dir(tmp_path / "plain" / "config.json")
    assert not repo.exists()


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", make_state(0), shards=3)
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing shard\(s\): model-00002-of-00003.safetensors") as info:
        Publisher(str(tmp_path / "repo"), config()).publish_dir(ckpt)
    assert str(ckpt / INDEX_NAME) in str(info.value)
    (ckpt / INDEX_NAME).write_text("{garbage")
    with pytest.raises(CheckpointError, match="corrupt index"):
        Publisher(str(tmp_path / "repo"), config()).publish_dir(ckpt)


def test_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    write_safetensors(ckpt / "a.safetensors", {"w": torch.zeros(4)})
    write_safetensors(ckpt / "b.safetensors", {"w": torch.ones(4)})
    with pytest.raises(CheckpointError, match=r"tensor 'w' is in both a\.safetensors and b\.safetensors"):
        Publisher(str(tmp_path / "repo"), config()).publish_dir(ckpt)


# -- repair of a damaged local copy ------------------------------------------------------------------


def _damage(path: Path, offset: int, n: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        chunk = bytearray(f.read(n))
        for i in range(len(chunk)):
            chunk[i] ^= 0xA5
        f.seek(offset)
        f.write(bytes(chunk))


@pytest.mark.parametrize("shards", [1, 2], ids=["single", "sharded"])
def test_incremental_pull_repairs_damaged_copy(tmp_path: Path, shards: int) -> None:
    ckpts = make_versions(tmp_path / "ckpt", 3, shards=shards)
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config())
    cache = tmp_path / "cache"
    for ckpt in ckpts:
        pub.publish_dir(ckpt, cache_dir=cache)
    out = tmp_path / "out"
    sub = subscriber(repo)
    sub.pull_to_dir(out, 1)
    weights = sorted(p for p in out.iterdir() if p.suffix == ".safetensors")
    size = weights[0].stat().st_size
    _damage(weights[0], size // 2)  # a chunk in the middle of the data
    _damage(weights[0], 9)  # and the header
    _damage(weights[-1], weights[-1].stat().st_size - 64)  # and the very end
    (out / "config.json").write_text("tampered")
    filled = sub.update_dir(out, 2)
    assert tree_digests(out) == tree_digests(ckpts[1])
    assert filled.plan_base == 1  # incremental, with the damaged chunks rebuilt

    # Truncated and missing files are rebuilt as well.
    with open(weights[0], "r+b") as f:
        f.truncate(size // 3)
    if shards > 1:
        weights[-1].unlink()
    sub.pull_to_dir(out, 3)
    assert tree_digests(out) == tree_digests(ckpts[2])


@pytest.mark.parametrize("where", ["walk", "rebuild"])
def test_pull_after_interrupted_pull(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A pull that dies halfway (walking chunks in place, or rebuilding them) leaves the
    served version untouched; the slot it was writing is marked dirty, and the next pull
    hashes its chunks and resumes to the exact target."""
    from deltasync.local import slotfill

    ckpts = make_versions(tmp_path / "ckpt", 3)
    repo = tmp_path / "repo"
    for ckpt in ckpts:
        Publisher(str(repo), config()).publish_dir(ckpt)
    out = tmp_path / "out"
    # "walk": both slots in use, so the next pull walks the slot of version 1 in place.
    # "rebuild": a first pull, filled through the chunk pipeline.
    for v in (1, 2) if where == "walk" else ():
        subscriber(repo).pull_to_dir(out, v)
    before = tree_digests(out) if where == "walk" else {}

    calls = 0
    real = slotfill._Fill._walk if where == "walk" else ChunkPipeline.apply_steps

    def dying(self: object, *args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    if where == "walk":
        monkeypatch.setattr(slotfill._Fill, "_walk", dying)
    else:
        monkeypatch.setattr(ChunkPipeline, "apply_steps", dying)
    with pytest.raises(KeyboardInterrupt):
        subscriber(repo).pull_to_dir(out, 3)
    assert tree_digests(out) == before
    state = read_local_state(out)
    db = StateDB.open(out)
    assert db is not None
    record = db.slots()
    assert record is not None
    if where == "walk":
        assert state is not None and state.version == 2 and record.active is not None
        idle = "1" if record.active == "0" else "0"
        assert record.info(idle).version is None and record.info(idle).source == 1  # dirty, was version 1
    else:
        assert state is None and record.active is None and record.info("0").version is None
    monkeypatch.undo()
    result = subscriber(repo).update_dir(out, 3)
    assert tree_digests(out) == tree_digests(ckpts[2])
    assert result.walked + result.skipped + result.rebuilt > 0
    assert sorted(os.listdir(out / ".deltasync")) == ["current", "lock", "slots", "state.lmdb"]


def test_flipped_byte_is_a_checksum_mismatch_naming_tensor_and_chunk(tmp_path: Path) -> None:
    # Random bytes do not compress, so zstd stores them verbatim and a flipped byte decodes
    # cleanly to wrong bits: only the chunk digest can catch it.
    rng = np.random.default_rng(0)
    noise = torch.from_numpy(rng.integers(0, 256, 4 * CHUNK, dtype=np.uint8))
    v1 = write_checkpoint(tmp_path / "v1", {"noise": noise}, side_files=False)
    repo = tmp_path / "repo"
    Publisher(str(repo), config()).publish_dir(v1)
    pack = repo / Repository(str(repo)).manifest(1).pb.packs[0].key
    data = bytearray(pack.read_bytes())
    data[len(data) * 5 // 8] ^= 0x01  # inside chunk 2 of 4
    pack.write_bytes(bytes(data))
    out = tmp_path / "out"
    with pytest.raises(ChecksumMismatchError) as info:
        subscriber(repo).pull_to_dir(out)
    assert (info.value.version, info.value.tensor, info.value.chunk) == (1, "noise", 2)
    assert "checksum mismatch in version 1, tensor 'noise', chunk 2" in str(info.value)
    assert not (out / "model.safetensors").exists()


def test_damaged_cache_at_latest_is_refused(tmp_path: Path) -> None:
    ckpts = make_versions(tmp_path / "ckpt", 3)
    repo = tmp_path / "repo"
    cache = tmp_path / "cache"
    pub = Publisher(str(repo), config())
    pub.publish_dir(ckpts[0], cache_dir=cache)
    pub.publish_dir(ckpts[1], cache_dir=cache)
    _damage(cache / "model.safetensors", (cache / "model.safetensors").stat().st_size // 2)
    with pytest.raises(CheckpointError, match="does not match the parent version"):
        pub.publish_dir(ckpts[2], cache_dir=cache)
    assert Repository(str(repo)).versions() == [1, 2]
    # Bringing the cache back with a pull repairs it, and publishing goes on as a delta.
    subscriber(repo).pull_to_dir(cache)
    assert pub.publish_dir(ckpts[2], cache_dir=cache) == 3
    assert kinds(repo) == ["snapshot", "delta", "delta"]


def test_publish_a_pulled_directory(tmp_path: Path) -> None:
    """A directory deltasync pulled into (with its state dir) publishes like any checkpoint."""
    ckpts = make_versions(tmp_path / "ckpt", 1, shards=2)
    repo = tmp_path / "repo"
    Publisher(str(repo), config()).publish_dir(ckpts[0])
    out = tmp_path / "out"
    subscriber(repo).pull_to_dir(out)
    (out / "added by hand.txt").write_text("ünïcode ok")
    mirror = tmp_path / "mirror"
    Publisher(str(mirror), config()).publish_dir(out)
    again = tmp_path / "again"
    subscriber(mirror).pull_to_dir(again)
    assert tree_digests(again) == tree_digests(out)
    assert "added by hand.txt" in tree_digests(again)


def test_changing_layouts_and_snapshot_policy(tmp_path: Path) -> None:
    """Tensors added, removed, resized, retyped and moved between (nested) files; large
    changes and ``snapshot_every`` turn versions into snapshots; every version still round-trips."""
    s1 = make_state(0)
    s2 = step_state(s1, seed=2)
    del s2["model.layers.1.mlp.up_proj.weight"]  # removed
    s2["model.layers.2.new.weight"] = torch.ones(33, 7, dtype=torch.bfloat16)  # added
    s2["model.norm.weight"] = s2["model.norm.weight"].to(torch.bfloat16)  # retyped
    s2["lm_head.weight"] = s1["lm_head.weight"][:500].clone()  # resized
    # Every bit pattern changes: a delta would not pay, so v3 is stored as a snapshot.
    fresh = make_state(77, [(n, tuple(t.shape), t.dtype) for n, t in s2.items()])
    s3 = {n: fresh[n] for n in s2}
    s4 = step_state(s3, seed=4)
    ckpts = []
    for i, s in enumerate([s1, s2, s3, s4]):
        root = tmp_path / f"v{i + 1}"
        names = sorted(s)
        # Nested safetensors files, split differently in every version.
        write_safetensors(root / "weights" / "a.safetensors", {n: s[n] for n in names[: 3 + i]})
        write_safetensors(root / "weights" / "b" / "b.safetensors", {n: s[n] for n in names[3 + i :]})
        ckpts.append(root)
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config(snapshot_every=3))
    for i, ckpt in enumerate(ckpts):
        pub.publish_dir(ckpt, base_dir=ckpts[i - 1] if i else None)
    # v3 changed too much (stored as a snapshot); v4 is a delta on it.
    assert kinds(repo) == ["snapshot", "delta", "snapshot", "delta"]
    pub5 = Publisher(str(repo), config(snapshot_every=2))
    pub5.publish_dir(ckpts[3], base_dir=ckpts[3])  # the chain 3→4 is as long as allowed
    assert kinds(repo)[-1] == "snapshot"
    out = tmp_path / "out"
    for v in [2, 1, 4, 3, 5, 2]:
        subscriber(repo).pull_to_dir(out, v)
        assert tree_digests(out) == tree_digests(ckpts[min(v, 4) - 1]), f"version {v}"


def test_path_that_turns_from_directory_into_file(tmp_path: Path) -> None:
    """``extra/`` is a directory in v1 and a file in v2: both install, in either order, and
    directories a version no longer needs are removed once empty."""
    state = make_state(0)
    v1 = write_checkpoint(tmp_path / "v1", state, side_files=False)
    (v1 / "extra" / "deep").mkdir(parents=True)
    (v1 / "extra" / "deep" / "x.txt").write_text("x")
    v2 = write_checkpoint(tmp_path / "v2", step_state(state, seed=1), side_files=False)
    (v2 / "extra").write_text("now a file")
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), config())
    pub.publish_dir(v1)
    pub.publish_dir(v2, base_dir=v1)
    out = tmp_path / "out"
    (out / "mine").mkdir(parents=True)  # the user's empty directory stays
    for v, src in [(1, v1), (2, v2), (1, v1), (2, v2)]:
        subscriber(repo).pull_to_dir(out, v)
        assert tree_digests(out) == tree_digests(src), f"version {v}"
        assert outside_state(all_paths(out)) == all_paths(src) | {"mine"}

"""Bounded resources and one-line errors against a hostile store and hostile input (issue 12,
requirements 4 and 5), by fault injection.

Categories (each test's cases are its parametrisations or the loop it runs):

* **store objects**: refs, the marker, manifests, squashes, blob parts made huge on the store
  (sparse files: ``truncate``), and a pack larger than its manifest declares. Every read has a
  limit known before it starts: the object is refused unread (one line naming its key) or,
  for a pack, read only by the ranges the manifest declares. Pulls run as CLI subprocesses
  whose peak RSS (``ru_maxrss``) must stay within ``RSS_LIMIT``.
* **local store**: symbolic links and special files below a store's root are no objects.
* **crafted manifests**: codec parameters, chunk offsets and lengths, pack sizes, blob part
  lists, counts: refused with one line before anything is read or staged, or (blob parts)
  never written beyond the declared size and removed when they cannot verify.
* **hostile input**: safetensors headers and indexes nested thousands deep, bools as shapes.
* **relay**: huge ranges answer OUT_OF_RANGE, keys outside the repository layout
  INVALID_ARGUMENT, symlinks out of the upstream root NOT_FOUND, oversized objects DATA_LOSS
  (never cached), listings show the layout only, huge refs pass in bounded memory.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig
from deltasync.errors import CorruptObjectError, ObjectNotFoundError, ObjectTooLargeError, StoreError
from deltasync.format import manifest as manifest_module
from deltasync.format.digest import version_digest
from deltasync.format.manifest import manifest_key, parse_manifest, seal
from deltasync.relay.server import RelayServer, build_server
from deltasync.repo.repository import BLOB_PART_BYTES, LATEST, MARKER, PIN, Repository, squash_key
from deltasync.storage import LocalStore
from deltasync.storage._grpc import GrpcStore
from deltasync.storage.wire import method_path
from deltasync.v1 import manifest_pb2 as pb, relay_pb2 as rpb

MiB = 1 << 20
GiB = 1 << 30
RSS_LIMIT_MIB = 512  # the target for every hostile case
HUGE = 2 * GiB  # sparse on disk: no test writes it

# Runs the CLI and reports its own peak RSS on stderr when it exits (SystemExit included).
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec() from the forking parent (pytest).
_PEAK = """
import atexit, re, sys
def _peak():
    with open("/proc/self/status") as f:
        print("PEAK_RSS_KIB", re.search(r"VmHWM:\\s+(\\d+)", f.read()).group(1), file=sys.stderr)
atexit.register(_peak)
"""

_CLI = _PEAK + """
sys.argv = ["deltasync", *sys.argv[1:]]
from deltasync.cli.main import main
main()
"""

# Runs a Python snippet and reports its peak RSS the same way.
_PY = _PEAK + """
exec(sys.argv[1])
"""

PEAKS: dict[str, float] = {}  # case -> peak RSS in MiB, printed at the end of the session


class Run:
    def __init__(self, proc: subprocess.CompletedProcess[str], seconds: float) -> None:
        self.rc = proc.returncode
        self.stdout = proc.stdout
        lines = proc.stderr.splitlines()
        peaks = [int(line.split()[1]) for line in lines if line.startswith("PEAK_RSS_KIB ")]
        self.peak_mib = peaks[-1] / 1024 if peaks else float("nan")
        self.errors = [line for line in lines if line.strip() and not line.startswith("PEAK_RSS_KIB ")]
        self.seconds = seconds

    def one_line(self, *needles: str) -> str:
        """The single line of stderr, which names every needle; never a traceback."""
        text = "\n".join(self.errors)
        assert "Traceback" not in text, text
        assert len(self.errors) == 1, text
        for needle in needles:
            assert needle in text, text
        return text


def _run(case: str, code: str, args: list[str], cwd: Path, timeout: float = 120) -> Run:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )
    run = Run(proc, time.monotonic() - start)
    PEAKS[case] = run.peak_mib
    assert run.peak_mib <= RSS_LIMIT_MIB, f"{case}: peak RSS {run.peak_mib:.0f} MiB"
    return run


def cli(case: str, cwd: Path, *args: str, timeout: float = 120) -> Run:
    return _run(case, _CLI, list(args), cwd, timeout)


def py(case: str, cwd: Path, code: str, timeout: float = 120) -> Run:
    return _run(case, _PY, [code], cwd, timeout)


@pytest.fixture(scope="session", autouse=True)
def _report_peaks() -> Iterator[None]:
    yield
    if PEAKS:
        width = max(map(len, PEAKS))
        lines = [f"  {case:<{width}}  {mib:6.0f} MiB" for case, mib in sorted(PEAKS.items())]
        sys.stderr.write(f"\npeak RSS of hostile cases (limit {RSS_LIMIT_MIB} MiB):\n" + "\n".join(lines) + "\n")


# -- a small repository to attack --------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], header: dict[str, object] | None = None) -> None:
    """A safetensors file (``header``: a hand-made header JSON instead of the real one)."""
    meta: dict[str, object] = {}
    pos = 0
    for name, arr in tensors.items():
        meta[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [pos, pos + arr.nbytes]}
        pos += arr.nbytes
    body = json.dumps(header if header is not None else meta).encode()
    body += b" " * (-len(body) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body)
        for arr in tensors.values():
            f.write(arr.tobytes())


def make_checkpoint(root: Path, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    write_safetensors(root / "model.safetensors", {
        "a.weight": rng.standard_normal((64, 256)).astype(np.float32),
        "b.weight": rng.standard_normal((32, 128)).astype(np.float32),
    })
    (root / "tokenizer.bin").write_bytes(rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    return root


CONFIG = PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=16 << 10), pack_bytes=64 << 10, workers=2, progress=False)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A local repository holding one version of a checkpoint directory (one blob file)."""
    url = tmp_path / "repo"
    Publisher(str(url), CONFIG).publish_dir(make_checkpoint(tmp_path / "ckpt", 0))
    return url


def sparse(path: Path, size: int = HUGE) -> None:
    """Make ``path`` ``size`` bytes long without writing them (a hole)."""
    os.truncate(path, size)


def rewrite(repo: Path, edit: Callable[[pb.Manifest], None], version: int = 1) -> None:
    """Replace a stored manifest by an edited one, digests recomputed: as a store writer
    without the signing key would (the repository is unsigned)."""
    store = LocalStore(repo)
    m = pb.Manifest()
    m.ParseFromString(store.get(manifest_key(version)))
    edit(m)
    m.version_digest = version_digest([c.target_digest for t in m.tensors for c in t.chunks])
    store.put(manifest_key(version), seal(m))


def staged_bytes(out: Path) -> int:
    """Bytes on disk under a pulled directory (its slots, caches and temp files)."""
    return sum(os.stat(p).st_blocks * 512 for p in out.rglob("*") if p.is_file() and not p.is_symlink())


def temp_files(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if "tmp" in p.name and p.is_file()]


# -- store objects: every read has a limit known before it starts ------------------------------


def test_huge_refs_latest_is_refused_unread_and_the_pull_goes_on(repo: Path, tmp_path: Path) -> None:
    """The ref is a hint: unreadable (2 GiB), it is ignored and manifests rule."""
    sparse(repo / LATEST)
    run = cli("refs/latest 2 GiB (pull)", tmp_path, "pull", str(tmp_path / "out"), "--repo", str(repo), "-q")
    assert run.rc == 0, run.errors
    assert (tmp_path / "out" / "tokenizer.bin").read_bytes() == (tmp_path / "ckpt" / "tokenizer.bin").read_bytes()


@pytest.mark.parametrize("key", [PIN, MARKER])
def test_huge_pin_or_marker_is_one_line_naming_it(repo: Path, tmp_path: Path, key: str) -> None:
    (repo / key).parent.mkdir(parents=True, exist_ok=True)
    (repo / key).write_bytes(b"1\n")
    sparse(repo / key)
    code = f"from deltasync import Repository\nr = Repository({str(repo)!r})\nr.ensure_exists()\nprint(r.pinned())"
    run = py(f"{key} 2 GiB", tmp_path, "\n".join([
        "from deltasync.errors import DeltasyncError",
        "try:",
        *("    " + line for line in code.splitlines()),
        "except DeltasyncError as e:",
        "    print(e, file=sys.stderr); sys.exit(1)",
    ]))
    assert run.rc == 1
    run.one_line(key, str(HUGE), "not read")


def test_huge_marker_fails_a_cli_pull_with_one_line(repo: Path, tmp_path: Path) -> None:
    sparse(repo / MARKER)
    run = cli("deltasync.json 2 GiB (pull)", tmp_path, "pull", str(tmp_path / "out"), "--repo", str(repo), "-q")
    assert run.rc != 0
    run.one_line(MARKER, "not read")


def test_huge_manifest_is_refused_unread(repo: Path, tmp_path: Path) -> None:
    sparse(repo / manifest_key(1))
    run = cli("manifest 2 GiB (pull)", tmp_path, "pull", str(tmp_path / "out"), "--repo", str(repo), "-q")
    assert run.rc != 0
    run.one_line(manifest_key(1), str(HUGE))


def test_huge_blob_part_is_refused_unread_and_nothing_is_left_staged(repo: Path, tmp_path: Path) -> None:
    blob = next((repo / "blobs").iterdir())
    sparse(blob)
    out = tmp_path / "out"
    run = cli("blob part 2 GiB (pull)", tmp_path, "pull", str(out), "--repo", str(repo), "-q")
    assert run.rc != 0
    run.one_line(f"blobs/{blob.name}", "not read")
    assert not temp_files(out)
    assert staged_bytes(out) <= Repository(str(repo)).manifest(1).pb.raw_bytes + 100_000 + 2 * MiB  # + LMDB


def test_huge_squash_is_refused_unread(repo: Path, tmp_path: Path) -> None:
    key = squash_key(1, 2)
    (repo / key).parent.mkdir(parents=True, exist_ok=True)
    (repo / key).write_bytes(b"")
    sparse(repo / key)
    with pytest.raises(CorruptObjectError, match=re.escape(key)) as info:
        Repository(str(repo)).squash(1, 2)
    assert isinstance(info.value, ObjectTooLargeError) and info.value.size == HUGE


def test_pack_larger_than_declared_is_read_only_by_its_declared_ranges(repo: Path, tmp_path: Path) -> None:
    """1 GiB appended to every pack (sparse): never read whole, the pull is still bit-exact."""
    for pack in (repo / "packs").iterdir():
        sparse(pack, pack.stat().st_size + GiB)
    out = tmp_path / "out"
    run = cli("packs 1 GiB over declared (pull)", tmp_path, "pull", str(out), "--repo", str(repo), "-q")
    assert run.rc == 0, run.errors
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ckpt" / "model.safetensors").read_bytes()


def test_store_wrapper_returning_oversized_objects_is_refused(repo: Path) -> None:
    """A backend that ignores the limit (returns whatever it holds) is still refused."""
    from deltasync.storage import Store, WrappingStore

    class Liar(WrappingStore):
        def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
            data = self.inner.get(key, byte_range)  # the limit stays with this call, not the inner one
            return data + bytes(65 * MiB) if byte_range is None else data  # past every whole-object cap

    inner: Store = LocalStore(repo)
    store = Liar(inner)
    r = Repository(store)
    with pytest.raises(ObjectTooLargeError, match=MARKER):
        r.ensure_exists()
    with pytest.raises(ObjectTooLargeError, match=re.escape(manifest_key(1))):
        r.manifest(1)


# -- the local store: links and special files are no objects -----------------------------------


def test_local_store_serves_no_links_or_special_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = LocalStore(root)
    store.put("refs/latest", b"1\n")
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"outside the store")
    (root / "packs").mkdir()
    os.symlink(secret, root / "packs" / "evil.pack")
    os.symlink(tmp_path, root / "blobs")  # a linked directory
    os.mkfifo(root / "refs" / "pin")  # opening a FIFO must not hang the reader
    cases = ["packs/evil.pack", "blobs/secret.txt", "refs/pin"]
    for key in cases:
        # A linked directory is named (StoreError), so a repository set up that way says why.
        with pytest.raises(StoreError if key.startswith("blobs/") else ObjectNotFoundError):
            store.get(key)
        with pytest.raises(ObjectNotFoundError):
            store.size(key)
        assert key not in list(store.list())
    assert list(store.list()) == ["refs/latest"]
    assert len(cases) == 3


# -- crafted manifests ---------------------------------------------------------------------------


def _codec_1gib(m: pb.Manifest) -> None:
    m.codec.chunk_bytes = GiB


def _offset_2_63(m: pb.Manifest) -> None:
    m.tensors[0].chunks[0].offset = 1 << 63


def _length_64gib(m: pb.Manifest) -> None:
    m.packs[m.tensors[0].chunks[0].pack].size = 80 * GiB
    m.tensors[0].chunks[0].length = 64 * GiB


def _payload_beyond_any_encoding(m: pb.Manifest) -> None:
    c = m.tensors[0].chunks[0]
    m.packs[c.pack].size = 1 * GiB
    c.offset, c.length = 0, 512 * MiB  # within the pack's declared size, not within any encoding


def _pack_2_63(m: pb.Manifest) -> None:
    m.packs[0].size = (1 << 63) - 1


def _blob_part_24_times(m: pb.Manifest) -> None:
    f = next(f for f in m.files if f.kind == pb.File.BLOB)
    f.blob_parts.extend([f.blob_parts[0]] * 23)


def _shape_overflow(m: pb.Manifest) -> None:
    t = m.tensors[0]
    t.shape[:] = [1 << 40, 1 << 40]


def _too_many_dims(m: pb.Manifest) -> None:
    m.tensors[0].shape[:] = [1] * 65


CRAFTED = {
    "chunk_bytes 1 GiB": (_codec_1gib, "bad codec parameters"),
    "chunk offset 2^63": (_offset_2_63, "points outside its pack"),
    "chunk length 64 GiB": (_length_64gib, "more than any pack holds"),
    "payload longer than any encoding": (_payload_beyond_any_encoding, "longer than any encoding"),
    "pack size 2^63": (_pack_2_63, "more than any pack holds"),
    "one blob part listed 24 times": (_blob_part_24_times, "more blob parts than its 100000 bytes need"),
    "shape of 2^80 elements": (_shape_overflow, "is not"),
    "65 dimensions": (_too_many_dims, "bad shape"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_manifest_is_one_line_and_stages_nothing(repo: Path, tmp_path: Path, case: str) -> None:
    edit, message = CRAFTED[case]
    rewrite(repo, edit)
    out = tmp_path / "out"
    run = cli(f"crafted: {case}", tmp_path, "pull", str(out), "--repo", str(repo), "-q")
    assert run.rc != 0
    run.one_line(message)
    assert not temp_files(out)
    assert not (out / "tokenizer.bin").exists()


def test_blob_parts_never_write_beyond_the_declared_size(repo: Path, tmp_path: Path) -> None:
    """24 listings of one 100 kB part under a declared size that admits them: each part is
    checked against what is left of the size, so the pull writes at most that size, then the
    file digest refuses it and the staged file is removed."""
    def edit(m: pb.Manifest) -> None:
        f = next(f for f in m.files if f.kind == pb.File.BLOB)
        f.blob_parts.extend([f.blob_parts[0]] * 23)
        f.size = 24 * 100_000
    rewrite(repo, edit)
    declared = sum(f.size for f in Repository(str(repo)).manifest(1).pb.files)
    out = tmp_path / "out"
    run = cli("blob part x24, size declared", tmp_path, "pull", str(out), "--repo", str(repo), "-q")
    assert run.rc != 0
    run.one_line("tokenizer.bin", "digest")
    assert not temp_files(out)
    assert staged_bytes(out) <= declared + 2 * MiB  # the slot's safetensors file, state (LMDB)


def test_blob_part_larger_than_the_declared_size_is_refused_unwritten(repo: Path, tmp_path: Path) -> None:
    def edit(m: pb.Manifest) -> None:
        next(f for f in m.files if f.kind == pb.File.BLOB).size = 100
    rewrite(repo, edit)
    out = tmp_path / "out"
    run = cli("blob part over declared size", tmp_path, "pull", str(out), "--repo", str(repo), "-q")
    assert run.rc != 0
    run.one_line("blobs/", "not read")
    assert not temp_files(out)
    assert not (out / "tokenizer.bin").exists()


@pytest.mark.parametrize(
    ("cap", "edit"),
    [
        ("MAX_TENSORS", lambda m: m.tensors.add().CopyFrom(m.tensors[0])),
        ("MAX_FILES", lambda m: m.files.add().CopyFrom(m.files[0])),
        ("MAX_PACKS", lambda m: m.packs.add().CopyFrom(m.packs[0])),
        ("MAX_CHUNKS", lambda m: None),
    ],
)
def test_counts_are_capped_before_the_entries_are_walked(
    repo: Path, monkeypatch: pytest.MonkeyPatch, cap: str, edit: Callable[[pb.Manifest], None]
) -> None:
    m = pb.Manifest()
    m.ParseFromString((repo / manifest_key(1)).read_bytes())
    edit(m)
    counts = {"MAX_TENSORS": len(m.tensors), "MAX_FILES": len(m.files), "MAX_PACKS": len(m.packs),
              "MAX_CHUNKS": sum(len(t.chunks) for t in m.tensors)}
    monkeypatch.setattr(manifest_module, cap, counts[cap] - 1)
    with pytest.raises(CorruptObjectError, match="more than"):
        parse_manifest(seal(m), expect_version=1)


def _empty_tensors_repo(root: Path, count: int) -> Path:
    """A repository whose version 1 holds ``count`` empty tensors (valid, if absurd)."""
    Repository(str(root)).create()
    m = pb.Manifest(format=1, version=1, kind=pb.SNAPSHOT, snapshot=1)
    m.codec.name, m.codec.codec_version, m.codec.chunk_bytes = PlanesZstdCodec.name, 1, 4 * MiB
    m.codec.zstd_level, m.codec.full_zstd_level = 3, 1
    for i in range(count):
        t = m.tensors.add()
        t.name, t.dtype = f"t{i}", "F32"
        t.shape.append(0)
    m.version_digest = version_digest([])
    LocalStore(root).put(manifest_key(1), seal(m))
    return root


def test_400k_empty_tensors_are_refused_in_bounded_memory_and_time(tmp_path: Path) -> None:
    """7.5 MB of empty tensors (834 MB and 16 s before): over the tensor cap, one line."""
    repo = _empty_tensors_repo(tmp_path / "repo", 400_000)
    run = cli("400k empty tensors (pull)", tmp_path, "pull", str(tmp_path / "out"), "--repo", str(repo), "-q")
    assert run.rc != 0
    run.one_line("400000 tensors", "more than a manifest may hold")
    assert run.seconds < 60


@pytest.mark.slow
def test_empty_tensors_up_to_the_cap_pull_in_bounded_memory_and_time(tmp_path: Path) -> None:
    """Just under the cap the version is valid: validating and pulling it cost in proportion."""
    repo = _empty_tensors_repo(tmp_path / "repo", manifest_module.MAX_TENSORS)
    run = cli("2^18 empty tensors (pull)", tmp_path, "pull", str(tmp_path / "out"), "--repo", str(repo), "-q",
              timeout=300)
    assert run.rc == 0, run.errors
    assert run.seconds < 120


# -- hostile input: one line, non-zero exit -------------------------------------------------------


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("case", ["header nested 100k deep", "index nested 100k deep", "shape [true, 2]",
                                  "data_offsets [false, 8]"])
def test_hostile_checkpoint_input_is_one_line(tmp_path: Path, case: str) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", 0)
    arr = {"x": np.zeros((1, 2), dtype=np.float32)}
    if case.startswith("header"):
        body = '{"x": ' + _nested(100_000) + "}"
        raw = body.encode() + b" " * (-len(body) % 8)
        (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
    elif case.startswith("index"):
        (ckpt / "model.safetensors.index.json").write_text('{"weight_map": ' + _nested(100_000) + "}")
    elif case == "shape [true, 2]":
        write_safetensors(ckpt / "model.safetensors", arr, {"x": {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}})
    else:
        write_safetensors(ckpt / "model.safetensors", arr, {"x": {"dtype": "F32", "shape": [1, 2], "data_offsets": [False, 8]}})
    run = cli(f"input: {case}", tmp_path, "publish", str(ckpt), "--repo", str(tmp_path / "repo"), "-q")
    assert run.rc != 0
    run.one_line("corrupt")


# -- the relay ---------------------------------------------------------------------------------------


@pytest.fixture
def relay(repo: Path) -> Iterator[RelayServer]:
    server = build_server(str(repo), "127.0.0.1:0", poll_interval=0.05).start()
    yield server
    server.stop(grace=0)


def _raw_get(server: RelayServer, request: rpb.GetRequest) -> tuple[grpc.StatusCode, str]:
    """One Get as any client could send it (offsets the Store API refuses included)."""
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_stream(method_path("Get"), request_serializer=rpb.GetRequest.SerializeToString,
                                    response_deserializer=rpb.GetChunk.FromString)
        try:
            for _ in call(request, timeout=30):
                pass
        except grpc.RpcError as e:
            return e.code(), str(e.details())
    return grpc.StatusCode.OK, ""


def _raw_stat(server: RelayServer, key: str) -> grpc.StatusCode:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(method_path("Stat"), request_serializer=rpb.StatRequest.SerializeToString,
                                   response_deserializer=rpb.StatResponse.FromString)
        try:
            call(rpb.StatRequest(key=key), timeout=30)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_relay_maps_bad_ranges_and_keys_to_their_status(repo: Path, relay: RelayServer, tmp_path: Path) -> None:
    pack = "packs/" + next((repo / "packs").iterdir()).name
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"outside the upstream")
    os.symlink(secret, repo / "refs" / "leak")
    os.symlink(secret, repo / "packs" / ("0" * 32 + ".pack"))
    (repo / "gc").mkdir()
    (repo / "gc" / "pending.json").write_bytes(b"{}")
    (repo / "notes.txt").write_bytes(b"not a repository key")
    out_of_range = [(pack, 0, 1 << 40), (pack, 1 << 62, 1), (pack, 1 << 63, 1), (pack, 0, (1 << 64) - 1),
                    (LATEST, 0, 1 << 40), (LATEST, 1 << 63, 1), (MARKER, (1 << 64) - 1, 0)]
    invalid = ["gc/pending.json", "notes.txt", "../etc/passwd", "refs//latest"]
    not_found = ["refs/leak", "packs/" + "0" * 32 + ".pack"]
    for key, offset, length in out_of_range:
        code, _ = _raw_get(relay, rpb.GetRequest(key=key, offset=offset, length=length, has_range=True))
        assert code == grpc.StatusCode.OUT_OF_RANGE, (key, offset, length, code)
    for key in invalid:
        assert _raw_get(relay, rpb.GetRequest(key=key))[0] == grpc.StatusCode.INVALID_ARGUMENT, key
        assert _raw_stat(relay, key) == grpc.StatusCode.INVALID_ARGUMENT, key
    for key in not_found:
        assert _raw_get(relay, rpb.GetRequest(key=key))[0] == grpc.StatusCode.NOT_FOUND, key
        assert _raw_stat(relay, key) == grpc.StatusCode.NOT_FOUND, key
    listed = list(GrpcStore(relay.url).list())
    assert listed and all(k == MARKER or k.split("/")[0] in ("packs", "blobs", "manifests", "refs", "squashes")
                          for k in listed)
    assert not {"gc/pending.json", "notes.txt", "refs/leak", "packs/" + "0" * 32 + ".pack"} & set(listed)
    assert (len(out_of_range), len(invalid), len(not_found)) == (7, 4, 2)


def test_relay_refuses_oversized_objects_and_caches_none(repo: Path, relay: RelayServer) -> None:
    sparse(repo / manifest_key(1))
    blob = next((repo / "blobs").iterdir())
    sparse(blob)
    store = GrpcStore(relay.url)
    for key in (manifest_key(1), f"blobs/{blob.name}"):
        with pytest.raises(CorruptObjectError, match="a valid one can hold"):
            store.get(key)
    assert relay.metrics()["cached_objects"] == 0
    assert relay.metrics()["upstream_bytes"] == 0


def test_huge_ref_through_a_relay_in_bounded_memory(repo: Path, tmp_path: Path) -> None:
    """A relay and its client in one process, against a 2 GiB refs/latest and refs/pin:
    the client's capped read is refused after the relay's first piece; ranged reads stream."""
    sparse(repo / LATEST)
    (repo / PIN).write_bytes(b"")
    sparse(repo / PIN)
    code = "\n".join([
        "from deltasync.relay.server import build_server",
        "from deltasync.storage._grpc import GrpcStore",
        "from deltasync.errors import ObjectTooLargeError",
        "from deltasync import Repository",
        f"server = build_server({str(repo)!r}, '127.0.0.1:0').start()",
        "store = GrpcStore(server.url)",
        "assert Repository(store).latest() == 1  # the unreadable hint is ignored",
        "try:",
        "    Repository(store).pinned()",
        "    raise SystemExit('pinned() read a 2 GiB ref')",
        "except ObjectTooLargeError as e:",
        "    print(e)",
        "for offset in range(0, 64 << 20, 16 << 20):",
        "    assert store.get('refs/latest', (offset, 16 << 20)) == bytes(16 << 20) or offset == 0",
        "server.stop(grace=0)",
    ])
    run = py("refs 2 GiB through a relay", tmp_path, code)
    assert run.rc == 0, run.errors
    assert "refs/pin" in run.stdout and "not read" in run.stdout


def test_cli_pull_through_a_relay_of_a_huge_marker_is_one_line(repo: Path, relay: RelayServer, tmp_path: Path) -> None:
    sparse(repo / MARKER)
    run = cli("deltasync.json 2 GiB (pull via relay)", tmp_path, "pull", str(tmp_path / "out"), "--repo", relay.url, "-q")
    assert run.rc != 0
    run.one_line(MARKER)


def test_blob_part_bytes_matches_the_manifest_cap() -> None:
    """The publisher's split and the reader's cap on a part are one number."""
    assert BLOB_PART_BYTES == manifest_module.BLOB_PART_SIZE


def test_largest_chunks_over_a_tiny_pack_pull_in_bounded_memory(tmp_path: Path) -> None:
    """The issue's "1 GiB chunks over a 32 KB pack" at the largest chunk size a codec
    accepts (64 MiB; 1 GiB is refused above): 16 chunks of one 1 GiB tensor all name one
    2 kB zstd frame of 64 MiB of zeros (a valid full payload) with wrong digests. The pull
    refuses the first chunk with one line, holding few chunks at a time."""
    import zstandard

    from deltasync.format.codec import MAX_CHUNK_BYTES

    repo = tmp_path / "repo"
    Repository(str(repo)).create()
    payload = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(MAX_CHUNK_BYTES))
    pack_key = "packs/" + "ab" * 16 + ".pack"
    LocalStore(repo).put(pack_key, payload)
    m = pb.Manifest(format=1, version=1, kind=pb.SNAPSHOT, snapshot=1)
    m.codec.name, m.codec.codec_version, m.codec.chunk_bytes = PlanesZstdCodec.name, 1, MAX_CHUNK_BYTES
    m.codec.zstd_level, m.codec.full_zstd_level = 3, 1
    m.packs.add(key=pack_key, size=len(payload))
    t = m.tensors.add(name="w", dtype="F32", nbytes=GiB)
    t.shape.append(GiB // 4)
    for i in range(GiB // MAX_CHUNK_BYTES):
        t.chunks.add(pack=0, offset=0, length=len(payload), encoding=pb.FULL, target_digest=bytes([i]) * 16)
    m.raw_bytes = GiB
    m.version_digest = version_digest([c.target_digest for c in t.chunks])
    LocalStore(repo).put(manifest_key(1), seal(m))
    out = tmp_path / "out"
    run = cli("16 x 64 MiB chunks over a 2 kB pack (pull)", tmp_path, "pull", str(out), "--repo", str(repo), "-q")
    assert run.rc != 0
    run.one_line("checksum mismatch in version 1", "tensor 'w'")
    assert len(payload) < 64 << 10
    assert staged_bytes(out) <= GiB  # the slot's file is sparse until verified chunks land


def test_maintenance_commands_on_a_hostile_store_stay_bounded(repo: Path, tmp_path: Path) -> None:
    """verify names a 2 GiB blob part without reading it; gc treats a 2 GiB gc/pending.json
    as unreadable (a new grace period) without reading it."""
    blob = next((repo / "blobs").iterdir())
    sparse(blob)
    run = cli("blob part 2 GiB (verify)", tmp_path, "verify", "--repo", str(repo), "-q")
    assert run.rc != 0
    assert "Traceback" not in "\n".join(run.errors) and f"blobs/{blob.name}" in run.stdout + "\n".join(run.errors)
    (repo / "gc").mkdir()
    (repo / "gc" / "pending.json").write_bytes(b"")
    sparse(repo / "gc" / "pending.json")
    (repo / "packs" / ("cd" * 16 + ".pack")).write_bytes(b"unreferenced")  # something to keep pending
    run = cli("gc/pending.json 2 GiB (gc)", tmp_path, "gc", "--repo", str(repo), "--keep-last", "1", "--json")
    assert run.rc == 0, run.errors
    report = json.loads(run.stdout)
    assert any("gc/pending.json was unreadable" in note for note in report["notes"]), report
    assert report["pending"] == ["packs/" + "cd" * 16 + ".pack"]


def test_a_listing_past_the_key_cap_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import deltasync.storage._base as store_base

    monkeypatch.setattr(store_base, "MAX_LIST_KEYS", 3)
    store = LocalStore(tmp_path / "repo")
    for i in range(5):
        store.put(f"manifests/{i:020d}.pb", b"x")
    with pytest.raises(StoreError, match=r"listing 'manifests/' of .* passed 3 keys"):
        list(store.list("manifests/"))
    store.delete("manifests/00000000000000000004.pb")
    store.delete("manifests/00000000000000000003.pb")
    assert len(list(store.list("manifests/"))) == 3


def test_a_linked_directory_in_a_local_repository_is_named_not_reported_missing(tmp_path: Path) -> None:
    elsewhere = tmp_path / "bigdisk" / "packs"
    elsewhere.mkdir(parents=True)
    (elsewhere / "p.pack").write_bytes(b"x")
    store = LocalStore(tmp_path / "repo")
    store.put("deltasync.json", b"{}")
    os.symlink(elsewhere, tmp_path / "repo" / "packs")
    with pytest.raises(StoreError, match=r"cannot read packs/p.pack: .*/repo/packs is a symbolic link"):
        store.get("packs/p.pack")
    with pytest.raises(StoreError, match=r"cannot write packs/q.pack: .*/repo/packs is a symbolic link"):
        store.put("packs/q.pack", b"y")
    assert not (elsewhere / "q.pack").exists()

"""Issue 12, requirements 6 and 7: publishing against a hostile environment.

* A failure after the commit (the publish cache on a full disk) is a warning, not a failed
  publish that a retry would duplicate.
* gc racing a slow publish (driven deterministically: gc runs twice with no grace right
  after the publisher's packs are durable, before its commit) deletes what the publish
  uploaded; the publisher stores it again or fails with nothing committed, and every
  committed version pulls bit-exactly. Over a local directory and moto's S3.
* Checkpoint directories: links out of the directory, links to directories, FIFOs,
  sockets, dangling links and link loops are one-line errors naming the path.
* Temp files of killed publishers (a real SIGKILL between write and rename) are reported by
  verify and removed by gc after the grace period.
* A symbolic link in place of a copy's ``.deltasync`` is refused.

Command-line cases run ``python3 -m deltasync`` in a subprocess and expect exactly one line
``deltasync: error: ...`` (or a warning and exit 0), never a traceback.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint

import deltasync.ops.retention as retention_mod
import deltasync.publish.commit as commit_mod
import deltasync.publish.packs as packs_mod
from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Repository, Subscriber
from deltasync.errors import CheckpointError, CorruptObjectError, StoreError
from deltasync.format.manifest import manifest_key
from deltasync.local.state import read_local_state
from deltasync.ops.retention import collect, temp_files
from deltasync.ops.verify import verify_repository

pytest_plugins = ["s3server"]  # the s3_url fixture

REPO_ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(**kw: Any) -> PublisherConfig:
    # Small chunks and packs: a version spans several packs, so a race can hit some of them.
    return PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=16 << 10), pack_bytes=64 << 10, progress=False, **kw)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_state(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert bits(got[name]) == bits(t), name


def checkpoints(root: Path, n: int) -> list[Path]:
    """``n`` checkpoints of one run (about 1% of elements change per step), with side files."""
    state = make_state(0)
    out: list[Path] = []
    for step in range(1, n + 1):
        if step > 1:
            state = step_state(state, seed=step)
        out.append(write_checkpoint(root / f"step-{step}", state, shards=2, step=step))
    return out


def assert_every_version_pulls_exactly(url: str, ckpts: Mapping[int, Path], tmp: Path) -> None:
    """Each committed version, pulled into a fresh directory, equals its checkpoint file for file."""
    versions = Repository(url).versions()
    assert sorted(ckpts) == versions
    for v, ckpt in ckpts.items():
        out = tmp / f"pulled-{v}-{os.urandom(4).hex()}"
        Subscriber(url, progress=False).pull_to_dir(out, v)
        assert tree_digests(out) == tree_digests(ckpt), v
    report = verify_repository(url, progress=False)
    assert report.versions == versions


# -- the command line ------------------------------------------------------------------------------


@dataclass
class Ran:
    rc: int
    out: str
    err: str


def run_cli(cwd: Path, *args: str | Path, prelude: str = "") -> Ran:
    """``python3 -m deltasync ARGS``; with ``prelude``, that Python code runs first in the same
    process (to inject a fault), then the command line's own ``main``."""
    env = dict(os.environ, DELTASYNC_CACHE=str(cwd / "default-cache"))
    env.pop("DELTASYNC_TEST_S3_URL", None)
    if prelude:
        code = textwrap.dedent(prelude) + "\nimport sys\nfrom deltasync.cli.main import main\nmain(sys.argv[1:])\n"
        cmd = [sys.executable, "-c", code, *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "deltasync", *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=180)
    return Ran(p.returncode, p.stdout, p.stderr)


def one_error_line(r: Ran, *needles: str) -> str:
    assert r.rc != 0, r.out
    assert "Traceback" not in r.err, r.err
    lines = r.err.splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("deltasync: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# == 6a. a failure after the commit is a warning ==================================================


def _full_disk(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every copy into the publish cache fails with ENOSPC (only after the commit do copies happen)."""
    copied: list[str] = []

    def no_space(src: Any, dst: Any, *a: Any, **kw: Any) -> Any:
        copied.append(str(dst))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr("deltasync.publish.publisher.shutil.copyfile", no_space)
    return copied


def test_full_disk_refreshing_the_cache_is_a_warning_and_a_retry_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    url, cache = str(tmp_path / "repo"), tmp_path / "cache"
    ckpts = checkpoints(tmp_path, 2)
    pub = Publisher(url, config(skip_unchanged=True))
    assert pub.publish_dir(ckpts[0], cache_dir=cache) == 1
    with monkeypatch.context() as m:
        copied = _full_disk(m)
        with caplog.at_level(logging.WARNING, logger="deltasync.publish"):
            r = Publisher(url, config(skip_unchanged=True)).publish_dir(ckpts[1], cache_dir=cache)
    assert copied, "the cache was never refreshed: the fault was not injected"
    assert (r.version, r.kind) == (2, "delta")
    assert len(r.warnings) == 1 and "version 2 is published" in r.warnings[0] and "No space left" in r.warnings[0]
    assert any("could not be refreshed" in rec.getMessage() for rec in caplog.records)
    assert not (cache / ".deltasync" / "incoming").exists()  # the partial copy is not left taking space
    assert read_local_state(cache).version == 1  # type: ignore[union-attr]
    # The retry: the cache is brought to version 2 from the repository, and nothing is published.
    again = Publisher(url, config(skip_unchanged=True)).publish_dir(ckpts[1], cache_dir=cache)
    assert (again.version, again.kind) == (2, "unchanged")
    assert Repository(url).versions() == [1, 2]
    assert read_local_state(cache).version == 2  # type: ignore[union-attr]
    assert_every_version_pulls_exactly(url, {1: ckpts[0], 2: ckpts[1]}, tmp_path)


def test_cli_full_disk_after_the_commit_exits_0_with_a_warning_and_no_duplicate(tmp_path: Path) -> None:
    ckpts = checkpoints(tmp_path, 2)
    assert run_cli(tmp_path, "publish", ckpts[0], "--repo", "repo").rc == 0
    full_disk = """
        import errno, os, shutil
        def no_space(src, dst, *a, **kw):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        import deltasync.publish.publisher as p
        p.shutil.copyfile = no_space
    """
    r = run_cli(tmp_path, "publish", ckpts[1], "--repo", "repo", prelude=full_disk)
    assert r.rc == 0, r.err
    assert "published version 2" in r.out
    assert "Traceback" not in r.err
    warnings = [line for line in r.err.splitlines() if line.strip()]
    assert len(warnings) == 1 and "warning" in warnings[0] and "No space left" in warnings[0], r.err
    retry = run_cli(tmp_path, "publish", ckpts[1], "--repo", "repo")
    assert retry.rc == 0 and "nothing changed since version 2" in retry.out, retry.out + retry.err
    assert Repository(str(tmp_path / "repo")).versions() == [1, 2]


def test_cli_json_names_the_warning(tmp_path: Path) -> None:
    ckpts = checkpoints(tmp_path, 1)
    full_disk = """
        import errno, os
        def no_space(src, dst, *a, **kw):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        import deltasync.publish.publisher as p
        p.shutil.copyfile = no_space
    """
    r = run_cli(tmp_path, "publish", ckpts[0], "--repo", "repo", "--json", prelude=full_disk)
    assert r.rc == 0, r.err
    import json

    out = json.loads(r.out)
    assert out["version"] == 1 and out["published"] is True
    assert len(out["warnings"]) == 1 and "could not be refreshed" in out["warnings"][0]


# == 6b. races with gc ============================================================================


@pytest.fixture(params=["local", "s3"])
def race_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "repo")
    else:
        yield request.getfixturevalue("s3_url")


class GcBeforeCommit:
    """Runs gc (two runs, no grace: the second deletes what the first saw unreferenced) each
    time a publisher's packs have all become durable (``Packer.finish``), i.e. between its
    uploads and its commit, ``times`` times at most: a gc with a grace shorter than the publish
    that does not read the publish's lease (older deltasync: a gc of this one deletes nothing
    a publish in flight may commit, tests/ops/test_gc_leases.py), so the publisher's own
    check before its commit is what is tested here."""

    def __init__(self, url: str, monkeypatch: pytest.MonkeyPatch, times: int) -> None:
        self.url, self.times = url, times
        monkeypatch.setattr(retention_mod, "read_leases", lambda store: ([], []))
        self.deleted: list[list[str]] = []  # what each gc pass deleted
        original = packs_mod.Packer.finish

        def finish(packer: packs_mod.Packer, **kw: Any) -> Any:
            going = original(packer, **kw)
            if len(self.deleted) < self.times:
                collect(self.url, keep_last=1000, grace_seconds=0)
                report = collect(self.url, keep_last=1000, grace_seconds=0)
                self.deleted.append(report.packs_deleted + report.blobs_deleted)
            return going

        monkeypatch.setattr(packs_mod.Packer, "finish", finish)


def test_gc_between_upload_and_commit_of_a_directory_delta_makes_the_publisher_store_it_again(
    race_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpts = checkpoints(tmp_path, 3)
    cache = tmp_path / "cache"
    Publisher(race_url, config()).publish_dir(ckpts[0], cache_dir=cache)
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="deltasync.publish"):
        race = GcBeforeCommit(race_url, m, times=1)
        r = Publisher(race_url, config()).publish_dir(ckpts[1], cache_dir=cache)
    assert race.deleted and any(k.startswith("packs/") for k in race.deleted[0]), "gc deleted nothing: no race"
    assert any(k.startswith("blobs/") for k in race.deleted[0])  # generation_config.json changed: a new blob
    assert (r.version, r.kind) == (2, "delta")
    assert any("deleted before the commit" in rec.getMessage() for rec in caplog.records)
    assert Publisher(race_url, config()).publish_dir(ckpts[2], cache_dir=cache) == 3
    assert_every_version_pulls_exactly(race_url, dict(enumerate(ckpts, start=1)), tmp_path)


def test_gc_on_every_attempt_fails_the_publish_with_nothing_committed(
    race_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpts = checkpoints(tmp_path, 2)
    cache = tmp_path / "cache"
    Publisher(race_url, config()).publish_dir(ckpts[0], cache_dir=cache)
    with monkeypatch.context() as m, pytest.raises(
        StoreError, match=r"version 2 not committed: .* deleted while publishing, again after 3 attempts"
    ):
        race = GcBeforeCommit(race_url, m, times=100)
        Publisher(race_url, config()).publish_dir(ckpts[1], cache_dir=cache)
    assert len(race.deleted) == commit_mod.COMMIT_ATTEMPTS  # the encode, then one per restore
    assert Repository(race_url).versions() == [1]
    assert Publisher(race_url, config()).publish_dir(ckpts[1], cache_dir=cache) == 2  # the retry publishes it
    assert_every_version_pulls_exactly(race_url, {1: ckpts[0], 2: ckpts[1]}, tmp_path)


def test_gc_race_in_the_library_publisher_whose_in_memory_base_is_overwritten(
    race_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The library diffs against bits it overwrites with the new ones while encoding: the
    # packs gc deleted can only be stored again in full; the version must still pull exactly.
    states = [make_state(0)]
    for step in range(1, 3):
        states.append(step_state(states[-1], seed=step))
    pub = Publisher(race_url, config())
    assert pub.publish(states[0]) == 1
    with monkeypatch.context() as m:
        race = GcBeforeCommit(race_url, m, times=1)
        r = pub.publish(states[1])
    assert race.deleted and race.deleted[0]
    assert (r.version, r.kind) == (2, "delta")
    assert pub.publish(states[2]).kind == "delta"  # the next delta's in-memory base is still right
    sub = Subscriber(race_url, progress=False)
    for v, state in enumerate(states, start=1):
        assert_state(sub.pull(v), state)
    assert verify_repository(race_url, progress=False).versions == [1, 2, 3]


def test_gc_deleting_in_the_instant_before_the_manifest_write_is_reported_not_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The residual window: a pack deleted after the publisher's check, before its manifest
    # write. The publish must not report success for a version that cannot be pulled.
    url = str(tmp_path / "repo")
    ckpts = checkpoints(tmp_path, 2)
    Publisher(url, config()).publish_dir(ckpts[0], cache_dir=tmp_path / "cache")
    original = Repository.commit

    def commit_after_a_delete(self: Repository, manifest: Any, **options: Any) -> Any:
        self.store.delete(manifest.packs[0].key)
        return original(self, manifest, **options)

    monkeypatch.setattr(Repository, "commit", commit_after_a_delete)
    with pytest.raises(StoreError, match=r"version 2 was committed but packs/.* deleted by a concurrent gc"):
        Publisher(url, config()).publish_dir(ckpts[1], cache_dir=tmp_path / "cache")


def test_a_ref_that_cannot_be_written_after_the_commit_is_a_warning_and_the_version_stays_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Once the manifest is stored the version exists: a failure after it must not make the
    # publisher (or a distributed publisher's ranks) remove packs the version needs.
    url = str(tmp_path / "repo")
    ckpts = checkpoints(tmp_path, 2)
    Publisher(url, config()).publish_dir(ckpts[0])
    real = Repository._write_ref

    def refs_down(self: Repository, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "latest":
            raise StoreError("cannot write refs/latest: connection reset (injected)")
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(Repository, "_write_ref", refs_down)
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        result = Publisher(url, config()).publish_dir(ckpts[1], base_dir=ckpts[0])
    assert result == 2 and "refs/latest was not updated" in caplog.text
    monkeypatch.setattr(Repository, "_write_ref", real)
    assert Repository(url).latest() == 2  # the listing rules
    assert_every_version_pulls_exactly(url, {1: ckpts[0], 2: ckpts[1]}, tmp_path)


def test_a_distributed_publish_never_removes_packs_of_a_committed_version(tmp_path: Path) -> None:
    # One gloo rank (its own process): a failure after the commit raises CommittedError, and
    # the version it names still pulls.
    url = str(tmp_path / "repo")
    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist, deltasync
        from deltasync.errors import CommittedError
        from deltasync.repo.repository import Repository
        import deltasync.publish.commit as commit
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        pub = deltasync.DistributedPublisher({url!r}, timeout=30)
        g = torch.Generator().manual_seed(0)
        state = {{"w": torch.randn(256, 64, generator=g).to(torch.bfloat16)}}
        pub.publish(state)
        real = commit.missing_objects
        calls = []
        def gone_after_the_commit(store, files, encoded):
            calls.append(1)
            return real(store, files, encoded) if len(calls) == 1 else [encoded.packs[0].key]
        commit.missing_objects = gone_after_the_commit
        state["w"] = state["w"].clone(); state["w"][0, :8] += 1
        try:
            pub.publish(state)
        except CommittedError as e:
            print("committed", e.version)
        commit.missing_objects = real
        print("pulled", sorted(deltasync.Subscriber({url!r}).pull(2)))
        dist.destroy_process_group()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["committed", "2", "pulled", "['w']"]


def test_a_parent_deleted_while_publishing_fails_the_publish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "repo")
    ckpts = checkpoints(tmp_path, 2)
    Publisher(url, config()).publish_dir(ckpts[0], cache_dir=tmp_path / "cache")
    original = packs_mod.Packer.finish

    def finish(packer: packs_mod.Packer, **kw: Any) -> Any:
        going = original(packer, **kw)
        Repository(url).store.delete(manifest_key(1))  # what a gc of version 1 does first
        return going

    monkeypatch.setattr(packs_mod.Packer, "finish", finish)
    with pytest.raises(StoreError, match="its parent version 1 was deleted while publishing"):
        Publisher(url, config()).publish_dir(ckpts[1], cache_dir=tmp_path / "cache")
    assert Repository(url).versions() == []


def test_cli_gc_on_every_attempt_is_one_error_line(tmp_path: Path) -> None:
    ckpts = checkpoints(tmp_path, 2)
    assert run_cli(tmp_path, "publish", ckpts[0], "--repo", "repo").rc == 0
    gc_every_time = f"""
        import deltasync.publish.encode as e
        import deltasync.ops.retention as r
        from deltasync.ops.retention import collect
        r.read_leases = lambda store: ([], [])  # a gc that reads no leases (older deltasync)
        original = e.Packer.finish
        def finish(packer, **kw):
            going = original(packer, **kw)
            for _ in range(2):
                collect({str(tmp_path / "repo")!r}, keep_last=1000, grace_seconds=0)
            return going
        e.Packer.finish = finish
    """
    r = run_cli(tmp_path, "publish", ckpts[1], "--repo", "repo", prelude=gc_every_time)
    # Warnings name each attempt; the last line is the error.
    assert r.rc == 1 and "Traceback" not in r.err, r.err
    lines = r.err.splitlines()
    assert lines[-1].startswith("deltasync: error: version 2 not committed: "), r.err
    assert all(line.startswith("deltasync: warning: ") or "storing it again" in line for line in lines[:-1]), r.err
    assert Repository(str(tmp_path / "repo")).versions() == [1]


WORLD = 2


def _rank_state(step: int, rank: int) -> dict[str, Any]:
    import deltasync

    g = torch.Generator().manual_seed(99)
    full = torch.randn(64, 256, generator=g).bfloat16()
    for k in range(step):
        full.view(-1)[(k * 131) % full.numel()] += 1.0
    rows = 64 // WORLD
    return {"w": deltasync.Slice(full[rank * rows : (rank + 1) * rows].clone(), (rank * rows, 0), (64, 256))}


def _distributed_worker(rank: int, port: int, url: str, times: int, queue: Any) -> None:
    import traceback

    import torch.distributed as dist

    from deltasync import DistributedPublisher, DistributedPublishError
    from deltasync.publish.distributed import DistributedPublisher as cls

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        pub = DistributedPublisher(url, config(), timeout=60)
        out: list[Any] = [int(pub.publish(_rank_state(0, rank)))]
        original = cls._finish
        runs: list[list[str]] = []  # what each gc deleted
        import deltasync.ops.retention as retention

        setattr(retention, "read_leases", lambda store: ([], []))  # noqa: B010 - a gc that reads no leases (older deltasync)

        def finish(self: Any, *a: Any, **kw: Any) -> Any:
            # Rank 0, after every rank's packs are durable and before the commit: a gc with no grace.
            if len(runs) < times:
                collect(url, keep_last=1000, grace_seconds=0)
                runs.append(collect(url, keep_last=1000, grace_seconds=0).packs_deleted)
            return original(self, *a, **kw)

        cls._finish = finish  # type: ignore[method-assign]
        try:
            out.append(int(pub.publish(_rank_state(1, rank))))
        except DistributedPublishError as e:
            out.append(f"error: {e}")
        cls._finish = original  # type: ignore[method-assign]
        out.append(int(pub.publish(_rank_state(2, rank))))
        out.append([len(r) for r in runs])
        queue.put((rank, out, None))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


@pytest.mark.slow
@pytest.mark.parametrize("times", [1, 100])
def test_distributed_publish_racing_gc_stores_packs_again_or_fails_on_every_rank(s3_url: str, times: int) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    procs = [ctx.Process(target=_distributed_worker, args=(r, port, s3_url, times, queue)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    results: dict[int, list[Any]] = {}
    try:
        for _ in range(WORLD):
            rank, out, err = queue.get(timeout=240)
            assert err is None, f"rank {rank} crashed:\n{err}"
            results[rank] = out
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    deleted = results[0][3]
    assert deleted and deleted[0] > 0, "gc deleted nothing: no race"
    if times == 1:
        assert results[0][:3] == results[1][:3] == [1, 2, 3]
    else:
        # One gc per check; a restored delta (its lost chunks stored in full) may also pass
        # max_delta_fraction and be encoded again as a snapshot, which gc races once more.
        assert len(deleted) >= commit_mod.COMMIT_ATTEMPTS, results
        for rank in range(WORLD):
            first, failed, retried = results[rank][:3]
            assert first == 1 and retried == 2
            assert isinstance(failed, str), results
            assert "version 2 not committed" in failed and "again after 3 attempts" in failed, failed
            assert "nothing was committed" in failed
    sub = Subscriber(s3_url, progress=False)
    for v in Repository(s3_url).versions():
        got = sub.pull(v)["w"]
        step = v - 1 if times == 1 else {1: 0, 2: 2}[v]
        want = torch.cat([_rank_state(step, r)["w"].tensor for r in range(WORLD)])
        assert bits(got) == bits(want), v
    assert verify_repository(s3_url, progress=False).versions == Repository(s3_url).versions()


# == 7a. checkpoint directories ===================================================================


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt", make_state(0), side_files=True)


def _publish_error(ckpt: Path, url: str, **kw: Any) -> str:
    with pytest.raises(CheckpointError) as info:
        Publisher(url, config(**kw)).publish_dir(ckpt)
    assert not Repository(url).exists() or Repository(url).versions() == []
    return str(info.value)


def test_file_link_out_of_the_directory_is_refused_unless_followed(ckpt: Path, tmp_path: Path) -> None:
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not for publishing\n")
    (ckpt / "notes.txt").symlink_to(secret)
    message = _publish_error(ckpt, str(tmp_path / "repo"))
    assert message.startswith(f"{ckpt / 'notes.txt'}: is a symbolic link to {secret}, outside the checkpoint directory")
    assert "--follow-symlinks" in message
    url = str(tmp_path / "repo2")
    v = Publisher(url, config(follow_symlinks=True)).publish_dir(ckpt)
    out = tmp_path / "pulled"
    Subscriber(url, progress=False).pull_to_dir(out, v)
    assert (out / "notes.txt").read_text() == "not for publishing\n"


def test_links_inside_the_directory_are_published(ckpt: Path, tmp_path: Path) -> None:
    # A relative link to a file of the checkpoint itself (as a pulled copy's links are).
    (ckpt / "config-alias.json").symlink_to("config.json")
    url = str(tmp_path / "repo")
    v = Publisher(url, config()).publish_dir(ckpt)
    out = tmp_path / "pulled"
    Subscriber(url, progress=False).pull_to_dir(out, v)
    assert (out / "config-alias.json").read_bytes() == (ckpt / "config.json").read_bytes()


def test_a_pulled_copy_can_be_published_again(ckpt: Path, tmp_path: Path) -> None:
    # Its files are links into its own .deltasync/current: inside the directory.
    url = str(tmp_path / "repo")
    Publisher(url, config()).publish_dir(ckpt)
    copy = tmp_path / "copy"
    Subscriber(url, progress=False).pull_to_dir(copy, 1)
    url2 = str(tmp_path / "repo2")
    Publisher(url2, config()).publish_dir(copy)
    out = tmp_path / "pulled"
    Subscriber(url2, progress=False).pull_to_dir(out, 1)
    assert tree_digests(out) == tree_digests(ckpt)


def test_linked_directory_is_refused_unless_followed(ckpt: Path, tmp_path: Path) -> None:
    extra = tmp_path / "tokenizer-files"
    extra.mkdir()
    (extra / "vocab.txt").write_text("a\nb\n")
    (ckpt / "tokenizer").symlink_to(extra, target_is_directory=True)
    message = _publish_error(ckpt, str(tmp_path / "repo"))
    assert message.startswith(f"{ckpt / 'tokenizer'}: is a symbolic link to a directory ({extra})")
    url = str(tmp_path / "repo2")
    v = Publisher(url, config(follow_symlinks=True)).publish_dir(ckpt)
    assert "tokenizer/vocab.txt" in [f.path for f in Repository(url).manifest(v).pb.files]


def test_link_loop_is_refused_even_when_followed(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "extra" / "deep" / "loop").symlink_to("../..", target_is_directory=True)
    message = _publish_error(ckpt, str(tmp_path / "repo"), follow_symlinks=True)
    assert message.startswith(f"{ckpt / 'extra' / 'deep' / 'loop'}: is a symbolic link loop")


def test_dangling_link_is_refused_naming_it(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "extra" / "gone.json").symlink_to("never-written.json")
    for follow in (False, True):
        message = _publish_error(ckpt, str(tmp_path / f"repo-{follow}"), follow_symlinks=follow)
        assert message.startswith(f"{ckpt / 'extra' / 'gone.json'}: is a dangling symbolic link (to 'never-written.json')")


def test_fifo_is_refused_naming_it(ckpt: Path, tmp_path: Path) -> None:
    os.mkfifo(ckpt / "events.pipe")
    for follow in (False, True):  # never opened: a FIFO would block the publish forever
        message = _publish_error(ckpt, str(tmp_path / f"repo-{follow}"), follow_symlinks=follow)
        assert message.startswith(f"{ckpt / 'events.pipe'}: is a FIFO (named pipe), not a regular file")


def test_socket_is_refused_naming_it(tmp_path: Path) -> None:
    # A short path: unix socket names are limited to about 100 bytes.
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"dsock-{os.getpid()}-{os.urandom(3).hex()}"
    ckpt = write_checkpoint(root, make_state(0), side_files=False)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(root / "s"))
            message = _publish_error(ckpt, str(tmp_path / "repo"))
        assert message.startswith(f"{root / 's'}: is a socket, not a regular file")
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def test_link_to_a_fifo_out_of_the_directory_is_refused_either_way(ckpt: Path, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (ckpt / "pipe").symlink_to(tmp_path / "pipe")
    assert "outside the checkpoint directory" in _publish_error(ckpt, str(tmp_path / "repo"))
    assert "FIFO" in _publish_error(ckpt, str(tmp_path / "repo2"), follow_symlinks=True)


@pytest.mark.parametrize("case", ["outside", "directory", "dangling", "fifo"])
def test_cli_checkpoint_entries_are_one_error_line(case: str, ckpt: Path, tmp_path: Path) -> None:
    bad = ckpt / "bad"
    if case == "outside":
        (tmp_path / "secret").write_text("x")
        bad.symlink_to(tmp_path / "secret")
        want = "outside the checkpoint directory"
    elif case == "directory":
        (tmp_path / "elsewhere").mkdir()
        bad.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
        want = "symbolic link to a directory"
    elif case == "dangling":
        bad.symlink_to("nowhere")
        want = "dangling symbolic link"
    else:
        os.mkfifo(bad)
        want = "FIFO"
    r = run_cli(tmp_path, "publish", ckpt, "--repo", "repo")
    one_error_line(r, f"{bad}: ", want)
    assert not (tmp_path / "repo" / "manifests").exists()
    if case in ("outside", "directory"):
        ok = run_cli(tmp_path, "publish", ckpt, "--repo", "repo", "--follow-symlinks")
        assert ok.rc == 0 and "published version 1" in ok.out, ok.err


# == 7b. temp files of killed publishers ==========================================================


def _killed_mid_write(tmp_path: Path, ckpt: Path, url: str) -> None:
    """A publisher SIGKILLed after writing a pack's temp file, before renaming it."""
    code = textwrap.dedent(f"""
        import os, signal
        import deltasync.storage._local as local
        real_fsync = os.fsync
        def fsync(fd):
            real_fsync(fd)
            if "packs" in os.readlink(f"/proc/self/fd/{{fd}}"):
                os.kill(os.getpid(), signal.SIGKILL)  # the temp file is written, not yet renamed
        local.os.fsync = fsync
        from deltasync import Publisher
        Publisher({url!r}).publish_dir({str(ckpt)!r})
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr


def test_temp_files_of_a_killed_publisher_are_reported_by_verify_and_removed_by_gc(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    ckpts = checkpoints(tmp_path, 2)
    Publisher(url, config()).publish_dir(ckpts[0])
    _killed_mid_write(tmp_path, ckpts[1], url)
    left = temp_files(Repository(url).store)
    assert left and all(t.path.startswith("packs/.") and t.path.endswith(".tmp-deltasync") for t in left)
    assert Repository(url).versions() == [1]
    report = verify_repository(url, progress=False)  # reported, not failing the repository
    assert report.versions == [1]
    assert any(f"{len(left)} temp file(s) of interrupted writes" in n and left[0].path in n for n in report.notes)
    # Within the grace period gc keeps them (maybe a write in progress); after it, they go.
    now = left[0].mtime + 10
    kept = collect(url, keep_last=5, grace_seconds=3600, clock=lambda: now)
    assert kept.temp_files_deleted == [] and kept.temp_files_pending == [t.path for t in left]
    kept = collect(url, keep_last=5, grace_seconds=3600, clock=lambda: now + 3599)
    assert kept.temp_files_deleted == [] and temp_files(Repository(url).store) == left
    dry = collect(url, keep_last=5, grace_seconds=3600, clock=lambda: now + 3600, dry_run=True)
    assert dry.temp_files_deleted == [t.path for t in left] and temp_files(Repository(url).store) == left
    gone = collect(url, keep_last=5, grace_seconds=3600, clock=lambda: now + 3600)
    assert gone.temp_files_deleted == [t.path for t in left]
    assert "removed 1 temp file(s)" in gone.summary() or f"removed {len(left)} temp file(s)" in gone.summary()
    assert gone.bytes_freed >= sum(t.size for t in left)
    assert temp_files(Repository(url).store) == []
    assert not any("temp file" in n for n in verify_repository(url, progress=False).notes)
    assert_every_version_pulls_exactly(url, {1: ckpts[0]}, tmp_path)


def test_a_fresh_temp_file_survives_a_short_grace(tmp_path: Path) -> None:
    # Seen twice by gc, but written just now: maybe a slow write in progress (mtime guard).
    url = str(tmp_path / "repo")
    ckpts = checkpoints(tmp_path, 1)
    Publisher(url, config()).publish_dir(ckpts[0])
    fresh = tmp_path / "repo" / "packs" / f".{'0' * 32}.pack.{'1' * 32}.tmp-deltasync"
    fresh.write_bytes(b"partial")
    t0 = os.stat(fresh).st_mtime
    collect(url, keep_last=5, grace_seconds=60, clock=lambda: t0 - 100)
    r = collect(url, keep_last=5, grace_seconds=60, clock=lambda: t0 + 30)
    assert fresh.exists() and r.temp_files_pending == [f"packs/{fresh.name}"]
    r = collect(url, keep_last=5, grace_seconds=60, clock=lambda: t0 + 60)
    assert not fresh.exists() and r.temp_files_deleted == [f"packs/{fresh.name}"]


def test_cli_verify_and_gc_after_a_killed_publisher(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    ckpts = checkpoints(tmp_path, 2)
    Publisher(url, config()).publish_dir(ckpts[0])
    _killed_mid_write(tmp_path, ckpts[1], url)
    v = run_cli(tmp_path, "verify", "--repo", "repo")
    assert v.rc == 0 and "temp file(s) of interrupted writes" in v.out + v.err, v.out + v.err
    assert run_cli(tmp_path, "gc", "--repo", "repo", "--keep-last", "5", "--grace", "0").rc == 0
    g = run_cli(tmp_path, "gc", "--repo", "repo", "--keep-last", "5", "--grace", "0")
    assert g.rc == 0 and "temp file(s) of interrupted writes" in g.out, g.out + g.err
    assert temp_files(Repository(url).store) == []


# == 7c. a symbolic link in place of .deltasync ====================================================


def _linked_state(tmp_path: Path) -> tuple[Path, Path]:
    copy, target = tmp_path / "copy", tmp_path / "elsewhere"
    copy.mkdir()
    target.mkdir()
    (copy / ".deltasync").symlink_to(target, target_is_directory=True)
    return copy, target


def test_a_linked_state_directory_is_refused_by_pulls(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    Publisher(url, config()).publish(make_state(0))
    copy, target = _linked_state(tmp_path)
    with pytest.raises(CheckpointError, match=r"\.deltasync: is a symbolic link .* remove the link"):
        Subscriber(url, progress=False).pull_to_dir(copy, 1)
    assert list(target.iterdir()) == []  # nothing written through it
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        read_local_state(copy)


def test_a_linked_publish_cache_state_directory_is_never_written_through(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    ckpts = checkpoints(tmp_path, 2)
    cache, target = _linked_state(tmp_path)
    r = Publisher(url, config()).publish_dir(ckpts[0], cache_dir=cache)  # committed: the cache is after
    assert r == 1 and len(r.warnings) == 1 and "is a symbolic link" in r.warnings[0]
    with pytest.raises(CheckpointError, match="is a symbolic link"):  # the cache is read before the next
        Publisher(url, config()).publish_dir(ckpts[1], cache_dir=cache)
    assert list(target.iterdir()) == []
    assert Repository(url).versions() == [1]


@pytest.mark.parametrize("command", ["pull", "status", "check"])
def test_cli_linked_state_directory_is_one_error_line(command: str, tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    Publisher(url, config()).publish(make_state(0))
    copy, target = _linked_state(tmp_path)
    args: list[str | Path] = [command, copy] if command == "status" else [command, copy, "--repo", "repo"]
    r = run_cli(tmp_path, *args)
    one_error_line(r, f"{copy / '.deltasync'}: is a symbolic link")
    assert list(target.iterdir()) == []


# -- the helpers above must be able to fail ---------------------------------------------------------


def test_the_race_hook_really_deletes_in_flight_packs_without_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the pre-commit check (stubbed to see nothing missing), the race commits a
    # version that cannot be pulled: the hook reproduces the failure.
    url = str(tmp_path / "repo")
    ckpts = checkpoints(tmp_path, 2)
    Publisher(url, config()).publish_dir(ckpts[0], cache_dir=tmp_path / "cache")
    GcBeforeCommit(url, monkeypatch, times=1)
    calls: list[int] = []

    def blind(*a: Any) -> list[str]:
        calls.append(1)
        return []

    monkeypatch.setattr(commit_mod, "missing_objects", blind)
    Publisher(url, config()).publish_dir(ckpts[1], cache_dir=tmp_path / "cache")
    assert calls
    with pytest.raises(CorruptObjectError, match=r"version 2: (pack|blob) .* is missing"):
        verify_repository(url, progress=False)


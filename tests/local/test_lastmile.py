"""The last mile: two slots, updates in place, atomic switches, readers, foreign files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_state, step_state, tree_digests, write_checkpoint

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Repository, Subscriber, UsageError
from deltasync.local.cache import CachedStore
from deltasync.local.check import check_copy
from deltasync.local.state import StateDB
from deltasync.storage import LocalStore

CHUNK = 64 << 10


def _config() -> PublisherConfig:
    return PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=CHUNK), workers=2, progress=False)


def _run(tmp_path: Path, n: int, *, shards: int = 1, fraction: float = 0.01) -> tuple[Path, list[Path]]:
    state = make_state(seed=0)
    repo, ckpts = tmp_path / "repo", []
    pub = Publisher(str(repo), _config())
    for step in range(1, n + 1):
        if step > 1:
            state = step_state(state, seed=step, fraction=fraction)
        ckpt = write_checkpoint(tmp_path / f"ckpt-{step}", state, shards=shards, step=step, side_files=False)
        pub.publish_dir(ckpt, cache_dir=tmp_path / "cache")
        ckpts.append(ckpt)
    assert not Repository(str(repo)).manifest(n).is_snapshot or n == 1
    return repo, ckpts


def _sub(repo: Path | Repository) -> Subscriber:
    return Subscriber(repo if isinstance(repo, Repository) else str(repo), workers=2, progress=False)


def test_round_trips_forward_back_and_forward_again_are_byte_identical(tmp_path: Path) -> None:
    repo, ckpts = _run(tmp_path, 6, shards=2)
    out = tmp_path / "out"
    for v in (1, 2, 3, 4, 5, 2, 3, 6, 1, 6):
        _sub(repo).pull_to_dir(out, v)
        assert tree_digests(out) == tree_digests(ckpts[v - 1]), v
        assert check_copy(out).ok
    # The served files are links through one switchable link.
    assert all(p.is_symlink() for p in out.iterdir() if not p.name.startswith("."))
    assert os.readlink(out / ".deltasync" / "current") in ("slots/0", "slots/1")


def test_an_update_touches_only_the_chunks_that_change(tmp_path: Path) -> None:
    """One tensor changes: every other chunk is skipped without being read, and the rest is
    applied in place; only the delta is fetched."""
    state = make_state(seed=0)
    repo = tmp_path / "repo"
    states = [state]
    changed = {**state}
    name = sorted(state)[0]
    t = changed[name].clone()
    t.view(-1)[0] = t.view(-1)[0] + 1
    changed[name] = t
    states.append(changed)
    states.append({**changed, name: t.clone()})  # version 3: nothing changes but the metadata
    pub = Publisher(str(repo), _config())
    for i, s in enumerate(states, 1):
        pub.publish_dir(write_checkpoint(tmp_path / f"c{i}", s, step=i, side_files=False), cache_dir=tmp_path / "cache")
    out = tmp_path / "out"
    _sub(repo).pull_to_dir(out, 1)
    _sub(repo).pull_to_dir(out, 2)  # the second slot's first use: a copy of the first
    store = CachedStore(LocalStore(str(repo)))
    result = _sub(Repository(store)).update_dir(out, 3)  # into the slot of version 1
    total = sum(len(x.chunks) for x in Repository(str(repo)).manifest(3).pb.tensors)
    assert result.walked == 1 and result.skipped == total - 1 and result.rebuilt == 0, result
    assert result.bytes_written == 0 and result.files_copied == 0
    assert store.fetched.get("packs", 0) <= Repository(str(repo)).manifest(2).pb.stored_bytes
    assert tree_digests(out) == tree_digests(tmp_path / "c3")


def test_a_reader_holding_old_files_is_never_shown_new_bytes(tmp_path: Path) -> None:
    repo, ckpts = _run(tmp_path, 4)
    out = tmp_path / "out"
    _sub(repo).pull_to_dir(out, 1)
    v1 = (out / "model.safetensors").read_bytes()
    reader = subprocess.Popen(
        [sys.executable, "-c",
         "import mmap, sys\n"
         "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
         "print('open', flush=True); sys.stdin.readline()\n"
         "sys.stdout.buffer.write(m[:]); sys.stdout.flush()",
         str(out / "model.safetensors")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )
    try:
        assert reader.stdout is not None and reader.stdin is not None
        assert reader.stdout.readline() == b"open\n"
        for v in (2, 3, 4):  # version 3 is written into the slot the reader mapped
            _sub(repo).pull_to_dir(out, v)
            assert tree_digests(out) == tree_digests(ckpts[v - 1])
        reader.stdin.write(b"\n")
        reader.stdin.flush()
        seen = reader.stdout.read()
    finally:
        reader.kill()
        reader.wait()
    assert seen == v1  # the mapped file kept version 1's bytes throughout
    assert (out / "model.safetensors").read_bytes() != v1


def test_foreign_files_are_refused_or_moved_aside(tmp_path: Path) -> None:
    repo, ckpts = _run(tmp_path, 2, shards=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"stale single-file weights")  # the version is sharded
    (out / "notes.txt").write_text("mine")  # not read by loaders: left alone
    with pytest.raises(UsageError, match=r"model\.safetensors"):
        _sub(repo).pull_to_dir(out, 1)
    assert not (out / ".deltasync" / "current").exists()
    _sub(repo).pull_to_dir(out, 1, move_aside=True)
    assert tree_digests(out) == {**tree_digests(ckpts[0]), "notes.txt": tree_digests(out)["notes.txt"]}
    aside = list((out / ".deltasync" / "aside").rglob("model.safetensors"))
    assert len(aside) == 1 and aside[0].read_bytes() == b"stale single-file weights"
    # A config edited by hand in place of the version's link is found by check, and refused by a pull.
    (out / "config.json").unlink(missing_ok=True)
    (out / "generation_config.json").write_text("{}")
    report = check_copy(out)
    assert report.foreign == ["generation_config.json"] and not report.ok
    with pytest.raises(UsageError, match=r"generation_config\.json"):
        _sub(repo).pull_to_dir(out, 2)
    assert check_copy(out, repair=True, move_aside=True).ok
    _sub(repo).pull_to_dir(out, 2)
    assert tree_digests(out) == {**tree_digests(ckpts[1]), "notes.txt": tree_digests(out)["notes.txt"]}


def test_writes_through_a_link_are_found_and_repaired(tmp_path: Path) -> None:
    """A served file written through its link is no longer trusted by its recorded digests:
    the next pull to the same version repairs it, and a later pull into its slot hashes it."""
    repo, ckpts = _run(tmp_path, 3)
    out = tmp_path / "out"
    for v in (1, 2):
        _sub(repo).pull_to_dir(out, v)
    with open(out / "model.safetensors", "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 50)
    assert _sub(repo).update_dir(out, 2).held
    assert tree_digests(out) == tree_digests(ckpts[1])
    _sub(repo).pull_to_dir(out, 1)  # slot of version 2 (repaired) and of 1: both trusted
    with open(out / "model.safetensors", "r+b") as f:  # damage version 1 while it is served
        f.seek(-100, os.SEEK_END)
        f.write(b"\x00" * 50)
    _sub(repo).pull_to_dir(out, 2)
    _sub(repo).pull_to_dir(out, 3)  # into the damaged slot of version 1: hashed, rebuilt where needed
    assert tree_digests(out) == tree_digests(ckpts[2])


def test_after_a_power_loss_the_served_slot_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deltasync.local import slots

    repo, ckpts = _run(tmp_path, 3)
    out = tmp_path / "out"
    for v in (1, 2):
        _sub(repo).pull_to_dir(out, v)
    db = StateDB.open(out)
    assert db is not None
    record = db.slots()
    assert record is not None and not record.synced  # no flush by default
    # Lost writes: bytes that never reached the disk, with the file's stat as recorded.
    target = out / ".deltasync" / "current" / "model.safetensors"
    st = os.stat(target)
    with open(target, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\x00" * 50)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    monkeypatch.setattr(slots, "boot_id", lambda: "another-boot")
    _sub(repo).pull_to_dir(out, 3)
    assert tree_digests(out) == tree_digests(ckpts[2])
    _sub(repo).pull_to_dir(out, 2)
    assert tree_digests(out) == tree_digests(ckpts[1])
    record = db.slots()
    assert record is not None and record.boot_id == "another-boot"


def test_fsync_marks_the_slot_flushed(tmp_path: Path) -> None:
    repo, _ckpts = _run(tmp_path, 2)
    out = tmp_path / "out"
    _sub(repo).pull_to_dir(out, 1, fsync=True)
    db = StateDB.open(out)
    assert db is not None
    record = db.slots()
    assert record is not None and record.synced


def test_a_copy_of_older_deltasync_is_moved_into_a_slot(tmp_path: Path) -> None:
    """Files in DIR itself (the layout before slots) are hard-linked into slot 0 and replaced
    by links; the next pull is incremental."""
    import shutil

    repo, ckpts = _run(tmp_path, 2)
    out = tmp_path / "out"
    _sub(repo).pull_to_dir(out, 1)
    slot = out / ".deltasync" / "slots" / "0"
    for p in list(out.iterdir()):
        if p.is_symlink():
            p.unlink()
            shutil.copyfile(slot / p.name, p)
    shutil.rmtree(out / ".deltasync" / "slots")
    (out / ".deltasync" / "current").unlink()
    db = StateDB.open(out)
    assert db is not None
    db._write(lambda txn: txn.delete(b"slots"))
    before = os.stat(out / "model.safetensors").st_ino
    result = _sub(repo).update_dir(out, 2)
    assert result.rebuilt == 0 and result.walked > 0
    assert tree_digests(out) == tree_digests(ckpts[1])
    assert (out / "model.safetensors").is_symlink()
    assert before in {os.stat(p).st_ino for p in (out / ".deltasync" / "slots").rglob("*")}


def test_a_torch_module_loads_the_served_directory(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    repo, ckpts = _run(tmp_path, 2)
    out = tmp_path / "out"
    for v in (1, 2):
        _sub(repo).pull_to_dir(out, v)
    got = load_file(str(out / "model.safetensors"))
    want = load_file(str(ckpts[1] / "model.safetensors"))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in got)


class _PackReads(LocalStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.packs = 0

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        if key.startswith("packs/"):
            self.packs += 1
        return super()._get(key, byte_range)


def test_an_engine_takes_the_change_from_the_copy_without_fetching(tmp_path: Path) -> None:
    """Requirement 6: the agent's fetch and decode serve the engine too. An engine given the
    copy reads its changed chunks from the served slot (verified), fetching nothing; when
    the copy serves another version, or its bytes are damaged, the engine fetches instead."""
    from safetensors.torch import load_file

    from deltasync.engines.torch_engine import TorchEngine

    repo, ckpts = _run(tmp_path, 4)
    out = tmp_path / "out"
    _sub(repo).pull_to_dir(out, 1)
    weights = {k: v.clone() for k, v in load_file(str(ckpts[0] / "model.safetensors")).items()}
    store = _PackReads(repo)
    engine = TorchEngine(weights, Repository(store), version=1, workers=2, copy=out)

    def expect(v: int) -> None:
        want = load_file(str(ckpts[v - 1] / "model.safetensors"))
        assert all(torch.equal(weights[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want), v

    _sub(repo).pull_to_dir(out, 2)
    record = engine.update(2)
    assert record is not None and record.fetched_bytes == 0 and store.packs == 0
    assert record.chunks_changed > 0 and record.elements_changed > 0
    expect(2)
    # The copy is behind the version asked for: the engine fetches it itself.
    record = engine.update(3)
    assert record is not None and record.fetched_bytes > 0 and store.packs > 0
    expect(3)
    # A served file damaged behind the agent's back is noticed by digest; nothing wrong is swapped in.
    _sub(repo).pull_to_dir(out, 4)
    served = (out / "model.safetensors").resolve()
    with open(served, "r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(bytes(64))
    store.packs = 0
    record = engine.update(4)
    assert record is not None and store.packs > 0
    expect(4)

"""The agent (``deltasync subscribe``), local state, crash safety, check/repair, rollback and pin.

Every end state is checked byte for byte (sha256 of every file). Crash safety is tested by
killing ``deltasync subscribe`` with SIGKILL at random points of updates (over a store whose
bandwidth the test limits, so that an update takes long enough to be cut anywhere) and by
corrupting local bytes; downloads are counted with a wrapper store or the agent's counters.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_helpers import State, make_state, step_state, tree_digests, write_checkpoint

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Repository, Subscriber
from deltasync.agents import Agent, AgentConfig, Update, read_status
from deltasync.errors import StoreError, UsageError
from deltasync.format.codec import DENSE, FULL, SAME, SPARSE, decode_reverse
from deltasync.local.cache import CachedStore
from deltasync.local.check import check_copy
from deltasync.local.placement import placements
from deltasync.local.state import CopyInUseError, PullStopped, StateDB, read_local_state
from deltasync.metrics import Metric, render
from deltasync.retry import Backoff
from deltasync.storage import LocalStore, Store, WrappingStore

CHUNK = 16 << 10
BIG_LAYOUT: list[tuple[str, tuple[int, ...], torch.dtype]] = [
    (f"model.layers.{i}.mlp.weight", (1024, 1024), torch.bfloat16) for i in range(4)
]  # 8 MiB


def config(**kw: object) -> PublisherConfig:
    return PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=CHUNK), workers=2, progress=False, **kw)  # type: ignore[arg-type]


class CountingStore(WrappingStore):
    """A store that records every read (key, bytes) and can fail reads on demand."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.reads: list[tuple[str, int]] = []
        self.fail_packs = 0  # the next N pack reads raise StoreError
        self._lock = threading.Lock()

    def bytes_read(self, prefix: str = "") -> int:
        with self._lock:
            return sum(n for k, n in self.reads if k.startswith(prefix))

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        with self._lock:
            if key.startswith("packs/") and self.fail_packs:
                self.fail_packs -= 1
                raise StoreError(f"simulated outage reading {key}")
        data = self.inner.get(key, byte_range)
        with self._lock:
            self.reads.append((key, len(data)))
        return data


@dataclass
class Run:
    """A training run publishing checkpoint directories into a repository."""

    root: Path
    pub_config: PublisherConfig
    layout: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
    fraction: float = 0.02
    ckpts: dict[int, Path] = field(default_factory=dict)
    state: State | None = None

    @property
    def repo(self) -> str:
        return str(self.root / "repo")

    def publish(self, n: int = 1) -> int:
        pub = Publisher(self.repo, self.pub_config)
        v = 0
        for _ in range(n):
            step = len(self.ckpts) + 1
            if self.state is None:
                self.state = make_state(0, self.layout) if self.layout else make_state(0)
            else:
                self.state = step_state(self.state, seed=step, fraction=self.fraction)
            ckpt = write_checkpoint(self.root / f"step-{step}", self.state, step=step, side_files=self.layout is None)
            v = pub.publish_dir(ckpt, base_dir=self.ckpts.get(step - 1))
            assert v == step
            self.ckpts[v] = ckpt
        return v

    def digests(self, version: int) -> dict[str, str]:
        return tree_digests(self.ckpts[version])


@pytest.fixture
def run(tmp_path: Path) -> Run:
    return Run(tmp_path, config())


def agent(store: str | Store, out: Path, **kw: object) -> Agent:
    return Agent(store, out, AgentConfig(workers=2, **kw))  # type: ignore[arg-type]


def counting(run: Run) -> CountingStore:
    return CountingStore(LocalStore(run.repo))


# -- the codec runs backwards ------------------------------------------------------------------------


def test_decode_reverse_inverts_decode_for_every_reversible_encoding() -> None:
    codec = PlanesZstdCodec(max_classes=0)  # codec version 1: no chunk depends on its base's magnitudes
    rng = np.random.default_rng(0)
    seen: set[tuple[int, int | None]] = set()
    for trial in range(240):
        width = (1, 2, 4, 8)[trial % 4]
        u = np.dtype(f"u{width}")
        base = rng.integers(0, 256, 8192, dtype=np.uint8)
        t = base.copy().view(u)
        changed = rng.random(len(t)) < (0.0005, 0.01, 0.2, 0.7, 0.97)[trial % 5]
        one = np.ones(1, dtype=u)
        if trial % 3 == 0:
            t[changed] += one  # +1 ulp: a zigzag difference wins
        elif trial % 3 == 1:
            t[changed] -= one
        else:
            t[changed] ^= one << np.array(8 * width - 1, dtype=u)  # sign flips: XOR wins
        target = t.view(np.uint8)
        enc = codec.encode(target, base, width)
        if enc.encoding == FULL:
            with pytest.raises(UsageError):
                decode_reverse(codec, enc, target, width)
            continue
        assert np.array_equal(codec.decode(enc, base, width, len(base)), target)
        assert np.array_equal(decode_reverse(codec, enc, target, width), base), (trial, enc.encoding)
        seen.add((enc.encoding, enc.payload[0] if enc.payload else None))
    # sparse with XOR, zigzag and 2-bit zigzag; dense with XOR and zigzag; same.
    assert {(SPARSE, 0), (SPARSE, 1), (DENSE, 0), (DENSE, 1), (SAME, None)} <= seen


# -- local state, resume, install journal ------------------------------------------------------------


def test_state_lives_in_lmdb_and_a_legacy_state_file_is_read(run: Run, tmp_path: Path) -> None:
    run.publish(2)
    out = tmp_path / "out"
    Subscriber(run.repo, workers=2, progress=False).pull_to_dir(out, 1)
    state = read_local_state(out)
    assert state is not None and state.version == 1 and state.repo == os.path.abspath(run.repo)
    assert (out / ".deltasync" / "state.lmdb" / "data.mdb").is_file()
    db = StateDB.open(out)
    assert db is not None and db.wip() is None
    held = db.manifest()
    assert held is not None and held.version == 1
    # A copy written by an older deltasync (state.json) is still recognised and pulled incrementally.
    legacy = tmp_path / "legacy"
    Subscriber(run.repo, progress=False).pull_to_dir(legacy, 1)
    raw = {"version": 1, "version_digest": held.pb.version_digest.hex(), "files": list(state.files)}
    import shutil

    shutil.rmtree(legacy / ".deltasync")
    (legacy / ".deltasync").mkdir()
    (legacy / ".deltasync" / "state.json").write_text(json.dumps(raw))
    legacy_state = read_local_state(legacy)
    assert legacy_state is not None and legacy_state.version == 1
    sub = Subscriber(run.repo, progress=False)
    assert sub.update_dir(legacy, 2).plan_base == 1
    assert tree_digests(legacy) == run.digests(2)
    assert not (legacy / ".deltasync" / "state.json").exists()


def test_the_state_map_grows_as_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import deltasync.local.state as localstate

    monkeypatch.setattr(localstate, "_MAP_SIZE", 64 << 10)
    db = StateDB.open(tmp_path / "copy")
    assert db is not None
    db.update_stats({"big": "x" * (1 << 20)})  # 16 times the initial map
    assert len(db.stats()["big"]) == 1 << 20 and db.env.info()["map_size"] > 1 << 20


def test_interrupted_pull_resumes_with_its_staged_chunks(tmp_path: Path) -> None:
    # Packs of 64 KiB: a resumed pull reads whole the packs it still needs a chunk of.
    run = Run(tmp_path, config(max_delta_fraction=10.0, pack_bytes=64 << 10), layout=BIG_LAYOUT, fraction=0.3)
    run.publish(2)
    out, ref = tmp_path / "out", tmp_path / "ref"
    for d in (out, ref):
        Subscriber(run.repo, workers=2, progress=False).pull_to_dir(d, 1)
    clean = CachedStore(LocalStore(run.repo))
    Subscriber(Repository(clean), workers=2, progress=False).pull_to_dir(ref, 2)

    chunks = [0]

    def stop() -> bool:
        chunks[0] += 1
        return chunks[0] > 300  # of 512

    first = CachedStore(LocalStore(run.repo))
    with pytest.raises(PullStopped):
        Subscriber(Repository(first), workers=2, progress=False).pull_to_dir(out, 2, stop=stop)
    state = read_local_state(out)
    assert state is not None and state.version == 1  # the copy still holds version 1 ...
    db = StateDB.open(out)
    assert db is not None
    wip = db.wip()
    assert wip is not None and wip.target == 2 and wip.phase == "fetch"  # ... and remembers the pull
    resumed = CachedStore(LocalStore(run.repo))
    Subscriber(Repository(resumed), workers=2, progress=False).pull_to_dir(out, 2)
    assert tree_digests(out) == run.digests(2)
    assert db.wip() is None and not (out / ".deltasync" / "incoming").exists()
    packs = clean.fetched["packs"]
    assert resumed.fetched.get("packs", 0) < 0.7 * packs, (resumed.fetched, packs)


@pytest.mark.parametrize("step", ["current", "record"])
def test_a_kill_inside_the_switch_is_finished_not_redone(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    run.publish(3)
    out = tmp_path / "out"
    Subscriber(run.repo, progress=False).pull_to_dir(out, 1)
    real_replace = os.replace

    def dying_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if str(dst).endswith("current"):
            raise KeyboardInterrupt  # the process dies at the switch itself
        real_replace(src, dst)

    def dying_record(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # the process dies after the switch, before recording it

    if step == "current":
        monkeypatch.setattr(os, "replace", dying_replace)
    else:
        monkeypatch.setattr(StateDB, "record_switch", dying_record)
    with pytest.raises(KeyboardInterrupt):
        Subscriber(run.repo, progress=False).pull_to_dir(out, 3)
    monkeypatch.undo()
    db = StateDB.open(out)
    assert db is not None
    wip = db.wip()
    assert wip is not None and wip.phase == "install" and wip.target == 3
    # Readers see version 1 whole until the switch, and version 3 whole from it.
    assert tree_digests(out) == run.digests(1 if step == "current" else 3)
    store = counting(run)
    sub = Subscriber(Repository(store), progress=False)
    assert sub.pull_to_dir(out, 3) == 3  # finishes the switch, then finds every chunk in place
    assert tree_digests(out) == run.digests(3)
    assert store.bytes_read("packs/") == 0 and store.bytes_read("blobs/") == 0


def test_another_process_cannot_change_a_copy_in_use(run: Run, tmp_path: Path) -> None:
    run.publish(1)
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from deltasync.local.state import copy_lock\n"
         "with copy_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(30)", str(out)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(CopyInUseError, match=f"pid {holder.pid}"):
            Subscriber(run.repo, progress=False).pull_to_dir(out)
    finally:
        holder.kill()
        holder.wait()
    Subscriber(run.repo, progress=False).pull_to_dir(out)
    assert tree_digests(out) == run.digests(1)


# -- check and repair --------------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_check_finds_and_repair_fetches_exactly_the_drifted_chunks(run: Run, tmp_path: Path) -> None:
    run.publish(3)
    out = tmp_path / "out"
    assert agent(run.repo, out).run() == 3
    repo = Repository(run.repo)
    info = repo.manifest(3)
    places = placements(info)
    a, b = sorted(places)[0], sorted(places)[-1]
    damaged = [(a, 1), (b, 0)]
    for key, idx in damaged:
        p = places[key]
        _flip(out / p.file, p.start + idx * CHUNK + 5)
    (out / "config.json").write_text("{}")

    report = check_copy(out)
    assert not report.ok and report.version == 3
    found = {(d.tensor, d.chunk) for d in report.drifted if d.tensor}
    assert found == {(places[k].tensor.name, i) for k, i in damaged}
    assert {d.file for d in report.drifted if not d.tensor} == {"config.json"}

    store = counting(run)
    fixed = check_copy(out, repo=Repository(store), repair=True)
    assert fixed.ok and fixed.repaired
    assert tree_digests(out) == run.digests(3)
    assert check_copy(out).drifted == []
    # Exactly the chunks' records along the snapshot chain were read (plus config.json's blob).
    chain = repo.chain(3)
    expected = 0
    for key, idx in damaged:
        for step in reversed(chain):
            c = step.entries()[key].chunks[idx]
            expected += c.length
            if c.encoding == FULL:
                break
    assert store.bytes_read("packs/") == expected
    blob = next(f for f in info.pb.files if f.path == "config.json")
    assert {k for k, _ in store.reads if k.startswith("blobs/")} == {f"blobs/{d.hex()}" for d in blob.blob_parts}


def test_check_repairs_truncated_and_missing_files(tmp_path: Path) -> None:
    run = Run(tmp_path, config())
    pub = Publisher(run.repo, run.pub_config)
    state = make_state(0)
    ckpt = write_checkpoint(tmp_path / "ckpt", state, shards=2)
    pub.publish_dir(ckpt)
    out = tmp_path / "out"
    Subscriber(run.repo, progress=False).pull_to_dir(out)
    shards = sorted(out.glob("model-*.safetensors"))
    with open(shards[0], "r+b") as f:
        f.truncate(shards[0].stat().st_size // 2)
    shards[1].unlink()
    report = check_copy(out)
    problems = {d.detail for d in report.drifted if not d.tensor}
    assert any(p.startswith("size") for p in problems) and "missing" in problems
    assert check_copy(out, repair=True).repaired
    assert tree_digests(out) == tree_digests(ckpt)


# -- rollback ----------------------------------------------------------------------------------------


def _follow_each(run: Run, out: Path, store: Store, versions: int, **kw: object) -> None:
    """Publish ``versions`` versions; the agent updates after each (so it applies every delta)."""
    for _ in range(versions):
        v = run.publish()
        assert agent(store, out, **kw).run() == v
        assert tree_digests(out) == run.digests(v)


def test_rollback_of_a_few_versions_downloads_nothing(run: Run, tmp_path: Path) -> None:
    out = tmp_path / "out"
    store = counting(run)
    _follow_each(run, out, store, 6)
    store.reads.clear()
    a = agent(store, out)
    u = a.rollback(3)
    assert u is not None and u.version == 3 and u.previous == 6 and u.how.startswith("local")
    assert tree_digests(out) == run.digests(3)
    assert store.reads == [] and u.fetched_bytes == 0  # not one object read from the repository
    back = a.rollback(6)  # and forward again: the kept payloads serve as well
    assert back is not None and back.how.startswith("local")
    assert tree_digests(out) == run.digests(6) and store.reads == []
    assert a.rollback(6) is None


def test_rollback_past_the_kept_deltas_and_across_a_snapshot(tmp_path: Path) -> None:
    run = Run(tmp_path, config(snapshot_every=4))  # versions 1 and 5 are snapshots
    out = tmp_path / "out"
    store = counting(run)
    _follow_each(run, out, store, 7, keep_versions=2)
    repo = Repository(run.repo)
    assert [repo.manifest(v).is_snapshot for v in range(1, 8)] == [True, False, False, False, True, False, False]

    # 7 -> 5: deltas 6 and 7 were kept: nothing downloaded.
    store.reads.clear()
    u = agent(store, out, keep_versions=2).rollback(5)
    assert u is not None and u.how.startswith("local") and store.bytes_read("packs/") == 0
    assert tree_digests(out) == run.digests(5)

    # 4 is behind snapshot 5: no delta chain leads there; snapshot 1 plus its chain does.
    store.reads.clear()
    u = agent(store, out, keep_versions=2).rollback(4)
    assert u is not None and u.how.startswith("pull from a snapshot")
    assert tree_digests(out) == run.digests(4)
    snapshot_packs = {p.key for p in repo.manifest(1).pb.packs}
    assert snapshot_packs & {k for k, _ in store.reads}

    # 4 -> 2 on a copy that kept nothing of 3 and 4: reversing reads their (small) payloads.
    store.reads.clear()
    u = agent(store, out, keep_versions=0).rollback(2)
    assert u is not None and u.how.startswith("local")
    assert tree_digests(out) == run.digests(2)
    deltas = sum(p.size for v in (3, 4) for p in repo.manifest(v).pb.packs)
    assert 0 < store.bytes_read("packs/") <= deltas
    assert not snapshot_packs & {k for k, _ in store.reads}


def test_rollback_of_magnitude_class_chunks_rebuilds_them_bit_exact(tmp_path: Path) -> None:
    # Weight-like versions (small weights change more often), so the default codec codes
    # positions in classes of the base: those chunks do not reverse, and a rollback past the
    # other slot rebuilds them from the snapshot chain instead; the copy is bit-exact either way.
    rng = np.random.default_rng(5)
    w = (rng.normal(0, 1, 120_000) * np.exp(rng.normal(-4, 1.5, 120_000))).astype(np.float32)
    pub = Publisher(str(tmp_path / "repo"), config())
    store = CountingStore(LocalStore(tmp_path / "repo"))
    out, ckpts = tmp_path / "out", {}
    for v in range(1, 6):
        ckpts[v] = write_checkpoint(tmp_path / f"step-{v}", {"w": torch.from_numpy(w.copy()).to(torch.bfloat16)}, step=v)
        assert pub.publish_dir(ckpts[v], base_dir=ckpts.get(v - 1)) == v
        assert agent(store, out).run() == v
        w = w + rng.normal(0, 5e-6, len(w)).astype(np.float32)
    repo = Repository(str(tmp_path / "repo"))
    sparse = [repo.store.get(repo.manifest(v).pb.packs[c.pack].key, (c.offset, c.length))[1]
              for v in range(2, 6) for t in repo.manifest(v).pb.tensors for c in t.chunks if c.encoding == SPARSE]
    assert 3 in sparse, "some chunks coded in magnitude classes"
    u = agent(store, out).rollback(2)
    assert u is not None and u.version == 2
    assert tree_digests(out) == tree_digests(ckpts[2])
    forward = agent(store, out).rollback(5)  # and forward again
    assert forward is not None and tree_digests(out) == tree_digests(ckpts[5])


def test_rollback_command_uses_the_recorded_repository(run: Run, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _follow_each(run, out, LocalStore(run.repo), 3)
    r = _cli("rollback", out, "--to", "1")
    assert r.returncode == 0, r.stderr
    assert "from version 3 to version 1" in r.stdout and "0 B fetched" in r.stdout
    assert tree_digests(out) == run.digests(1)
    assert "already at version 1" in _cli("rollback", out, "--to", "1").stdout


# -- following, pin, retries ---------------------------------------------------------------------------


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for ``condition`` to hold; the timeout only bounds a failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Follower:
    """An agent following in a thread; ``wait_for`` wakes on its updates."""

    def __init__(self, store: str | Store, out: Path, **kw: object) -> None:
        kw.setdefault("poll_interval", 0.05)
        self.changed = threading.Condition()  # notified after each update, and when the agent ends
        self.agent = Agent(store, out, AgentConfig(workers=2, **kw), on_update=self._updated)  # type: ignore[arg-type]
        self.error: BaseException | None = None
        self.ended = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _updated(self, update: Update) -> None:
        with self.changed:
            self.changed.notify_all()

    def _run(self) -> None:
        try:
            self.agent.run(follow=True)
        except BaseException as e:
            self.error = e
        finally:
            with self.changed:
                self.ended = True
                self.changed.notify_all()

    def wait_for(self, version: int, timeout: float = 30.0) -> None:
        """Wait until the copy holds ``version``; the timeout only bounds a failure."""
        with self.changed:
            self.changed.wait_for(lambda: self.ended or self.agent.current() == version, timeout)
        assert self.error is None, self.error
        assert self.agent.current() == version, f"still at {self.agent.current()}, waiting for {version}"

    def stop(self) -> None:
        self.agent.stop()
        self.thread.join(60)  # bounds a failure only
        assert not self.thread.is_alive() and self.error is None, self.error


def test_pin_moves_following_agents_back_and_forth(run: Run, tmp_path: Path) -> None:
    run.publish(1)
    out = tmp_path / "out"
    store = counting(run)
    f = Follower(store, out)
    try:
        f.wait_for(1)
        for _ in range(3):
            f.wait_for(run.publish())
        assert tree_digests(out) == run.digests(4)
        repo = Repository(run.repo)
        reads = len(store.reads)
        repo.pin(2)  # e.g. the evaluation of 3 and 4 failed
        f.wait_for(2)
        assert tree_digests(out) == run.digests(2)
        assert not any(k.startswith("packs/") for k, _ in store.reads[reads:])  # reversed locally
        repo.pin(3)
        f.wait_for(3)
        assert tree_digests(out) == run.digests(3)
        run.publish()  # 5 appears while pinned: the agent sees it and stays at the pin
        wait_until(lambda: f.agent.figures.latest_version == 5)
        seen = len(store.reads)
        wait_until(lambda: any(k == "refs/pin" for k, _ in store.reads[seen:]))  # the next poll: done with 5
        assert f.agent.current() == 3 and read_status(out)["pinned_version"] == 3
        repo.pin(None)
        f.wait_for(5)
        assert tree_digests(out) == run.digests(5)
        status = read_status(out)
        assert status["pinned_version"] is None and status["lag_versions"] == 0
    finally:
        f.stop()


def test_upstream_errors_are_retried_with_backoff_and_idle_polling_is_cheap(
    run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run.publish(2)
    out = tmp_path / "out"
    store = counting(run)
    store.fail_packs = 1
    a = agent(store, out, backoff_initial=0.01, backoff_max=0.05)
    assert a.run() == 2 and tree_digests(out) == run.digests(2)
    status = read_status(out)
    assert status["errors_total"] == 1 and "simulated outage" in status["last_error"]

    run.publish()
    store.fail_packs = 10**9  # down for good: a one-shot run gives up after its attempts
    a = agent(store, out, backoff_initial=0.01, backoff_max=0.05, retries=3)
    waits: list[float] = []
    next_wait = Backoff.next

    def recorded(self: Backoff) -> float:
        waits.append(next_wait(self))
        return waits[-1]

    monkeypatch.setattr(Backoff, "next", recorded)
    with pytest.raises(StoreError, match="simulated outage"):
        a.run()
    assert len(waits) == 2 and all(0 < w <= 0.05 for w in waits), waits  # between the 3 attempts, bounded
    assert read_status(out)["errors_total"] == 1 + 3
    store.fail_packs = 0

    f = Follower(store, out)  # idle: a few small reads per poll, and no busy loop
    try:
        f.wait_for(3)
        reads, cpu, start = len(store.reads), time.process_time(), time.monotonic()
        time.sleep(2.0)  # the window measured
        wait_until(lambda: len(store.reads) >= reads + 2)  # a poll in it, however loaded the machine
        cpu, elapsed = time.process_time() - cpu, time.monotonic() - start
        polls = len(store.reads) - reads
        assert all(k.startswith("refs/") for k, _ in store.reads[reads:])
        assert polls <= 2 * (elapsed / 0.05 + 2), (polls, elapsed)  # refs/latest and refs/pin every 50 ms at most
        # CPU of the whole process (the agent's threads, not this sleeping one): idle polling
        # takes a few percent of a core, a busy loop all of its share of one.
        assert cpu < 0.25 * elapsed, (cpu, elapsed)
    finally:
        f.stop()


def test_backoff_is_bounded_and_jittered() -> None:
    b = Backoff(0.5, 4.0, rng=random.Random(0))
    waits = [b.next() for _ in range(8)]
    assert all(0.25 <= w <= 4.0 for w in waits) and waits[-1] >= 2.0
    b.reset()
    assert b.next() <= 0.5


def test_metrics_text_format() -> None:
    text = render([
        Metric("deltasync_current_version", "gauge", "Version held", 7),
        Metric("deltasync_bytes_fetched_by_kind_total", "counter", "Bytes", 10, {"kind": "packs"}),
        Metric("deltasync_bytes_fetched_by_kind_total", "counter", "Bytes", 3.5, {"kind": 'we"ird'}),
        Metric("deltasync_pinned_version", "gauge", "Pin", None),
    ])
    assert text.splitlines() == [
        "# HELP deltasync_current_version Version held",
        "# TYPE deltasync_current_version gauge",
        "deltasync_current_version 7.0",
        "# HELP deltasync_bytes_fetched_by_kind_total Bytes",
        "# TYPE deltasync_bytes_fetched_by_kind_total counter",
        'deltasync_bytes_fetched_by_kind_total{kind="packs"} 10.0',
        'deltasync_bytes_fetched_by_kind_total{kind="we\\"ird"} 3.5',
        "# HELP deltasync_pinned_version Pin",
        "# TYPE deltasync_pinned_version gauge",
    ]


# -- the command line, in subprocesses ----------------------------------------------------------------


def _cli(*args: object, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deltasync", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def _readline(p: subprocess.Popen[str], timeout: float = 20) -> str:
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    assert ready, "no output from the agent"
    return p.stdout.readline()


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=")
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_subscribe_once_pin_and_status(run: Run, tmp_path: Path) -> None:
    run.publish(3)
    out = tmp_path / "out"
    r = _cli("subscribe", "--repo", run.repo, "--out", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == f"{out} is at version 3"
    assert tree_digests(out) == run.digests(3)
    status = json.loads(_cli("status", out, "--json").stdout)
    assert status["version"] == 3 and status["lag_versions"] == 0 and status["lag_seconds"] == 0
    assert status["running"] is False and status["bytes_fetched_total"] > 0 and status["wip"] is None
    text = _cli("status", out).stdout
    assert "version      3" in text and "lag          0 version(s), 0.0s" in text

    assert _cli("pin", "--repo", run.repo, "2").returncode == 0
    assert "pinned version 2" in _cli("pin", "--repo", run.repo).stdout
    r = _cli("subscribe", "--repo", run.repo, "--out", out)
    assert "version 2 (local:" in r.stdout and tree_digests(out) == run.digests(2)
    assert "not pinned" in _cli("pin", "--repo", run.repo, "--clear").stdout.replace("pin cleared", "not pinned")
    assert _cli("subscribe", "--repo", run.repo, "--out", out).returncode == 0
    assert tree_digests(out) == run.digests(3)
    bad = _cli("pin", "--repo", run.repo, "9")
    assert bad.returncode != 0 and bad.stderr.startswith("deltasync: error: version 9 not found")
    r = _cli("check", out)
    assert r.returncode == 0 and r.stdout.strip().endswith(": ok")
    _flip(out / "model.safetensors", (out / "model.safetensors").stat().st_size - 3)
    r = _cli("check", out)
    assert r.returncode == 1 and "drifted: model.safetensors: tensor" in r.stdout
    r = _cli("check", out, "--repair")
    assert r.returncode == 0 and "repaired 1" in r.stdout and tree_digests(out) == run.digests(3)


def test_follow_notices_each_version_within_a_second(run: Run, tmp_path: Path) -> None:
    run.publish(1)
    out = tmp_path / "out"
    p = subprocess.Popen(
        [sys.executable, "-m", "deltasync", "subscribe", "--repo", run.repo, "--out", str(out), "--follow",
         "--poll-interval", "0.2", "--metrics-port", "0", "--metrics-host", "127.0.0.1", "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        port = int(_readline(p).strip().rsplit(":", 1)[1].split("/")[0])
        assert "following" in _readline(p)
        assert _readline(p).startswith("version 1 (pull from a snapshot")
        repo = Repository(run.repo)
        for _ in range(3):
            v = run.publish()
            published = time.time()
            line = _readline(p)
            assert line.startswith(f"version {v} ("), line
            status = read_status(out)
            assert status["version"] == v and status["running"] and status["lag_versions"] == 0
            assert status["lag_seconds"] == 0
            noticed = status["latest_seen_unix"] - repo.manifest(v).pb.created_unix
            assert noticed < 1.0, noticed
            assert time.time() - published < 2.0
            assert tree_digests(out) == run.digests(v)
        m = _metrics(port)
        assert m["deltasync_current_version"] == 4 and m["deltasync_latest_version"] == 4
        assert m["deltasync_lag_versions"] == 0 and m["deltasync_lag_seconds"] == 0 and m["deltasync_up"] == 1
        assert m["deltasync_bytes_fetched_total"] == read_status(out)["bytes_fetched_total"] > 0
        assert m["deltasync_updates_total"] == 4 and 0 < m["deltasync_apply_seconds"] < 5
        assert m['deltasync_bytes_fetched_by_kind_total{kind="packs"}'] > 0
        assert "deltasync_last_error_timestamp_seconds" not in m
        with pytest.raises(CopyInUseError):  # the copy is the agent's while it runs
            Subscriber(run.repo, progress=False).pull_to_dir(out)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        assert read_status(out)["running"] is False
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_follow_through_a_relay_wakes_on_its_push_stream(run: Run, tmp_path: Path) -> None:
    from deltasync.relay.server import build_server

    run.publish(1)
    server = build_server(run.repo, "127.0.0.1:0", tmp_path / "relay-cache", poll_interval=0.05).start()
    out = tmp_path / "out"
    # Polling once an hour: only the relay's Watch stream can make the agent notice in time.
    f = Follower(f"grpc://{server.address}", out, poll_interval=3600.0)
    try:
        f.wait_for(1)
        for _ in range(2):
            v = run.publish()
            f.wait_for(v)
            assert tree_digests(out) == run.digests(v)
    finally:
        f.stop()
        server.stop()


# -- crash safety: SIGKILL and SIGTERM at random points ------------------------------------------------

#: Runs ``deltasync`` over a repository read at a limited bandwidth (a WAN in miniature), so
#: that an update lasts long enough to be interrupted anywhere.
SLOW_DRIVER = """
import sys, time
from deltasync.storage import _local

bandwidth = float(sys.argv[1])
read = _local.LocalStore._get

def slow(self, key, byte_range):
    data = read(self, key, byte_range)
    if key.startswith(("packs/", "blobs/")):
        time.sleep(len(data) / bandwidth)
    return data

_local.LocalStore._get = slow
from deltasync.cli.main import main
main(sys.argv[2:])
"""


@pytest.fixture
def slow_run(tmp_path: Path) -> Iterator[tuple[Run, list[str]]]:
    run = Run(tmp_path, config(pack_bytes=64 << 10, max_delta_fraction=10.0), layout=BIG_LAYOUT, fraction=0.3)
    driver = tmp_path / "slow_driver.py"
    driver.write_text(SLOW_DRIVER)
    yield run, [sys.executable, str(driver), str(1 << 20)]  # 1 MB/s: a 0.5 MB update takes ~0.5 s


def _wip(out: Path) -> tuple[int, int] | None:
    db = StateDB.open(out, create=False)
    wip = db.wip() if db is not None else None
    return (wip.chunks_done, wip.chunks_total) if wip is not None else None


def _clean_update_bytes(run: Run, tmp_path: Path, version: int) -> int:
    """Bytes a fresh update from ``version - 1`` to ``version`` downloads."""
    ref = tmp_path / f"ref-{version}"
    Subscriber(run.repo, progress=False).pull_to_dir(ref, version - 1)
    store = CachedStore(LocalStore(run.repo))
    Subscriber(Repository(store), workers=2, progress=False).pull_to_dir(ref, version)
    return store.fetched_bytes


def _interrupt_midway(cmd: list[str], out: Path, sig: int, fraction: float) -> subprocess.Popen[str] | None:
    """Start ``cmd`` and send it ``sig`` once its update has done ``fraction`` of its chunks;
    None when the command ended first (a loaded machine can miss a short update's window)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60  # bounds a failure only
    while True:
        w = _wip(out)
        if w is not None and w[0] >= fraction * w[1]:
            break
        if p.poll() is not None:
            _, stderr = p.communicate()
            assert p.returncode == 0, stderr
            return None
        assert time.monotonic() < deadline
        time.sleep(0.005)
    p.send_signal(sig)
    return p


def _until_progress(p: subprocess.Popen[str], out: Path, fraction: float) -> None:
    """Return once the update ``p`` runs has made progress and done ``fraction`` of its chunks
    (or once ``p`` has ended)."""
    before = _wip(out)
    deadline = time.monotonic() + 60  # bounds a failure only
    while p.poll() is None:
        w = _wip(out)
        if w is not None and w != before and w[0] >= fraction * w[1]:
            return
        assert time.monotonic() < deadline
        time.sleep(0.005)


@pytest.mark.slow
def test_sigkill_at_random_points_ends_at_the_exact_target_without_starting_over(
    slow_run: tuple[Run, list[str]], tmp_path: Path
) -> None:
    run, driver = slow_run
    run.publish()
    out = tmp_path / "out"
    Subscriber(run.repo, progress=False).pull_to_dir(out)
    cmd = [*driver, "subscribe", "--repo", run.repo, "--out", str(out), "--workers", "2"]
    rng = random.Random(2024)
    midway = 0
    for i in range(20):
        state = read_local_state(out)
        assert state is not None
        if state.version == len(run.ckpts):
            run.publish()
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if i % 2:
            time.sleep(rng.uniform(0.05, 1.2))  # anywhere: start-up, planning, fetching, the switch, done
        else:
            _until_progress(p, out, rng.uniform(0.1, 0.6))  # inside the update, however slow the start-up
        p.kill()
        p.wait()
        midway += _wip(out) is not None
        # Whatever the moment, the copy holds some version exactly.
        state = read_local_state(out)
        assert state is not None
        if state.version == len(run.ckpts) and _wip(out) is None:
            assert tree_digests(out) == run.digests(state.version)
    assert midway >= 5, midway
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert tree_digests(out) == run.digests(len(run.ckpts))

    # Killed with a good part of an update done, the next run does not start over. An update
    # that ended before it could be killed is tried again on a new version (at most 5 times).
    for _ in range(5):
        v = run.publish()
        clean = _clean_update_bytes(run, tmp_path, v)
        killed = _interrupt_midway(cmd, out, signal.SIGKILL, 0.5)
        if killed is not None:
            break
        assert tree_digests(out) == run.digests(v)
    assert killed is not None, "every update ended before it could be killed"
    killed.wait()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert tree_digests(out) == run.digests(v)
    resumed = read_status(out)["last_update"]["fetched_bytes"]
    assert resumed < 0.8 * clean, (resumed, clean)


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_the_next_run_resumes(slow_run: tuple[Run, list[str]], tmp_path: Path) -> None:
    run, driver = slow_run
    run.publish()
    out = tmp_path / "out"
    Subscriber(run.repo, progress=False).pull_to_dir(out)
    v = run.publish()
    clean = _clean_update_bytes(run, tmp_path, v)
    cmd = [*driver, "subscribe", "--repo", run.repo, "--out", str(out), "--follow", "--poll-interval", "0.1"]
    p = _interrupt_midway(cmd, out, signal.SIGTERM, 0.4)
    assert p is not None  # --follow does not end by itself
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr
    assert "stopped at version 1" in stdout
    status = read_status(out)
    assert status["version"] == 1 and status["wip"]["target"] == v and status["state"] == "stopped"
    assert tree_digests(out) == run.digests(1)  # untouched until the update completes
    r = subprocess.run([*driver, "subscribe", "--repo", run.repo, "--out", str(out)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert tree_digests(out) == run.digests(v)
    resumed = read_status(out)["last_update"]["fetched_bytes"]
    assert resumed < 0.8 * clean, (resumed, clean)


def test_status_of_a_pulled_copy_and_lag_against_a_held_pin(run: Run, tmp_path: Path) -> None:
    run.publish(3)
    pulled = tmp_path / "pulled"
    assert _cli("pull", pulled, "--repo", run.repo, "--quiet").returncode == 0
    text = _cli("status", pulled).stdout
    assert "latest       unknown: no agent has followed this copy" in text  # not "-", as for an empty repository
    assert "fetched      - (pulled, not followed by an agent)" in text and "0 B" not in text

    followed = tmp_path / "followed"
    assert _cli("pin", "--repo", run.repo, "2").returncode == 0
    assert _cli("subscribe", "--repo", run.repo, "--out", followed).returncode == 0
    status = json.loads(_cli("status", followed, "--json").stdout)
    assert status["version"] == 2 and status["pinned_version"] == 2 and status["latest_version"] == 3
    assert status["lag_versions"] == 0  # at the pin it serves: not one behind the latest
    assert "lag          0 version(s), 0.0s (from the pin)" in _cli("status", followed).stdout

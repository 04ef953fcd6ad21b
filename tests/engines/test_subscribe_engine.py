"""`deltasync subscribe --engine` hands every version the agent brings in to an engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

import deltasync
from deltasync.engines.http_engine import ReferenceServer


def _ckpt(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 16, generator=g)
    w[0, :step] += 1.0
    save_file({"w": w.bfloat16(), "b": torch.arange(4, dtype=torch.float32)}, str(path / "model.safetensors"))
    return path


def test_subscribe_swaps_each_version_into_an_http_engine(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    pub = deltasync.Publisher(str(repo))
    pub.publish_dir(_ckpt(tmp_path / "c1", 1))
    with ReferenceServer() as server:
        cmd = [
            sys.executable, "-m", "deltasync", "subscribe", "--repo", str(repo), "--out", str(tmp_path / "serving"),
            "--engine", f"http:generic@{server.url}", "--quiet",
        ]
        first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr
        assert "engine serves version 1" in first.stdout
        assert server.version == 1
        pub.publish_dir(_ckpt(tmp_path / "c2", 2), base_dir=tmp_path / "c1")
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr
        assert "engine serves version 2" in second.stdout
        assert server.version == 2


FACTORY = '''
import os
from safetensors.torch import load_file

def build():
    return load_file(os.environ["DELTASYNC_TEST_WEIGHTS"])
'''


def test_subscribe_feeds_a_torch_engine_from_the_agents_copy(tmp_path: Path) -> None:
    """The agent fetches and decodes each version once; the engine's change is read from its copy."""
    repo = tmp_path / "repo"
    pub = deltasync.Publisher(str(repo))
    pub.publish_dir(_ckpt(tmp_path / "c1", 1))
    (tmp_path / "engine_factory.py").write_text(FACTORY)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "DELTASYNC_TEST_WEIGHTS": str(tmp_path / "c1" / "model.safetensors")}
    cmd = [
        sys.executable, "-m", "deltasync", "subscribe", "--repo", str(repo), "--out", str(tmp_path / "serving"),
        "--engine", "torch:engine_factory:build", "--quiet",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stderr
    assert "engine serves version 1" in first.stdout and "0 B fetched" in first.stdout, first.stdout
    pub.publish_dir(_ckpt(tmp_path / "c2", 2), base_dir=tmp_path / "c1")
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert second.returncode == 0, second.stderr
    # This process's engine starts from version 1's weights (it knows no version): every chunk
    # that differs is read from the copy the agent just brought to version 2; nothing is fetched.
    assert "engine serves version 2" in second.stdout and "0 B fetched" in second.stdout, second.stdout
    assert "1 chunks changed" in second.stdout, second.stdout

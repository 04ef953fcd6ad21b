"""`deltasync subscribe --engine` hands every version the agent brings in to an engine."""

from __future__ import annotations

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
            "--engine", f"http:generic@{server.url}", "--engine-dir", str(tmp_path / "engine"), "--quiet",
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

"""Inputs a new user got wrong get one clear line, and what a command did is said (issue 33: 8, 12, 13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import make_state, write_checkpoint
from test_cli import Env, _run_on_terminal


@pytest.fixture
def cli(tmp_path: Path) -> Env:
    env = {**os.environ, "DELTASYNC_CACHE": str(tmp_path / "default-cache")}  # never the user's ~/.cache
    env.pop("DELTASYNC_TEST_S3_URL", None)
    return Env(tmp_path, env)


def test_a_file_where_a_directory_belongs_is_refused(cli: Env, tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt" / "step-0001", make_state(0))
    cli.fails("publish", ckpt / "model.safetensors", "--repo", "repo",
              match="model.safetensors is a file, not a checkpoint directory: publish the directory that holds it")
    assert not (tmp_path / "repo").exists()  # nothing published
    cli.run("publish", ckpt, "--repo", "repo")
    for command in ("pull", "subscribe"):
        cli.fails(command, ckpt / "config.json", "--repo", "repo", match="config.json is a file, not a directory")
    cli.fails("status", ckpt / "config.json", match="config.json is a file, not a directory")


def test_a_first_publish_says_it_created_the_repository(cli: Env, tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", make_state(0))
    out = cli.run("publish", ckpt, "--repo", "127.0.0.1:17070").out
    assert f"created a new repository at {tmp_path / '127.0.0.1:17070'} (a local folder; a relay is " \
           "grpc://127.0.0.1:17070)" in out, out
    write_checkpoint(ckpt, make_state(1))
    assert "created" not in cli.run("publish", ckpt, "--repo", "127.0.0.1:17070").out
    first = json.loads(cli.run("publish", ckpt, "--repo", "other", "--json", "--no-cache").out)
    assert first["created_repository"] == str(tmp_path / "other"), first


def test_malformed_urls_and_numbers_are_named(cli: Env) -> None:
    cli.fails("log", "--repo", "s3:/bucket/x", match="malformed repository URL 's3:/bucket/x': write s3://bucket/prefix")
    cli.fails("log", "--repo", "grpc:127.0.0.1:5", match="malformed repository URL 'grpc:127.0.0.1:5'")
    cli.fails("subscribe", "--state", "s", "--engine", "torch:m:f", "--repo", "r", "--packcast-timeout", "nan",
              match="'nan' is not a finite number of seconds")
    cli.fails("subscribe", "--state", "s", "--engine", "torch:m:f", "--repo", "r", "--packcast",
              "0/99999999999999999999@127.0.0.1:5", match="more than a group takes (at most 4096")


def test_verify_labels_its_progress_verify(cli: Env, tmp_path: Path) -> None:
    cli.run("publish", write_checkpoint(tmp_path / "ckpt", make_state(0)), "--repo", "repo")
    rc, term = _run_on_terminal(cli, "verify", "--repo", "repo")
    assert rc == 0 and "verify v1:" in term and "pull v1" not in term, term


_NO_TORCH = '''import sys


class _NoTorch:
    """A core-only install: torch cannot be imported."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
'''


def test_a_torch_engine_without_torch_names_the_extra(cli: Env, tmp_path: Path) -> None:
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(_NO_TORCH)
    cli.env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "blocker"), *filter(None, [cli.env.get("PYTHONPATH")])])
    (tmp_path / "plain.py").write_text("def make():\n    return {}\n")
    (tmp_path / "uses_torch.py").write_text("import torch\n\n\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    blocked = subprocess.run([sys.executable, "-c", "import torch"], env=cli.env, capture_output=True, text=True)
    assert blocked.returncode != 0 and "No module named 'torch'" in blocked.stderr  # the blocker works
    for spec in ("torch:plain:make", "torch:uses_torch:make", "fanout"):
        cli.fails("subscribe", "--engine", spec, "--state", "s", "--repo", "repo",
                  match="needs torch, which is not installed: pip install 'deltasync[torch]'")


def test_an_engine_with_no_tensors_is_refused(cli: Env, tmp_path: Path) -> None:
    cli.run("publish", write_checkpoint(tmp_path / "ckpt", make_state(0)), "--repo", "repo")
    (tmp_path / "empty.py").write_text("import torch\n\n\ndef make():\n    return {}\n\n\n"
                                       "def module():\n    return torch.nn.Module()\n")
    for spec in ("torch:empty:make", "torch:empty:module"):
        r = cli.fails("subscribe", "--engine", spec, "--state", "s", "--repo", "repo", match="the model holds no tensors")
        assert "at version" not in r.out, r.out
    cli.fails("subscribe", "copy", "--engine", "torch:empty:make", "--repo", "repo", match="the model holds no tensors")

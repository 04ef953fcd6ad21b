"""``deltasync rl run --backend ray`` end to end, on a real Ray cluster (one node, this machine).

The test starts a Ray head in-process (as ``ray start --head`` would on a cluster's first
node), runs the command of docs/integrations.md's Ray example joined to it (``RAY_ADDRESS``;
a small model and three steps through ``--config``), and then asks Ray itself which actors
ran: the rollout workers must have been Ray actors, and every version they swapped in must
be bit-exact.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'deltasync[ray]'; scripts/install_verl.sh has it)")

import ray

from deltasync import Repository

CONFIG: dict[str, Any] = {
    "steps": 3, "digits": 2,
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "max_position_embeddings": 16},
    "warm_start": {"steps": 20, "batch_size": 32}, "workers": {"count": 2}, "gate": {"suite_size": 16},
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A one-node Ray cluster; yields the address a driver joins it by."""
    # Ray's state API (which actors ran) is served by its dashboard: ray[default], as verl installs it.
    pytest.importorskip("aiohttp", reason="Ray's dashboard needs ray[default] (scripts/install_verl.sh installs it)")
    ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=True, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def doc_command() -> str:
    """The command line of the Ray example in docs/integrations.md."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    match = re.search(r"<!-- example: ray -->\n```\n(.+?)\n```", text)
    assert match is not None, "docs/integrations.md lost its Ray example"
    return match.group(1)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_rl_run_with_ray_actors_swaps_bit_exact(cluster: str, tmp_path: Path) -> None:
    from ray.util.state import list_actors

    config = tmp_path / "rl.json"
    config.write_text(json.dumps(CONFIG))
    assignment, *argv = shlex.split(doc_command())
    assert assignment == "RAY_ADDRESS=HEAD:6379" and argv[:4] == ["deltasync", "rl", "run", "--backend"], argv
    argv = [a.replace("rl-run", str(tmp_path / "run")) for a in argv[1:]]
    env = {**os.environ, "DELTASYNC_CACHE": str(tmp_path / "cache"), "RAY_ADDRESS": cluster}
    proc = subprocess.run([sys.executable, "-m", "deltasync", *argv, "--config", str(config), "-q"],
                          capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    workers = list_actors(filters=[("class_name", "=", "RolloutWorker")], limit=100)
    assert len(workers) == 2, workers  # the loop's two workers ran as Ray actors of this cluster

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    swaps = [r for r in records if r["event"] == "swap"]
    repo = Repository(str(tmp_path / "run" / "repo"))
    assert {s["worker"] for s in swaps} == {0, 1}
    assert {s["version"] for s in swaps} >= {1, 2}
    for s in swaps:  # each worker hashed the module it served: the repository's own digest
        assert s["bit_exact"] and s["digest"] == repo.manifest(s["version"]).pb.version_digest.hex(), s
    steps = [r for r in records if r["event"] == "step"]
    assert len(steps) == CONFIG["steps"] and max(s["logprob_gap"] for s in steps) == 0.0

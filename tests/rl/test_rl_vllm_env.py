"""Where `rl run` with vLLM rollouts finds its vLLM environment, and that a missing one fails
before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltasync.errors import UsageError
from deltasync.rl_integration import load_config, run
from deltasync.rl_integration.vllm_rollout import vllm_python_candidates


def test_a_missing_vllm_environment_fails_before_the_run_writes_anything(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = load_config(out_dir=str(out), **{"workers.inference": "vllm",
                                              "workers.vllm_python": str(tmp_path / "no-such" / "python")})
    with pytest.raises(UsageError, match="no vLLM environment at"):
        run(config, echo=lambda line: None)
    assert not out.exists()  # no partial run left behind, so no --force needed to try again


def test_the_checkout_is_searched_after_the_working_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DELTASYNC_VLLM_PYTHON", raising=False)
    found = vllm_python_candidates()
    checkout = Path(__file__).resolve().parents[2]
    assert found[0] == Path.cwd() / ".venv-vllm" / "bin" / "python"
    assert found[-1] == checkout / ".venv-vllm" / "bin" / "python"
    monkeypatch.setenv("DELTASYNC_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert vllm_python_candidates() == [Path("/opt/vllm/bin/python")]

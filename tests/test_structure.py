"""The package's shape: old module names still import, results travel with the call, errors
live in one module and derive from the built-ins they resemble."""

from __future__ import annotations

import importlib
import inspect
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import deltasync
import deltasync.errors
from deltasync import Publisher, PublishResult, Subscriber
from deltasync._aliases import MOVED

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_module_names_alias_the_new_modules(old: str) -> None:
    aliased = importlib.import_module(f"deltasync.{old}")
    new = importlib.import_module(f"deltasync.{MOVED[old]}")
    assert aliased is new
    assert new.__spec__ is not None and new.__spec__.name == f"deltasync.{MOVED[old]}"  # not stamped with the alias


def test_the_flat_layout_is_gone() -> None:
    """The aliases stand in for modules that no longer exist as files, and no new flat module
    shadows a standard-library name."""
    flat = {p.stem for p in (ROOT / "deltasync").glob("*.py")}
    assert not flat & set(MOVED)
    assert not flat & set(sys.stdlib_module_names) - {"__init__", "__main__"}


def test_every_exception_is_defined_in_errors_and_exported() -> None:
    import deltasync.agent
    import deltasync.engines
    import deltasync.publish.distributed
    import deltasync.pull.state
    import deltasync.rl_integration.feedback
    import deltasync.rl_integration.loop

    modules = [deltasync.agent, deltasync.engines, deltasync.publish.distributed, deltasync.pull.state,
               deltasync.rl_integration.feedback, deltasync.rl_integration.loop]
    for module in modules:
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, deltasync.DeltasyncError):
                assert value.__module__ == "deltasync.errors", f"{module.__name__}.{name} is defined elsewhere"
    for name, value in vars(deltasync.errors).items():
        if inspect.isclass(value) and issubclass(value, deltasync.DeltasyncError):
            assert getattr(deltasync, name) is value and name in deltasync.__all__


def test_errors_derive_from_the_builtins_they_resemble() -> None:
    with pytest.raises(ValueError):
        deltasync.PublisherConfig(workers=-1)
    with pytest.raises(LookupError):
        raise deltasync.VersionNotFoundError(7, "memory://x")
    assert str(deltasync.UsageError("bad")) == "bad"


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g)}


def test_publish_result_is_the_version_id_with_its_figures(tmp_path: Path) -> None:
    pub = Publisher(str(tmp_path / "repo"))
    state = _state(0)
    first = pub.publish(state)
    state["w"] = state["w"].clone()
    state["w"][3, :5] += 1.0  # a small change: stored as a delta
    second = pub.publish(state)
    assert isinstance(first, PublishResult) and isinstance(first, int)
    assert (first, second) == (1, 2) and f"v{second}" == "v2" and second.version == 2
    assert first.kind == "snapshot" and second.kind == "delta" and second.parent == 1
    assert second.raw_bytes > 0 and second.stored_bytes > 0 and second.ratio == second.raw_bytes / second.stored_bytes
    assert pickle.loads(pickle.dumps(second)).kind == "delta"
    with pytest.raises(AttributeError):
        second.kind = "snapshot"  # type: ignore[misc]


def test_pulls_from_threads_each_get_their_own_plan(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    pub = Publisher(url)
    for i in range(3):
        pub.publish(_state(i))
    plans: dict[int, int] = {}

    def pull(v: int) -> None:
        got = Subscriber(url, workers=1).pull(v)
        plans[v] = got.plan.target
        assert got.version == v and set(got) == {"w", "b"}

    threads = [threading.Thread(target=pull, args=(v,)) for v in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert plans == {1: 1, 2: 2, 3: 3}


def test_help_does_not_import_the_heavy_modules() -> None:
    heavy = "('torch', 'numpy', 'grpc', 'boto3')"
    code = f"import sys, deltasync; deltasync.__dir__(); print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"

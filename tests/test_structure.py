"""The package's shape: results travel with the call, errors live in one module and derive from
the built-ins they resemble, extras are named when missing. (The layout itself: test_layout.py.)"""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_shadows_a_standard_library_name() -> None:
    flat = {p.stem for p in (ROOT / "deltasync").glob("*.py")}
    assert not flat & set(sys.stdlib_module_names) - {"__init__", "__main__"}


def test_every_exception_is_defined_in_errors_and_exported() -> None:
    import deltasync.agents.config
    import deltasync.agents.directory
    import deltasync.agents.engine
    import deltasync.agents.packcast
    import deltasync.engines
    import deltasync.local.state
    import deltasync.publish.distributed
    import deltasync.rl_integration.errors
    import deltasync.rl_integration.feedback
    import deltasync.rl_integration.loop

    library = [deltasync.agents.config, deltasync.agents.directory, deltasync.agents.engine,
               deltasync.agents.packcast, deltasync.engines, deltasync.publish.distributed, deltasync.local.state]
    rl = [deltasync.rl_integration.feedback, deltasync.rl_integration.loop]
    for module in [*library, *rl]:
        home = "deltasync.rl_integration.errors" if module in rl else "deltasync.errors"
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, deltasync.DeltasyncError) and value.__module__ != "deltasync.errors":
                assert value.__module__ == home, f"{module.__name__}.{name} is defined in {value.__module__}"
    for name, value in vars(deltasync.errors).items():
        if inspect.isclass(value) and issubclass(value, deltasync.DeltasyncError):
            assert getattr(deltasync, name) is value and name in deltasync.__all__
    for name, value in vars(deltasync.rl_integration.errors).items():  # the RL loop's own join the hierarchy
        if inspect.isclass(value) and value.__module__ == "deltasync.rl_integration.errors":
            assert issubclass(value, deltasync.DeltasyncError) and not hasattr(deltasync, name)


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
        second.kind = "snapshot"


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


def _without(modules: list[str], code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a Python where importing any of ``modules`` fails as if not installed."""
    block = "".join(f"sys.modules[{m!r}] = None; " for m in modules)
    return subprocess.run([sys.executable, "-c", f"import sys; {block}\n{code}"], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_a_missing_extra_is_named(tmp_path: Path) -> None:
    cases = {
        "torch": "from deltasync.format.tensors import bits_to_tensor; import numpy as np; "
                 "bits_to_tensor(np.zeros(4, np.uint8), 'F32', (1,))",
        "boto3": "from deltasync.storage import open_store; open_store('s3://bucket/prefix')",
        "grpc": "from deltasync.relay import build_server",
    }
    extras = {"torch": "torch", "boto3": "s3", "grpc": "grpc"}
    for module, code in cases.items():
        r = _without([module], f"import deltasync\ntry:\n    {code}\nexcept deltasync.MissingDependencyError as e:\n"
                               f"    print(e.extra, '|', e)", tmp_path)
        assert r.returncode == 0, r.stderr
        extra, message = r.stdout.split("|", 1)
        assert extra.strip() == extras[module] and f"pip install 'deltasync[{extras[module]}]'" in message


def test_a_directory_publish_pull_and_verify_need_no_torch(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    for step in (1, 2):
        ckpt = tmp_path / f"step-{step}"
        ckpt.mkdir()
        save_file({"w": rng.standard_normal((128, 64)).astype(np.float32)}, str(ckpt / "model.safetensors"))
        (ckpt / "config.json").write_text('{"layers": 1}')
    cli = "from deltasync.cli.main import main; main()"
    repo, out = str(tmp_path / "repo"), str(tmp_path / "out")
    for args in (["publish", str(tmp_path / "step-1"), "--repo", repo, "--no-cache", "--quiet"],
                 ["publish", str(tmp_path / "step-2"), "--repo", repo, "--no-cache", "--quiet"],
                 ["pull", "--repo", repo, "--out", out, "--quiet"],
                 ["verify", "--repo", repo]):
        r = _without(["torch", "boto3", "grpc"], f"sys.argv = ['deltasync', *{args!r}]\n{cli}", tmp_path)
        assert r.returncode == 0, f"{args}: {r.stderr}"
    assert (Path(out) / "model.safetensors").read_bytes() == (tmp_path / "step-2" / "model.safetensors").read_bytes()


def test_a_pulled_state_saves_as_a_plain_dict_of_tensors(tmp_path: Path) -> None:
    url = str(tmp_path / "repo")
    Publisher(url).publish(_state(0))
    pulled = Subscriber(url).pull(1)
    torch.save(pulled, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert isinstance(loaded, dict) and loaded.keys() == pulled.keys()
    assert all(torch.equal(loaded[k].view(torch.uint8), pulled[k].view(torch.uint8)) for k in pulled)


def test_a_broken_install_of_an_extra_is_not_reported_as_missing(tmp_path: Path) -> None:
    (tmp_path / "brokenextra.py").write_text("import torch.not_a_module\n")
    code = ("from deltasync._extras import import_needing_extras\ntry:\n    import_needing_extras('brokenextra', 'x')\n"
            "except ModuleNotFoundError as e:\n    print(type(e).__name__, e.name)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert r.stdout.split() == ["ModuleNotFoundError", "torch.not_a_module"], r.stderr


def test_a_repository_keeps_a_bounded_number_of_parsed_manifests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import deltasync.repo.repository as repository_module

    monkeypatch.setattr(repository_module, "MANIFEST_CACHE_ENTRIES", 4)
    url = str(tmp_path / "repo")
    pub = Publisher(url)
    state = _state(0)
    for i in range(10):
        state["w"] = state["w"].clone()
        state["w"][i, :3] += 1.0
        pub.publish(state)
    repo = deltasync.Repository(url)
    for v in range(1, 11):
        assert repo.manifest(v).version == v
    assert len(repo._manifests) == 4 and list(repo._manifests) == [7, 8, 9, 10]
    assert Subscriber(repo).pull(10).version == 10  # evicted manifests are read again when needed

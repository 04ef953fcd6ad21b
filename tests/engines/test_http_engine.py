"""The HTTP engine, end to end against the reference inference server (and real servers when present)."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import deltasync
from deltasync.engines import Engine, EngineError, HttpEngine, ReferenceServer, build_engine
from deltasync.engines.http_engine import PRESETS, Call, replace_preset, state_digest
from deltasync.engines.testing import EngineConformance, MakeEngine, Served, assert_serves, suite_states
from deltasync.local.state import read_local_state
from deltasync.storage import open_store


class TestHttpEngineConformance(EngineConformance):
    @pytest.fixture(params=sorted(PRESETS))
    def make_engine(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeEngine]:
        servers: list[ReferenceServer] = []

        def make(repo: str, initial: dict[str, torch.Tensor]) -> tuple[Engine, Served]:
            server = ReferenceServer().start()
            server.state = initial
            servers.append(server)
            engine = HttpEngine(server.url, repo, model_dir=tmp_path / f"model-{len(servers)}", preset=request.param,
                                timeout=30)
            return engine, lambda: server.state

        yield make
        for s in servers:
            s.close()


@pytest.fixture
def repo() -> Iterator[tuple[str, list[dict[str, torch.Tensor]]]]:
    url = f"memory://http-{uuid.uuid4().hex}"
    states = suite_states()
    pub = deltasync.Publisher(url)
    for s in states:
        pub.publish(s)
    yield url, states
    store = open_store(url)
    for key in list(store.list()):
        store.delete(key)


@pytest.fixture
def server() -> Iterator[ReferenceServer]:
    with ReferenceServer() as s:
        yield s


def _post(url: str, body: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_end_to_end_through_the_preset_endpoints(
    preset: str, repo: tuple[str, list[dict[str, torch.Tensor]]], server: ReferenceServer, tmp_path: Path
) -> None:
    url, states = repo
    engine = build_engine(f"http:{preset}@{server.url}", repo=url, model_dir=str(tmp_path / "model"))
    for v in (1, 4, 2):
        record = engine.update(v)
        assert record is not None and record.version == v and record.extra["preset"] == preset
        assert_serves(server.state, states[v - 1])
        assert server.version == v
        assert engine.served_version() == v
        assert read_local_state(tmp_path / "model").version == v  # type: ignore[union-attr]
        answer = _post(f"{server.url}/generate")
        assert answer == {"version": v, "digest": state_digest(states[v - 1])}
    assert server.calls == ["pause", "update", "resume"] * 3
    assert engine.swaps[1].fetched_bytes < engine.swaps[0].fetched_bytes  # 1 -> 4 is a delta chain


def test_no_request_sees_a_mix_while_the_server_swaps(
    repo: tuple[str, list[dict[str, torch.Tensor]]], server: ReferenceServer, tmp_path: Path
) -> None:
    url, states = repo
    digests = {state_digest(s): v for v, s in enumerate(states, start=1)}
    engine = HttpEngine(server.url, url, model_dir=tmp_path / "model")
    engine.update(1)
    errors: list[str] = []
    seen: list[int] = []
    stop = threading.Event()
    answered = threading.Condition()  # notified after each answer

    def client() -> None:
        while not stop.is_set():
            answer = _post(f"{server.url}/generate")
            v = digests.get(answer["digest"])
            with answered:
                if v is None or v != answer["version"]:
                    errors.append(f"answer {answer} is not one version's weights")
                else:
                    seen.append(v)
                answered.notify_all()

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for v in (2, 3, 4, 1, 4, 2):
            with answered:
                mark = len(seen)
            engine.update(v)  # swaps while the clients ask
            with answered:  # until a client was answered by it: the next swap has requests in flight
                while not errors and v not in seen[mark:]:
                    assert answered.wait(30), f"no answer from version {v}"
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert set(seen) == {1, 2, 3, 4}


@pytest.mark.parametrize("preset", ["generic", "sglang"])
def test_a_failed_update_resumes_and_keeps_the_old_version(
    preset: str, repo: tuple[str, list[dict[str, torch.Tensor]]], server: ReferenceServer, tmp_path: Path
) -> None:
    url, states = repo
    engine = HttpEngine(server.url, url, model_dir=tmp_path / "model", preset=preset)
    engine.update(1)
    server.fail_next_update = "out of GPU memory"
    with pytest.raises(EngineError, match="out of GPU memory"):
        engine.update(2)
    assert server.calls[-3:] == ["pause", "update", "resume"]  # resumed despite the failure
    assert engine.version == 1 and engine.served_version() == 1 and len(engine.swaps) == 1
    assert_serves(server.state, states[0])
    engine.update(2)  # the directory already holds version 2: nothing is fetched again
    assert engine.swaps[-1].version == 2 and engine.swaps[-1].fetched_bytes == 0
    assert_serves(server.state, states[1])


def test_a_server_that_reports_another_version_is_refused(
    repo: tuple[str, list[dict[str, torch.Tensor]]], server: ReferenceServer, tmp_path: Path
) -> None:
    url, _ = repo
    # an update call that the server acknowledges but that loads nothing
    lazy = replace_preset("generic", update=Call(path="/resume"))
    engine = HttpEngine(server.url, url, model_dir=tmp_path / "model", preset=lazy)
    with pytest.raises(EngineError, match=r"reports version None after loading version 4"):
        engine.update()
    assert engine.version is None  # what the server said, not what was hoped for


def test_unreachable_server_and_bad_arguments(repo: tuple[str, list[dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    url, _ = repo
    engine = HttpEngine("http://127.0.0.1:9", url, model_dir=tmp_path / "model", timeout=5)
    with pytest.raises(EngineError, match=r"generic server at http://127\.0\.0\.1:9: pause \(POST /pause\) failed"):
        engine.update()
    assert engine.version is None
    with pytest.raises(deltasync.UsageError, match="http"):
        HttpEngine("127.0.0.1:9", url, model_dir=tmp_path)
    with pytest.raises(deltasync.UsageError, match="unknown HTTP preset"):
        HttpEngine("http://127.0.0.1:9", url, model_dir=tmp_path, preset="tgi")
    with pytest.raises(deltasync.UsageError, match="bad HTTP template"):
        bad = replace_preset("generic", pause=Call(path="/pause/{nope}"))
        HttpEngine("http://127.0.0.1:9", url, model_dir=tmp_path / "bad", preset=bad).update()


def test_query_templates_and_headers(repo: tuple[str, list[dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    url, states = repo
    seen: list[tuple[str, str | None]] = []

    with ReferenceServer() as server:
        real_handler = server._httpd.RequestHandlerClass

        class Recording(real_handler):  # type: ignore[valid-type,misc]
            def do_POST(self) -> None:
                seen.append((self.path, self.headers.get("Authorization")))
                super().do_POST()

        server._httpd.RequestHandlerClass = Recording
        preset = replace_preset("vllm", pause=Call(path="/pause", query={"mode": "keep", "tag": "v{version}"}))
        engine = HttpEngine(server.url, url, model_dir=tmp_path / "m", preset=preset, headers={"Authorization": "Bearer k"})
        engine.update(3)
        assert_serves(server.state, states[2])
    assert seen[0] == ("/pause?mode=keep&tag=v3", "Bearer k")
    assert [p for p, _ in seen][1:] == ["/collective_rpc", "/resume"]


# -- real inference servers, only where installed ---------------------------------------------------------------


def _real_server(module: str, env: str) -> tuple[str, Path]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    target = os.environ.get(env)
    model = os.environ.get(f"{env}_MODEL_DIR")
    if not target or not model:
        pytest.skip(f"set {env} to a running {module} server (RL endpoints enabled) and {env}_MODEL_DIR to the "
                    "checkpoint directory it was started from")
    return target, Path(model)


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "module", "env"), [
    ("sglang", "sglang", "DELTASYNC_TEST_SGLANG_URL"),  # vLLM: tests/engines/test_vllm.py starts its own
])
def test_real_server(preset: str, module: str, env: str, tmp_path: Path) -> None:
    target, checkpoint = _real_server(module, env)
    repo = str(tmp_path / "repo")
    pub = deltasync.Publisher(repo)
    pub.publish_dir(checkpoint)  # version 1: the weights the server already serves
    pub.publish_dir(checkpoint)  # version 2: same bits, a new version id
    engine = HttpEngine(target, repo, model_dir=tmp_path / "served", preset=preset)
    for v in (2, 1):
        record = engine.update(v)
        assert record is not None and record.version == v
        assert engine.served_version() == v

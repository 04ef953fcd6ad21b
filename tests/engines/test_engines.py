"""The engine interface and the in-process torch engine."""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import deltasync
from deltasync.engines import Engine, ServingLock, TorchEngine, build_engine, torch_engine as te
from deltasync.engines.http_engine import state_digest
from deltasync.engines.testing import EngineConformance, MakeEngine, Served, assert_serves, bits
from deltasync.errors import UsageError
from deltasync.format.codec import PlanesZstdCodec
from deltasync.storage import open_store


@pytest.fixture
def url() -> Iterator[str]:
    u = f"memory://engines-{uuid.uuid4().hex}"
    yield u
    store = open_store(u)
    for key in list(store.list()):
        store.delete(key)


def small_chunks() -> deltasync.PublisherConfig:
    return deltasync.PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=512))


class TestTorchEngineConformance(EngineConformance):
    @pytest.fixture
    def make_engine(self) -> Iterator[MakeEngine]:
        def make(repo: str, initial: dict[str, torch.Tensor]) -> tuple[Engine, Served]:
            return TorchEngine(initial, repo, workers=2), lambda: initial

        yield make


# -- bit-exact writes --------------------------------------------------------------------------------


def _all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    f = torch.randn(300, generator=g)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")])
    state = {
        "bf16": torch.cat([f, special]).bfloat16().reshape(61, 5),
        "f16": torch.cat([f, special]).half(),
        "f32": torch.cat([f, special]),
        "f64": torch.cat([f, special]).double(),
        "i8": torch.randint(-128, 127, (333,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (333,), generator=g, dtype=torch.uint8),
        "i32": torch.randint(-(2**31), 2**31 - 1, (257,), generator=g, dtype=torch.int32),
        "i64": torch.randint(-(2**62), 2**62, (129,), generator=g, dtype=torch.int64),
        "bool": torch.rand(400, generator=g) > 0.5,
        "c64": torch.randn(90, generator=g, dtype=torch.complex64),
        "c128": torch.randn(45, 2, generator=g, dtype=torch.complex128),
        "fp8": torch.randn(256, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    # a NaN with a payload, bit-exactly
    state["f32"].view(torch.int32)[3] = 0x7FC00123
    return state


def _step(state: dict[str, torch.Tensor], k: int, dense: bool) -> dict[str, torch.Tensor]:
    out = {n: t.clone() for n, t in state.items()}
    for t in out.values():
        if t.numel() == 0:
            continue
        raw = t.reshape(-1).view(torch.uint8)
        if dense:
            raw ^= 0x01  # every byte changes: dense chunks
        else:
            raw[(k * 37) % raw.numel()] ^= 0x40  # one element changes: sparse chunks
            raw[(k * 53 + 7) % raw.numel()] ^= 0x01
    return out


def test_every_dtype_bit_exact_with_sparse_and_dense_chunks(url: str) -> None:
    v1 = _all_dtypes()
    states = [v1, _step(v1, 1, False), _step(_step(v1, 1, False), 2, True), _step(_step(_step(v1, 1, False), 2, True), 3, False)]
    pub = deltasync.Publisher(url, small_chunks())
    for s in states:
        pub.publish(s)
    served = {n: torch.zeros_like(t) for n, t in v1.items()}
    engine = TorchEngine(served, url, workers=2)
    for v in (1, 2, 3, 4, 2, 4):
        record = engine.update(v)
        assert record is not None
        assert_serves(served, states[v - 1])
    # the sparse step: only the changed words were written
    engine.update(1)
    record = engine.update(2)
    assert record is not None
    nonempty = sum(1 for t in states[0].values() if t.numel())
    assert 0 < record.elements_changed <= 2 * nonempty  # two bytes flipped per tensor: at most two words
    assert record.chunks_changed < record.chunks_total  # chunks already served were skipped


def test_unknown_or_wrong_starting_state_is_repaired(url: str) -> None:
    states = [_all_dtypes(), _step(_all_dtypes(), 1, False)]
    pub = deltasync.Publisher(url)
    for s in states:
        pub.publish(s)
    garbage = {n: torch.zeros_like(t) for n, t in states[0].items()}
    # claims version 1 but holds zeros: every chunk fails its base digest and is rebuilt
    engine = TorchEngine(garbage, url, version=1)
    engine.update(2)
    assert_serves(garbage, states[1])


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_module_with_buffers_and_tied_weights(url: str, device: str) -> None:
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 16)
            self.norm = torch.nn.LayerNorm(16)
            self.head = torch.nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.scale: torch.Tensor
            self.register_buffer("scale", torch.ones(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.head(self.norm(self.embed(x)) * self.scale)
            return out

    torch.manual_seed(0)
    trainer = Tiny().bfloat16()
    pub = deltasync.Publisher(url)
    pub.publish(trainer.state_dict())
    with torch.no_grad():
        trainer.embed.weight[3, :4] += 1
        trainer.scale[2] = 5
    pub.publish(trainer.state_dict())
    torch.manual_seed(1)
    served = Tiny().bfloat16().to(device)
    engine = TorchEngine(served, url)
    engine.update()
    assert_serves({n: t.cpu() for n, t in served.state_dict().items()}, trainer.state_dict())
    x = torch.arange(8)
    with engine.serving(), torch.no_grad():
        assert torch.equal(served(x.to(device)).cpu(), trainer(x))


@pytest.mark.parametrize("device", DEVICES)
def test_views_of_one_flat_buffer(url: str, device: str) -> None:
    # Engines that pack weights into one allocation hand out views at storage offsets.
    states = [_all_dtypes(), _step(_all_dtypes(), 1, False), _step(_all_dtypes(), 2, True)]
    floats = [n for n, t in states[0].items() if t.dtype == torch.bfloat16 or n in ("f16",)]
    pub = deltasync.Publisher(url, small_chunks())
    for st in states:
        pub.publish({n: st[n] for n in floats} | {"w": st["f32"][:300].bfloat16().reshape(20, 15)})
    flat = torch.zeros(1 + 305 + 3 + 300, dtype=torch.bfloat16, device=device)
    served = {"bf16": flat[1:306].view(61, 5), "w": flat[309:609].view(20, 15),
              "f16": torch.zeros(305, dtype=torch.float16, device=device)}
    engine = TorchEngine(served, url)
    for v in (1, 2, 3, 1, 3):
        engine.update(v)
        want = {n: states[v - 1][n] for n in floats} | {"w": states[v - 1]["f32"][:300].bfloat16().reshape(20, 15)}
        assert_serves({n: t.cpu() for n, t in served.items()}, want)
        assert bits(flat[:1].cpu()) == bits(torch.zeros(1, dtype=torch.bfloat16))  # the gaps stay untouched
        assert bits(flat[306:309].cpu()) == bits(torch.zeros(3, dtype=torch.bfloat16))


def test_layout_mismatches_are_refused(url: str) -> None:
    deltasync.Publisher(url).publish({"a": torch.zeros(4, 4), "b": torch.zeros(3)})
    with pytest.raises(UsageError, match="cannot change dtypes or shapes"):
        TorchEngine({"a": torch.zeros(4, 4, dtype=torch.float16)}, url).update()
    with pytest.raises(UsageError, match="cannot change dtypes or shapes"):
        TorchEngine({"a": torch.zeros(16)}, url).update()
    with pytest.raises(UsageError, match="has no tensor 'c'"):
        TorchEngine({"a": torch.zeros(4, 4), "c": torch.zeros(1)}, url).update()
    # a tensor the engine does not serve is ignored; strict=False ignores the reverse too
    TorchEngine({"a": torch.zeros(4, 4)}, url).update()
    TorchEngine({"a": torch.zeros(4, 4), "c": torch.zeros(1)}, url, strict=False).update()
    with pytest.raises(UsageError, match="not contiguous"):
        TorchEngine({"a": torch.zeros(4, 4).t()}, url)


def test_a_failed_write_restores_the_old_version(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    states = [_all_dtypes(), _step(_all_dtypes(), 1, False)]
    pub = deltasync.Publisher(url)
    for s in states:
        pub.publish(s)
    served = {n: t.clone() for n, t in states[0].items()}
    engine = TorchEngine(served, url, version=1, workers=2)  # the pause written by a pool of two
    staged = engine.stage(2)
    assert isinstance(staged, te.TorchStaged) and len(staged.plan.writes) > 3
    calls = 0
    real = te.TensorWrite.apply_part

    def failing(self: te.TensorWrite, *part: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # two pieces already written (or being written)
            raise RuntimeError("device lost")
        real(self, *part)

    monkeypatch.setattr(te.TensorWrite, "apply_part", failing)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.swap(staged)
    assert engine.version == 1 and engine.swaps == []
    assert_serves(served, states[0])
    monkeypatch.setattr(te.TensorWrite, "apply_part", real)
    engine.update(2)
    assert_serves(served, states[1])


# -- serving while swapping ------------------------------------------------------------------------


def test_no_request_ever_sees_a_mix_of_versions(url: str) -> None:
    g = torch.Generator().manual_seed(5)
    base = {f"layer{i}": torch.randn(256, 64, generator=g).bfloat16() for i in range(6)}
    states = [base]
    for k in range(1, 6):
        nxt = {n: t.clone() for n, t in states[-1].items()}
        for t in nxt.values():
            t.view(-1)[k :: 97] += 0.5  # many small changes in every tensor
        states.append(nxt)
    pub = deltasync.Publisher(url, small_chunks())
    for s in states:
        pub.publish(s)
    digests = {state_digest(s): v for v, s in enumerate(states, start=1)}
    served = {n: torch.zeros_like(t) for n, t in base.items()}
    engine = TorchEngine(served, url)
    engine.update(1)
    seen: list[int] = []
    errors: list[str] = []
    stop = threading.Event()
    read = threading.Condition()  # notified after each read

    def reader() -> None:
        while not stop.is_set():
            with engine.serving():
                d = state_digest(served)
                version = engine.version
            v = digests.get(d)
            with read:
                if v is None:
                    errors.append("a request read weights of no single version")
                elif v != version:
                    errors.append(f"read version {v} while the engine said {version}")
                else:
                    seen.append(v)
                read.notify_all()

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for th in threads:
        th.start()
    try:
        for v in (2, 3, 4, 5, 6, 1, 6, 3, 5):
            with read:
                mark = len(seen)
            engine.update(v)  # swaps while the readers read
            with read:  # until a reader has read it: the next swap has readers to wait for
                while not errors and v not in seen[mark:]:
                    assert read.wait(30), f"no reader read version {v}"
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors[:3]
    assert set(seen) == set(range(1, 7))


def test_serving_lock_is_reentrant_and_prefers_the_writer() -> None:
    lock = ServingLock()
    with lock.shared(), lock.shared(), pytest.raises(UsageError, match=r"inside engine\.serving"):
        lock.acquire_exclusive()  # a guarded call inside a guarded call cannot swap
    order: list[str] = []
    held = threading.Event()
    release = threading.Event()

    class WatchedCondition(threading.Condition):
        """Tells when the named threads wait on it."""

        def __init__(self) -> None:
            super().__init__()
            self.waiting = {"swap": threading.Event(), "late request": threading.Event()}

        def wait(self, timeout: float | None = None) -> bool:
            if (name := threading.current_thread().name) in self.waiting:
                self.waiting[name].set()
            return super().wait(timeout)

    cond = lock._cond = WatchedCondition()

    def long_request() -> None:
        with lock.shared():
            held.set()
            release.wait()
            order.append("request 1 done")

    def swap() -> None:
        lock.acquire_exclusive()
        order.append("swap")
        lock.release_exclusive()

    def late_request() -> None:
        with lock.shared():
            order.append("request 2")

    t1 = threading.Thread(target=long_request)
    t1.start()
    assert held.wait(30)
    t2 = threading.Thread(target=swap, name="swap")
    t2.start()
    assert cond.waiting["swap"].wait(30)
    t3 = threading.Thread(target=late_request, name="late request")  # arrives while the swap waits: goes after it
    t3.start()
    assert cond.waiting["late request"].wait(30)
    release.set()
    for t in (t1, t2, t3):
        t.join()
    assert order == ["request 1 done", "swap", "request 2"]


# -- build_engine -------------------------------------------------------------------------------------


def test_build_engine_specs(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.arange(10, dtype=torch.float32)}
    deltasync.Publisher(url).publish(state)
    served = {"w": torch.zeros(10)}
    engine = build_engine("torch", repo=url, model=served, workers=1)
    assert isinstance(engine, TorchEngine)
    engine.update()
    assert torch.equal(served["w"], state["w"])

    (tmp_path / "my_models.py").write_text(
        "import torch\nMODEL = {'w': torch.zeros(10)}\ndef build():\n    return MODEL\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = build_engine("torch:my_models:build", repo=url)
    engine.update()
    assert torch.equal(sys.modules["my_models"].MODEL["w"], state["w"])

    with pytest.raises(UsageError, match="needs a model"):
        build_engine("torch", repo=url)
    with pytest.raises(UsageError, match="MODULE:FACTORY"):
        build_engine("torch:nofactory", repo=url)
    with pytest.raises(UsageError, match="cannot import"):
        build_engine("torch:no_such_module_x:build", repo=url)
    with pytest.raises(UsageError, match="unknown engine"):
        build_engine("triton", repo=url)
    with pytest.raises(UsageError, match="needs repo"):
        build_engine("torch", model=served)
    with pytest.raises(UsageError, match="http:PRESET@URL"):
        build_engine("http:sglang", repo=url, model_dir=str(tmp_path))
    with pytest.raises(UsageError, match="unknown HTTP preset"):
        build_engine("http:tgi@http://127.0.0.1:1", repo=url, model_dir=str(tmp_path))
    with pytest.raises(UsageError, match="needs model_dir"):
        build_engine("http:sglang@http://127.0.0.1:1", repo=url)
    with pytest.raises(UsageError, match="http engine"):
        build_engine("http:sglang@http://127.0.0.1:1", repo=url, model_dir=str(tmp_path), colour="red")
    with pytest.raises(UsageError, match=r"torch\.distributed"):
        build_engine("fanout", repo=url)


def test_engine_registry_builds_a_registered_kind_lazily(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new kind of engine is one register_engine call: its module is imported when one is built,
    its spec parser reads what follows its separator, and the CLI's questions are answered by it."""
    from deltasync.engines import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # the registration ends with the test
    state = {"w": torch.arange(10, dtype=torch.float32)}
    deltasync.Publisher(url).publish(state)
    (tmp_path / "my_engines.py").write_text(
        "from deltasync.engines.torch_engine import TorchEngine\n"
        "class NamedEngine(TorchEngine):\n    kind = 'named'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []

    def build(kind: registry.EngineKind, rest: str, spec: str, options: dict[str, Any]) -> Engine:
        seen.append(rest)
        return registry.construct(kind, {"w": torch.zeros(10)}, options.pop("repo"), **options)

    kind = registry.EngineKind(name="named", module="my_engines", cls="NamedEngine", build=build,
                               specs=("named@WHERE",), separator="@", in_process=True)
    registry.register_engine(kind)
    assert "my_engines" not in sys.modules and registry.find_engine("named@x:y") == (kind, "x:y")
    assert registry.find_engine("named:x") is None and "named@WHERE" in registry.specs()
    engine = build_engine("named@x:y", repo=url, pause_mode="wait")  # a vLLM option, dropped for others
    assert type(engine).__name__ == "NamedEngine" and seen == ["x:y"] and "my_engines" in sys.modules
    engine.update()
    with pytest.raises(UsageError, match=r"named engine: .*colour"):
        build_engine("named@x", repo=url, colour="red")
    with pytest.raises(UsageError, match="already registered"):
        registry.register_engine(kind)
    with pytest.raises(UsageError, match="without ':' or '@'"):
        registry.register_engine(registry.EngineKind(name="a:b", module="m", cls="C", build=build, specs=()))
    with pytest.raises(UsageError, match=r"unknown engine 'nam'.*named@WHERE"):
        build_engine("nam", repo=url)
    http = registry.parse_engine("http:generic@http://127.0.0.1:1")[0]
    assert http.loads_files and http.copy_option == "model_dir" and not http.in_process


# -- GPU -------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned staging, non-blocking copies)")
def test_gpu_module_swaps_bit_exact(url: str) -> None:
    states = [_all_dtypes(), _step(_all_dtypes(), 1, False), _step(_step(_all_dtypes(), 1, False), 2, True)]
    pub = deltasync.Publisher(url, small_chunks())
    for s in states:
        pub.publish(s)
    served = {n: torch.zeros_like(t, device="cuda") for n, t in states[0].items()}
    engine = TorchEngine(served, url)
    for v in (1, 2, 3, 1):
        engine.update(v)
        assert_serves(served, states[v - 1])
    staged = engine.stage(3)
    assert isinstance(staged, te.TorchStaged)
    # uploaded before the pause; sparse writes of each word width fused into one scatter
    assert staged.plan.fused and all(f.positions.device.type == "cuda" for f in staged.plan.fused)
    assert len({f.new.element_size() for f in staged.plan.fused}) == len(staged.plan.fused)
    assert all(w.idx is None for w in staged.plan.writes)
    engine.swap(staged)
    assert_serves(served, states[2])


def _gpu_engine_serving_version_1(url: str) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor], TorchEngine]:
    """Two versions of every dtype published, and an engine on the GPU serving the first."""
    states = [_all_dtypes(), _step(_all_dtypes(), 1, False)]
    pub = deltasync.Publisher(url, small_chunks())
    for s in states:
        pub.publish(s)
    served = {n: t.clone().cuda() for n, t in states[0].items()}
    return states, served, TorchEngine(served, url, version=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_failed_fused_write_restores_the_old_version(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from deltasync.engines import _fused

    states, served, engine = _gpu_engine_serving_version_1(url)
    staged = engine.stage(2)
    assert isinstance(staged, te.TorchStaged) and len(staged.plan.fused) >= 2
    calls = 0
    real = _fused.FusedScatter.apply

    def failing(self: _fused.FusedScatter) -> None:
        nonlocal calls
        calls += 1
        real(self)
        if calls == 2:  # two scatters written, then a failure
            raise RuntimeError("injected")

    monkeypatch.setattr(_fused.FusedScatter, "apply", failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.swap(staged)
    assert engine.version == 1
    assert_serves(served, states[0])
    monkeypatch.setattr(_fused.FusedScatter, "apply", real)
    engine.update(2)
    assert_serves(served, states[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_without_span_views_writes_per_tensor(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from deltasync.engines import _fused

    def unavailable(tensors: Any, width: int) -> Any:
        raise RuntimeError("no CUDA array interface here")

    monkeypatch.setattr(_fused, "span_view", unavailable)
    states, served, engine = _gpu_engine_serving_version_1(url)
    staged = engine.stage(2)
    assert isinstance(staged, te.TorchStaged) and not staged.plan.fused
    assert any(w.idx is not None for w in staged.plan.writes)
    engine.swap(staged)
    assert_serves(served, states[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_span_views_without_copying() -> None:
    from deltasync.engines._fused import span_view

    a = torch.zeros(1000, dtype=torch.int16, device="cuda")
    b = torch.zeros(3000, dtype=torch.int16, device="cuda")
    span, base = span_view([a, b], 2)
    assert base == min(a.data_ptr(), b.data_ptr())
    span[(b.data_ptr() - base) // 2 + 2999] = 7
    span[(a.data_ptr() - base) // 2] = 5
    assert int(b[-1]) == 7 and int(a[0]) == 5



# -- mapping changes into tensor-parallel slices ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.complex128])
def test_runs_land_in_every_kind_of_slice(dtype: torch.dtype) -> None:
    from deltasync.engines._changes import Geometry

    g = torch.Generator().manual_seed(2)
    old = torch.randn(12, 10, generator=g).to(dtype)
    new = torch.randn(12, 10, generator=g).to(dtype)
    per_item = 2 if dtype == torch.complex128 else 1
    entry = Geometry((0, 0), (12, 10), (12, 10), per_item)
    old_words = te.word_view(old.clone(), "old")
    new_words = te.word_view(new.clone(), "new")
    n = new_words.numel()
    sparse = torch.tensor([0, 5, 33, 34, 59, n - 1])
    runs = [
        te.Run("t", entry, new_words[7 : 7 + 45 * per_item].clone(), None, 7),  # partial rows at both ends
        te.Run("t", entry, new_words[60 * per_item :].clone(), None, 60 * per_item),  # whole rows to the end
        te.Run("t", entry, new_words[sparse].clone(), sparse),
    ]
    want = old_words.clone()
    want[7 : 7 + 45 * per_item] = new_words[7 : 7 + 45 * per_item]
    want[60 * per_item :] = new_words[60 * per_item :]
    want[sparse] = new_words[sparse]
    want_t = want.view(torch.uint8).view(dtype).view(12, 10)
    for offsets, shape in [((0, 0), (12, 10)), ((4, 0), (4, 10)), ((0, 3), (12, 4)), ((5, 2), (3, 5)), ((11, 9), (1, 1))]:
        held = old[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]].clone()
        words = te.word_view(held, "held")
        geometry = Geometry(offsets, shape, (12, 10), per_item)
        writes = te.build_writes(runs, {"t": words}, {"t": geometry})
        te.apply_writes(te.WritePlan(writes))
        expect = want_t[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]]
        assert bits(held) == bits(expect), (offsets, shape)
        for w in writes:  # and back
            w.undo()
        assert bits(held) == bits(old[offsets[0] : offsets[0] + shape[0], offsets[1] : offsets[1] + shape[1]])


def test_a_read_only_array_becomes_a_tensor_without_a_warning() -> None:
    """Values read from a copy or a fetched pack are read-only bytes; the engines only read the
    tensors made of them, so torch's warning about writing to them would only alarm users.
    (In a process of its own: torch gives that warning once per process.)"""
    import subprocess
    import sys

    code = ("import numpy as np\nfrom deltasync.engines.torch_engine import to_torch\n"
            "arr = np.frombuffer(b'\\x01\\x00\\x02\\x00', dtype=np.uint16)\n"
            "assert not arr.flags.writeable\nprint(to_torch(arr).tolist())")
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[1, 2]", r.stderr


def test_the_pause_is_written_by_the_pool_bit_exact_and_undone_whole_on_failure() -> None:
    """Writes cut into pieces for a pool's threads give the serial writes' bits exactly; a piece
    that fails leaves the tensors as they were before the pause."""
    from concurrent.futures import ThreadPoolExecutor

    from deltasync.engines._changes import Geometry

    g = torch.Generator().manual_seed(3)
    n = 1 << 20  # big enough for several pieces per run (te.MIN_PART_SPARSE, te.MIN_PART_DENSE)
    old = torch.randn(n, generator=g).bfloat16()
    new = torch.randn(n, generator=g).bfloat16()
    entry = Geometry((0,), (n,), (n,), 1)
    new_words = te.word_view(new.clone(), "new")
    sparse = torch.randperm(n // 2, generator=g)[: n // 8].sort().values + n // 2
    runs = [te.Run("t", entry, new_words[: n // 2].clone(), None, 0),
            te.Run("t", entry, new_words[sparse].clone(), sparse)]
    serial = old.clone()
    te.apply_writes(te.WritePlan(te.build_writes(runs, {"t": te.word_view(serial, "s")}, {"t": entry})))
    assert bits(serial) != bits(old)
    with ThreadPoolExecutor(4) as pool:
        held = old.clone()
        writes = te.build_writes(runs, {"t": te.word_view(held, "h")}, {"t": entry})
        assert sum(len(w.parts(4)) for w in writes) >= 4  # really cut, else the pool writes nothing at once
        te.apply_writes(te.WritePlan(writes), pool, 4)
        assert bits(held) == bits(serial)

        held = old.clone()
        writes = te.build_writes(runs, {"t": te.word_view(held, "h")}, {"t": entry})
        real, calls = writes[0].apply_part, [0]

        def flaky(kind: str, i: int, lo: int, hi: int) -> None:
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("a write failed")
            real(kind, i, lo, hi)

        writes[0].apply_part = flaky  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="a write failed"):
            te.apply_writes(te.WritePlan(writes), pool, 4)
        assert bits(held) == bits(old)


# -- a host mirror: staging in O(changed) for tensors on a device ------------------------------------


def test_compact_positions_round_trip_in_order() -> None:
    from deltasync.engines._mirror import compact_positions, expand_positions

    rng = torch.Generator().manual_seed(4)
    cases = [torch.tensor([], dtype=torch.long), torch.tensor([0, 65535, 65536, 5, 1 << 33]),
             torch.randint(0, 1 << 22, (5000,), generator=rng)]  # unsorted, across blocks
    for idx in cases:
        blocks, counts, low = compact_positions(idx.numpy())
        back = expand_positions(*(torch.from_numpy(a) for a in (blocks, counts, low)))
        assert torch.equal(back, idx)
        assert low.itemsize == 2 and blocks.size == counts.size <= max(1, idx.numel())


@pytest.mark.parametrize("device", DEVICES)
def test_a_host_mirror_stages_bit_exact_and_sends_only_what_changed(url: str, device: str) -> None:
    """With a mirror (forced on for the CPU: the same code as on a GPU), every version is bit-exact,
    the mirror follows the tensors, and what staging sends the device for 1% random bf16 changes
    is at most 2.5x the changed elements' bytes (int64 positions and values would be 5x)."""
    g = torch.Generator().manual_seed(6)
    n = 1 << 20
    states = [{"w": torch.randn(n, generator=g).bfloat16(), "b": torch.randn(64, generator=g)}]
    for k in range(3):
        s = {name: t.clone() for name, t in states[-1].items()}
        bits16 = s["w"].view(torch.int16)
        bits16[torch.randperm(n, generator=g)[: n // 100]] += 1  # 1% at random, one ulp
        if k == 1:
            s["b"] += 1.0  # every element: a dense chunk
        states.append(s)
    pub = deltasync.Publisher(url)
    for s in states:
        pub.publish(s)
    served = {name: t.clone().to(device) for name, t in states[0].items()}
    engine = TorchEngine(served, url, version=1, host_mirror=True)
    assert engine._mirror is not None
    for v in range(2, len(states) + 1):
        before = engine.h2d_bytes
        record = engine.update(v)
        assert record is not None
        assert_serves({k: t.cpu() for k, t in served.items()}, states[v - 1])
        for name, t in served.items():  # the mirror holds what is served
            assert bits(engine._mirror.words[name].view(t.dtype)) == bits(t.cpu())
        changed = record.elements_changed * 2
        if v != 3:  # the sparse versions
            assert 0 < engine.h2d_bytes - before <= 2.5 * changed, (engine.h2d_bytes - before, changed)
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_host_mirror_of_slices_stages_bit_exact(url: str, device: str) -> None:
    """Slices (a row block and a column block of matrices published whole) with a mirror: every
    version bit-exact, the mirror holds each region's served bits, chunks straddling a region's
    edge included (sparse versions, and one rewriting every element)."""
    g = torch.Generator().manual_seed(9)
    rows, cols = 512, 384
    states = [{"a": torch.randn(rows, cols, generator=g).bfloat16(), "b": torch.randn(cols, rows, generator=g)}]
    for k in range(3):
        s = {name: t.clone() for name, t in states[-1].items()}
        flat = s["a"].view(-1).view(torch.int16)
        flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() // 50]] += 1
        s["b"].view(-1)[torch.randperm(s["b"].numel(), generator=g)[:500]] += 1.0
        if k == 1:
            s["b"] += 0.5  # every element: dense chunks, cut to the region
        states.append(s)
    pub = deltasync.Publisher(url, deltasync.PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=8192)))
    for s in states:
        pub.publish(s)
    parts = {"a": ((100, 0), (200, cols)), "b": ((0, 96), (cols, 160))}

    def region(t: torch.Tensor, name: str) -> torch.Tensor:
        (o0, o1), (n0, n1) = parts[name]
        return t[o0 : o0 + n0, o1 : o1 + n1].contiguous()

    served = {name: deltasync.Slice(region(t, name).to(device), parts[name][0], tuple(t.shape))
              for name, t in states[0].items()}
    engine = TorchEngine(served, url, version=1, host_mirror=True)
    assert engine._mirror is not None and set(engine._mirror.words) == {"a", "b"}
    for v in range(2, len(states) + 1):
        assert engine.update(v) is not None
        for name, sl in served.items():
            assert bits(sl.tensor.cpu()) == bits(region(states[v - 1][name], name)), (v, name)
            assert bits(engine._mirror.words[name].view(sl.tensor.dtype)) == bits(sl.tensor.cpu())
    engine.close()


def test_a_live_check_reads_the_device_not_the_mirror_and_a_restage_repairs(url: str) -> None:
    """Bits changed on the device behind the engine: the live check finds them (it reads the
    device, not the mirror), and the restage an agent then runs rewrites them."""
    g = torch.Generator().manual_seed(8)
    states = [{"w": torch.randn(4096, generator=g).bfloat16()}]
    states.append({"w": states[0]["w"].clone() + 1})
    pub = deltasync.Publisher(url)
    for s in states:
        pub.publish(s)
    served = {"w": states[0]["w"].clone()}
    engine = TorchEngine(served, url, version=1, host_mirror=True)
    engine.update(2)
    assert engine.verify().ok
    served["w"].view(torch.int16)[100] += 7  # behind the engine's back
    check = engine.verify()
    assert not check.ok and [name for name, _ in check.drifted] == ["w"]
    engine.update(2, force=True)
    assert_serves(served, states[1])
    assert engine.verify().ok
    engine.close()

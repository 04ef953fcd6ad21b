"""The vLLM backend's pieces that need no vLLM: update requests, which tensors load, and
reading them from an agent's copy (tests/test_vllm.py drives a real vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_helpers import write_checkpoint

import deltasync
from deltasync.engines import build_engine
from deltasync.engines.vllm_engine import VllmEngine
from deltasync.engines.vllm_weights import (
    Source,
    UpdateRequest,
    copy_manifests,
    group_key,
    names_to_load,
    open_copy,
    request_amx,
)
from deltasync.errors import ChecksumMismatchError, DeltasyncError, UsageError

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
        with pytest.raises(ChecksumMismatchError):
            for n in states[2]:
                reader.tensor(n)


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

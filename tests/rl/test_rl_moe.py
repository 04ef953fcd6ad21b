"""The MoE variant of the reference RL loop, with workers whose inference path differs from the trainer's.

The policy is Mixtral-style (``MixtralForCausalLM`` names and config). ``kv_bf16`` workers
decode incrementally with a KV cache in bf16 while the trainer recomputes full sequences in
fp32: log-probs differ a little, and now and then a token is routed to other experts. The
workers report the experts they used; with ``router_replay`` the trainer routes as told.
Two CI-sized runs (module fixture ``moe_runs``), replay on and off, are checked for: no
position routed differently from the workers with replay (and the log-probs within the
run's tolerance), the mismatch counted without it, and the comparison plot.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deltasync.errors import UsageError
from deltasync.rl_integration import load_config
from deltasync.rl_integration.config import ModelConfig, RLConfig
from deltasync.rl_integration.metrics import read_metrics
from deltasync.rl_integration.model import TinyTransformer
from deltasync.rl_integration.sampling import generate, token_logprobs
from deltasync.rl_integration.serving import ServedPolicy
from deltasync.rl_integration.task import VOCAB_SIZE, AdditionTask
from deltasync.rl_integration.trainer import Trainer
from deltasync.rl_integration.worker import RolloutBatch

MOE = ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2)


def _peaked(cfg: ModelConfig = MOE, seed: int = 0, scale: float = 0.3) -> TinyTransformer:
    torch.manual_seed(seed)
    model = TinyTransformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * scale)
    return model


def test_moe_checkpoint_is_a_mixtral_checkpoint(tmp_path: Path) -> None:
    out = _peaked().save_pretrained(tmp_path / "ckpt")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (4, 2)
    names = set(TinyTransformer.from_pretrained(out).state_dict())
    assert {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight",
            "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"} <= names
    dense = json.loads(TinyTransformer(ModelConfig(vocab_size=VOCAB_SIZE)).save_pretrained(tmp_path / "d")
                       .joinpath("config.json").read_text())
    assert dense["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(UsageError, match="router_replay needs a mixture-of-experts"):
        load_config(None, router_replay=True)
    with pytest.raises(UsageError, match=r"workers\.inference"):
        load_config(None, **{"workers.inference": "fast"})


def test_replay_routes_as_told_and_exact_generation_reproduces_bit_for_bit() -> None:
    task = AdditionTask(2)
    model = _peaked().to(torch.bfloat16)
    prompts = np.repeat(task.prompts(*task.sample_operands(np.random.default_rng(0), 4)), 4, axis=0)
    gen = generate(model, prompts, task.answer_len, generator=torch.Generator().manual_seed(0))
    assert gen.routing is not None and gen.routing.shape == (2, 16, task.seq_len, 2)
    assert (gen.routing[:, :, -1] == -1).all() and (gen.routing[:, :, :-1] >= 0).all()
    tokens = torch.from_numpy(gen.tokens)
    mask = torch.from_numpy(gen.mask)
    again = token_logprobs(model, tokens, task.prompt_len)
    assert torch.equal(again[mask], torch.from_numpy(gen.logprobs)[mask])
    # Replay of another routing: the forward uses exactly the experts it is told.
    other = torch.from_numpy(gen.routing.astype(np.int64)).flip(-1)
    other = torch.where(other >= 0, (other + 1) % 4, other)
    token_logprobs(model, tokens, task.prompt_len, other)
    assert model.routing is not None
    told = (other >= 0).all(-1)
    assert torch.equal(model.routing[told], other[told].sort(-1).values)


def _kv_batch(task: AdditionTask, policy: ServedPolicy, version: int, seed: int) -> RolloutBatch:
    prompts = np.repeat(task.prompts(*task.sample_operands(np.random.default_rng(seed), 8)), 4, axis=0)
    v, gen = policy.generate(prompts, task.answer_len, generator=torch.Generator().manual_seed(seed))
    assert v == version
    return RolloutBatch(worker=0, version=v, seq=seed, generation=gen, group_size=4,
                        rewards=task.reward(prompts, gen.completions), completion_ids=[str(i) for i in range(len(prompts))],
                        created_unix=time.time(), generate_s=0.0)


@pytest.mark.parametrize("replay", [False, True])
def test_rl_step_counts_routing_mismatch_and_replay_removes_it(tmp_path: Path, replay: bool) -> None:
    task = AdditionTask(2)
    config = RLConfig(out_dir=str(tmp_path), model=MOE, digits=2, router_replay=replay)
    trainer = Trainer(config, task, checkpoints=tmp_path / "ckpt")
    trainer.policy = _peaked()
    trainer.start_rl()
    trainer.publish(1, {})
    worker = ServedPolicy(config.repo_url, MOE, inference="kv_bf16")
    assert worker.update(1) is not None
    batches = [_kv_batch(task, worker, 1, seed) for seed in range(3)]
    worker.close()
    stats = trainer.rl_step(batches)
    # bf16 incremental decoding against the trainer's fp32 recompute: a real gap, some
    # positions routed to other experts by the trainer's own router.
    assert stats.routing_mismatch is not None and stats.routing_mismatch > 0
    assert stats.logprob_gap_mean > 0 and stats.mismatch_is_std > 0
    assert stats.by_version is not None and set(stats.by_version) == {"1"}
    if replay:
        assert stats.routing_mismatch_used == 0
    else:
        assert stats.routing_mismatch_differing is not None and stats.routing_mismatch_differing > 0
        assert stats.routing_mismatch_used == stats.routing_mismatch_differing


# -- two CI-sized runs: router replay off and on -------------------------------------------------

STEPS = 8


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, list[dict[str, Any]]]]:
    from deltasync.rl_integration import run

    root = tmp_path_factory.mktemp("rl-moe")
    out: dict[str, tuple[Any, list[dict[str, Any]]]] = {}
    for replay in (False, True):
        name = "replay" if replay else "no-replay"
        config = load_config(
            None, out_dir=str(root / name), steps=STEPS, seed=0, digits=2, router_replay=replay,
            **{"model.num_local_experts": 4, "model.intermediate_size": 64, "model.max_position_embeddings": 16,
               "warm_start.steps": 150, "workers.count": 1, "workers.inference": "kv_bf16",
               "gate.suite_size": 64, "gate.enabled": False},
        )
        result = run(config, echo=lambda line: None, progress=False, warm_start_cache=root / "warm")
        out[name] = (result, read_metrics(result.metrics_path))
    return out


@pytest.mark.slow
def test_router_replay_leaves_no_position_routed_differently(
        moe_runs: dict[str, tuple[Any, list[dict[str, Any]]]]) -> None:
    result, records = moe_runs["replay"]
    steps = [r for r in records if r["event"] == "step"]
    config = next(r for r in records if r["event"] == "config")
    assert len(steps) == STEPS and all(s["router_replay"] for s in steps)
    tolerance = config["logprob_tolerance"]
    for s in steps:
        assert s["routing_mismatch_used"] == 0  # the trainer routed every position as the worker did
        assert s["gap_over_tolerance"] == 0 and s["logprob_gap"] <= tolerance  # bf16 vs fp32 numerics only
        assert s["logprob_gap_mean"] > 0  # ...which are real: another inference path
        assert set(s["gap_by_version"]) == {str(b["version"]) for b in s["rollouts"]}
    assert result.summary["routing_mismatch_used"] == 0


@pytest.mark.slow
def test_without_replay_the_trainer_routes_by_itself(moe_runs: dict[str, tuple[Any, list[dict[str, Any]]]]) -> None:
    result, records = moe_runs["no-replay"]
    steps = [r for r in records if r["event"] == "step"]
    assert len(steps) == STEPS and not any(s["router_replay"] for s in steps)
    for s in steps:  # what it used is its own router's choice: every mismatch is a position routed differently
        assert s["routing_mismatch_used"] == s["routing_mismatch_differing"]
        assert 0 <= s["routing_mismatch"] < 0.5
        assert (s["rerouted_tokens"] > 0) == (s["rerouted_gap_mean"] is not None)
    assert result.summary["routing_mismatch_mean"] is not None


@pytest.mark.slow
def test_compare_plot_of_both_runs(moe_runs: dict[str, tuple[Any, list[dict[str, Any]]]], tmp_path: Path) -> None:
    runs = [str(moe_runs[n][0].out_dir) for n in ("no-replay", "replay")]
    out = tmp_path / "compare.png"
    res = subprocess.run([sys.executable, "-m", "deltasync", "rl", "compare", *runs, "--label", "replay off",
                          "--label", "replay on", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"wrote {out}" in res.stdout
    assert out.stat().st_size > 10_000
    assert (moe_runs["replay"][0].out_dir / "plot.png").stat().st_size > 10_000

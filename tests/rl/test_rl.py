"""The reference RL loop (deltasync.rl_integration): pieces in process, then real runs end to end.

The end-to-end run (module fixture ``rl_run``) warm-starts the policy, runs asynchronous RL
with two worker processes that only receive weights through a repository, injects a bad
update the gate must catch, and is then checked for: bit-exact serving of every version a
worker reported, a zero trainer-vs-worker log-prob gap, held-out reward above the warm
start, the rollback, the metrics file and the plot. A second, short run in live-feedback
mode starts from version 1 of that repository, pulled as a checkpoint directory.
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deltasync import Publisher, Repository, Subscriber
from deltasync.errors import DeltasyncError, UsageError
from deltasync.rl_integration import load_config
from deltasync.rl_integration.config import ModelConfig, RLConfig
from deltasync.rl_integration.feedback import FeedbackServer, FeedbackStore, SimulatedUsers, post_feedback
from deltasync.rl_integration.gate import EvalGate
from deltasync.rl_integration.metrics import SyncTracker, read_metrics
from deltasync.rl_integration.model import TinyTransformer
from deltasync.rl_integration.sampling import generate, token_logprobs
from deltasync.rl_integration.serving import ServedPolicy, served_digest, serving_target
from deltasync.rl_integration.task import EOS, PAD, VOCAB_SIZE, AdditionTask
from deltasync.rl_integration.trainer import Trainer, group_advantages
from deltasync.rl_integration.worker import RolloutBatch

SMALL = ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, max_position_embeddings=16)


# -- task ----------------------------------------------------------------------------------------


def test_task_format_and_partial_credit() -> None:
    task = AdditionTask(3)
    a, b = np.array([123, 905]), np.array([456, 97])
    prompts = task.prompts(a, b)
    assert [task.render(p) for p in prompts] == ["^321+654=", "^509+790="]  # operands least significant first
    answers = task.answers(a, b)
    assert [task.render(x) for x in answers] == ["9750$", "2001$"]  # 579 and 1002, reversed
    assert task.operands_of(prompts)[0].tolist() == [123, 905]
    assert task.reward(prompts, answers).tolist() == [1.0, 1.0]
    wrong = answers.copy()
    wrong[0, 1] = 0  # one digit wrong
    wrong[1, 2:] = [EOS, PAD, PAD]  # stopped early: the missing tokens count as wrong
    assert task.reward(prompts, wrong).tolist() == pytest.approx([4 / 5, 2 / 5])
    # The teacher without errors is the reference; forgetting every carry breaks 905+97.
    rng = np.random.default_rng(0)
    assert (task.teacher_answers(a, b, rng, 0.0) == answers).all()
    assert task.reward(prompts, task.teacher_answers(a, b, rng, 1.0)).tolist() == pytest.approx([1.0, 0.4])


def test_heldout_split_is_disjoint() -> None:
    task = AdditionTask(3)
    rng = np.random.default_rng(1)
    a, b = task.sample_operands(rng, 5000)
    assert not task.is_heldout(a, b).any()
    ha, hb = task.sample_operands(rng, 500, heldout=True)
    assert task.is_heldout(ha, hb).all()
    assert task.sample_operands(rng, 0)[0].shape == (0,)
    suite = task.eval_suite(64)
    assert (suite == task.eval_suite(64)).all()  # fixed


# -- configuration -------------------------------------------------------------------------------


def test_config_files_and_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('steps = 7\nlr = 1e-4\n[workers]\ncount = 3\n[gate]\nfollow = "canary"\n')
    c = load_config(toml, **{"warm_start.steps": 5, "workers.count": None})
    assert (c.steps, c.lr, c.workers.count, c.gate.follow, c.warm_start.steps) == (7, 1e-4, 3, "canary", 5)
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"live": {"enabled": True, "port": 0}}))
    assert load_config(js).live.enabled
    assert c.replace(**{"gate.tolerance": 0.1}).gate.tolerance == 0.1
    bad = tmp_path / "bad.toml"
    for text, match in [
        ("stepz = 3\n", "unknown config setting 'stepz'"),
        ("[workers]\ncont = 3\n", "unknown config setting workers.cont"),
        ("group_size = 1\n", "group_size must be >= 2"),
        ('[workers]\nbackend = "slurm"\n', "backend must be"),
        ("[model]\nhidden_size = 30\nnum_attention_heads = 4\n", "not a multiple"),
        ("steps = [\n", "bad.toml"),
    ]:
        bad.write_text(text)
        with pytest.raises(UsageError, match=match):
            load_config(bad)


# -- model, sampling and the log-prob gap --------------------------------------------------------


def _trained_like(cfg: ModelConfig = SMALL, seed: int = 0) -> TinyTransformer:
    torch.manual_seed(seed)
    model = TinyTransformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.3)  # larger weights than init: peaked distributions
    return model


def test_behaviour_logprobs_are_reproduced_bit_for_bit_from_published_weights(tmp_path: Path) -> None:
    task = AdditionTask(2)
    master = _trained_like()
    repo = str(tmp_path / "repo")
    Publisher(repo).publish(master.bf16_state())
    served = ServedPolicy(repo, SMALL)
    swap = served.update(1)
    assert swap is not None and swap.bit_exact and swap.version == 1
    prompts = np.repeat(task.prompts(*task.sample_operands(np.random.default_rng(0), 6)), 4, axis=0)
    version, gen = served.generate(prompts, task.answer_len, generator=torch.Generator().manual_seed(0))
    assert version == 1 and gen.mask[:, 0].all()
    scorer = TinyTransformer(SMALL).to(torch.bfloat16)
    scorer.load_state_dict(master.bf16_state())
    again = token_logprobs(scorer, torch.from_numpy(gen.tokens), task.prompt_len)
    mask = torch.from_numpy(gen.mask)
    assert torch.equal(again[mask], torch.from_numpy(gen.logprobs)[mask])  # the gap is exactly zero
    # ...and the check has teeth: the fp32 master weights (not what was served) differ.
    fp32 = token_logprobs(master, torch.from_numpy(gen.tokens), task.prompt_len)
    assert (fp32 - torch.from_numpy(gen.logprobs)).abs()[mask].max() > 1e-4
    served.close()


def test_served_digest_detects_a_single_flipped_bit(tmp_path: Path) -> None:
    repo = str(tmp_path / "repo")
    state = _trained_like().bf16_state()
    Publisher(repo).publish(state)
    info = Repository(repo).manifest(1)
    assert served_digest(state, info) == info.pb.version_digest
    flipped = {k: v.clone() for k, v in state.items()}
    flipped["lm_head.weight"].view(torch.int16).view(-1)[5] ^= 1
    assert served_digest(flipped, info) != info.pb.version_digest


def test_checkpoint_pulled_by_deltasync_loads_directly(tmp_path: Path) -> None:
    config = RLConfig(out_dir=str(tmp_path), model=SMALL, digits=2, snapshot_every=5)
    trainer = Trainer(config, AdditionTask(2), checkpoints=tmp_path / "ckpt")
    first = trainer.publish(1, {"rl.phase": "test"})
    with torch.no_grad():
        trainer.policy.lm_head.weight.add_(0.01)
    second = trainer.publish(2, {"rl.phase": "test"})
    assert (first.kind, second.kind) == ("snapshot", "delta")
    out = tmp_path / "pulled"
    Subscriber(config.repo_url).pull_to_dir(out, 2)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["config.json", "generation_config.json",
                                                                                       "model.safetensors"]
    loaded = TinyTransformer.from_pretrained(out)
    assert loaded.config == SMALL and loaded.lm_head.weight.dtype == torch.bfloat16
    tokens = torch.from_numpy(AdditionTask(2).eval_suite(8))
    assert torch.equal(loaded(tokens), trainer.scorers[2](tokens))


# -- the RL update -------------------------------------------------------------------------------


def test_group_advantages() -> None:
    r = np.array([1, 0, 1, 0, 0.5, 0.5, 0.5, 0.5, 1, np.nan, 0, np.nan], np.float32)
    rated = ~np.isnan(r)
    adv, groups, signal = group_advantages(r, rated, 4)
    assert (groups, signal) == (3, 2)
    assert adv[:4] == pytest.approx([1, -1, 1, -1], abs=1e-5)
    assert (adv[4:8] == 0).all()  # equal rewards: no signal
    assert adv[8] == pytest.approx(1, abs=1e-5) and adv[10] == pytest.approx(-1, abs=1e-5)
    assert adv[9] == 0 and adv[11] == 0  # unrated


def _batch(task: AdditionTask, model: TinyTransformer, version: int, *, seed: int = 0, group: int = 4,
           live: bool = False) -> RolloutBatch:
    prompts = np.repeat(task.prompts(*task.sample_operands(np.random.default_rng(seed), 4)), group, axis=0)
    gen = generate(model, prompts, task.answer_len, generator=torch.Generator().manual_seed(seed))
    rewards = np.full(len(prompts), np.nan, np.float32) if live else task.reward(prompts, gen.completions)
    return RolloutBatch(worker=0, version=version, seq=seed, generation=gen, group_size=group, rewards=rewards,
                        completion_ids=[f"w0-{seed}-{i}" for i in range(len(prompts))], created_unix=time.time(),
                        generate_s=0.0)


def test_rl_step_recomputes_and_truncates(tmp_path: Path) -> None:
    task = AdditionTask(2)
    config = RLConfig(out_dir=str(tmp_path), model=SMALL, digits=2, is_truncation=1.5)
    trainer = Trainer(config, task, checkpoints=tmp_path / "ckpt")
    trainer.policy = _trained_like()
    trainer.start_rl()
    trainer.publish(1, {})
    fresh = _batch(task, trainer.scorers[1], 1)
    stats = trainer.rl_step([fresh])
    assert stats.logprob_gap == 0.0  # scored with the very bits that sampled
    assert stats.is_weight == pytest.approx(1.0, abs=0.05)  # fp32 master vs its bf16 cast: nearly on-policy
    # A behaviour policy that claims much lower probabilities: the weights get truncated,
    # and the gap says the log-probs do not belong to version 1.
    off = _batch(task, trainer.scorers[1], 1, seed=1)
    off.generation.logprobs[off.generation.mask] -= 2.0
    stats = trainer.rl_step([off])
    assert stats.logprob_gap == pytest.approx(2.0, abs=0.01)
    assert stats.truncated > 0.9


# -- gate, pins and rollback ---------------------------------------------------------------------


def _always_pad(model: TinyTransformer) -> None:
    """Damage a model so that it answers PAD everywhere (reward 0): a constant residual
    stream (equal embeddings, attention and MLP outputs zeroed) that only PAD's row reads."""
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[PAD] = 1.0


@pytest.mark.parametrize("follow", ["gated", "canary"])
def test_gate_keeps_the_last_good_version_and_workers_roll_back(tmp_path: Path, follow: str) -> None:
    task = AdditionTask(2)
    repo = str(tmp_path / "repo")
    config = load_config(None, **{"gate.follow": follow, "gate.suite_size": 64})
    gate = EvalGate(repo, SMALL, task, config.gate, seed=0)
    worker = ServedPolicy(repo, SMALL)
    pub = Publisher(repo)
    good = _trained_like()
    pub.publish(good.bf16_state())
    first = gate.judge(1)
    assert first.passed and first.pinned == 1
    assert Repository(repo).pinned() == (1 if follow == "gated" else None)
    assert serving_target(Repository(repo)) == 1
    worker.update(1)
    bad = _trained_like()
    _always_pad(bad)
    pub.publish(bad.bf16_state())
    if follow == "canary":  # workers take a new version at once...
        assert serving_target(Repository(repo)) == 2
        swap = worker.update(2)
        assert swap is not None and swap.bit_exact
    else:  # ...or only once it is pinned
        assert serving_target(Repository(repo)) == 1
    verdict = gate.judge(2)
    assert not verdict.passed and verdict.evaluation.score == 0.0
    assert verdict.reference == first.evaluation.score and verdict.pinned == 1
    assert Repository(repo).pinned() == 1
    target = serving_target(Repository(repo))
    assert target == 1
    back = worker.update(target)
    if follow == "canary":
        assert back is not None and back.previous == 2 and back.version == 1 and back.bit_exact
        assert back.digest == Repository(repo).manifest(1).pb.version_digest.hex()
    else:
        assert back is None  # never left version 1
    # A newer good version passes and is served again.
    pub.publish(good.bf16_state())
    assert gate.judge(3).passed
    assert serving_target(Repository(repo)) == 3
    gate.close()
    worker.close()


# -- live feedback -------------------------------------------------------------------------------


@pytest.fixture
def feedback() -> Iterator[tuple[FeedbackStore, FeedbackServer, AdditionTask]]:
    task = AdditionTask(2)
    store = FeedbackStore(task, timeout=60.0)  # expiry is tested with an explicit clock
    server = FeedbackServer(store, "127.0.0.1", 0).start()
    yield store, server, task
    server.close()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_feedback_endpoint_joins_rewards_to_rollouts(feedback: tuple[FeedbackStore, FeedbackServer, AdditionTask]) -> None:
    store, server, task = feedback
    batch = _batch(task, _trained_like(), 3, live=True, group=2)
    store.add(batch)
    pending = _get(f"{server.url}/pending?limit=3")
    assert len(pending) == 3 and pending[0]["completion_id"] == "w0-0-0" and pending[0]["version"] == 3
    assert pending[0]["prompt"].startswith("^") and pending[0]["prompt"].endswith("=")
    ids = batch.completion_ids
    assert post_feedback(server.url, {"completion_id": ids[0], "verdict": "accepted"}) == (
        200, {"completion_id": ids[0], "reward": 1.0})
    assert post_feedback(server.url, {"completion_id": ids[1], "verdict": "edited", "score": 0.3})[1]["reward"] == 0.3
    assert post_feedback(server.url, {"completion_id": ids[2], "verdict": "edited"})[1]["reward"] == 0.5
    assert post_feedback(server.url, {"completion_id": ids[3], "verdict": "rejected"})[1]["reward"] == 0.0
    status, body = post_feedback(server.url, {"completion_id": ids[0], "verdict": "rejected"})
    assert status == 409 and "already has feedback" in body["error"]
    assert post_feedback(server.url, {"completion_id": "nope", "verdict": "accepted"})[0] == 404
    assert post_feedback(server.url, {"completion_id": ids[4], "verdict": "meh"})[0] == 400
    assert post_feedback(server.url, {"completion_id": ids[4], "verdict": "edited", "score": 2})[0] == 400
    assert post_feedback(server.url, {"completion_id": ids[4], "verdict": "edited", "score": True})[0] == 400
    req = urllib.request.Request(f"{server.url}/feedback", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    assert store.ready() == []  # not all rated yet, time not up
    rest = [{"completion_id": cid, "verdict": "accepted"} for cid in ids[4:]] + [{"completion_id": "x", "verdict": "accepted"}]
    status, results = post_feedback(server.url, rest)
    assert status == 207 and [r.get("reward") for r in results] == [1.0] * (len(ids) - 4) + [None]
    (ready,) = store.ready()
    assert ready is batch and ready.rated.all()
    assert ready.rewards[:4].tolist() == pytest.approx([1.0, 0.3, 0.5, 0.0])
    assert post_feedback(server.url, {"completion_id": ids[0], "verdict": "accepted"})[0] == 404  # trained on: gone
    assert _get(f"{server.url}/stats")["received"] == len(ids)


def test_feedback_timeout_releases_partly_rated_batches(feedback: tuple[FeedbackStore, FeedbackServer, AdditionTask]) -> None:
    store, server, task = feedback
    batch = _batch(task, _trained_like(), 1, live=True, group=2)
    store.add(batch)
    post_feedback(server.url, [{"completion_id": cid, "verdict": "accepted"} for cid in batch.completion_ids[:3]])
    assert store.ready() == []
    (ready,) = store.ready(now=time.time() + store.timeout + 1)
    assert ready.rated.sum() == 3 and store.stats()["batches_expired"] == 1
    adv, groups, signal = group_advantages(ready.rewards, ready.rated, 2)
    assert groups == 4 and signal == 0 and not adv.any()  # no group with two different rated rewards


def test_simulated_users_judge_with_the_verifier() -> None:
    task = AdditionTask(2)
    users = SimulatedUsers("http://unused", task, delay=0)
    prompt = task.render(task.prompts(np.array([47]), np.array([85]))[0])  # 47 + 85 = 132
    assert users.judge(prompt, "231$") == {"verdict": "accepted"}
    assert users.judge(prompt, "201$") == {"verdict": "edited", "score": 0.75}
    assert users.judge(prompt, "9") == {"verdict": "rejected"}


def test_sync_tracker_waits_for_every_worker() -> None:
    from deltasync.rl_integration.serving import SwapReport

    def swap(v: int, at: float) -> SwapReport:
        return SwapReport(v, None, "d", "d", at, 0.001, 0.01, 100, 10)

    t = SyncTracker(workers=2)
    t.publish(1, 100.0)
    t.target(1, 100.0)
    t.swap(0, swap(1, 100.2))
    assert t.complete() == []
    t.publish(2, 101.0)
    t.target(2, 101.1)
    t.swap(1, swap(2, 101.5))  # worker 1 skipped version 1: serving 2 counts for 1 too
    (one,) = t.complete()
    assert one["version"] == 1 and one["latency_s"] == pytest.approx(1.5) and one["workers_on_version"] == 1
    t.swap(0, swap(2, 101.3))
    (two,) = t.complete()
    assert two["latency_s"] == pytest.approx(0.5) and two["serve_latency_s"] == pytest.approx(0.4)


# -- end to end ----------------------------------------------------------------------------------

E2E_STEPS = 40
INJECT_AT = 12


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[dict[str, Any]]]:
    from deltasync.rl_integration import run

    out = tmp_path_factory.mktemp("rl")
    config = load_config(None, out_dir=str(out), steps=E2E_STEPS, seed=0,
                         **{"workers.count": 2, "gate.follow": "canary", "gate.inject_regression_at": INJECT_AT})
    result = run(config, echo=lambda line: None, progress=False)
    return result, read_metrics(result.metrics_path)


@pytest.mark.slow
def test_workers_served_bit_exact_weights_of_every_version_they_reported(rl_run: tuple[Any, list[dict[str, Any]]]) -> None:
    result, records = rl_run
    repo = Repository(str(result.out_dir / "repo"))
    swaps = [r for r in records if r["event"] == "swap"]
    assert {s["worker"] for s in swaps} == {0, 1}
    served: dict[int, set[int]] = {0: set(), 1: set()}
    for s in swaps:
        # The worker hashed its module's bits; the digest must be the repository's own.
        assert s["digest"] == repo.manifest(s["version"]).pb.version_digest.hex(), s
        served[s["worker"]].add(s["version"])
    steps = [r for r in records if r["event"] == "step"]
    assert len(steps) == E2E_STEPS
    trained = [(b["worker"], b["version"]) for s in steps for b in s["rollouts"]]
    assert len(trained) == E2E_STEPS * 2
    for worker, version in trained:  # every rollout came from a version its worker served bit-exactly
        assert version in served[worker]
    assert max(s["logprob_gap"] for s in steps) == 0.0
    assert all(s["eval"]["reward"] is not None for s in steps)


@pytest.mark.slow
def test_reward_rose_above_the_warm_start(rl_run: tuple[Any, list[dict[str, Any]]]) -> None:
    result, _ = rl_run
    s = result.summary
    assert 0.6 < s["warm_start_reward"] < 0.95  # a non-trivial warm start, with room left
    assert s["final_reward"] > s["warm_start_reward"] + 0.015, s
    assert s["final_exact"] > s["warm_start_exact"], s


@pytest.mark.slow
def test_gate_caught_the_injected_regression_and_workers_rolled_back(rl_run: tuple[Any, list[dict[str, Any]]]) -> None:
    result, records = rl_run
    bad = INJECT_AT + 1  # version 1 is the warm start
    assert result.summary["rejected_versions"] == [bad]
    (rollback,) = [r for r in records if r["event"] == "rollback"]
    assert rollback["version"] == bad and rollback["pinned"] == bad - 1 and rollback["score"] < rollback["reference"]
    step = next(r for r in records if r["event"] == "step" and r["version"] == bad)
    assert not step["gate_passed"] and step["injected_regression"] and step["pin_ref"] == bad - 1
    for w in (0, 1):
        mine = [r for r in records if r["event"] == "swap" and r["worker"] == w]
        versions = [r["version"] for r in mine]
        # Canary: a worker may have served the bad version; if so it went back to the pinned one.
        if bad in versions:
            after = mine[versions.index(bad) + 1]
            assert after["previous"] == bad and after["version"] == bad - 1
        assert versions[-1] == E2E_STEPS + 1  # and ended on the last version
    later = [r for r in records if r["event"] == "step" and r["version"] > bad]
    assert all(b["version"] != bad for s in later for b in s["rollouts"])  # never trained on


@pytest.mark.slow
def test_metrics_plot_and_final_checkpoint(rl_run: tuple[Any, list[dict[str, Any]]]) -> None:
    result, records = rl_run
    events = {r["event"] for r in records}
    assert {"config", "warm_start", "step", "swap", "sync", "rollback", "summary"} <= events
    step = next(r for r in records if r["event"] == "step")
    for key in ("reward", "staleness", "logprob_gap", "stored_bytes", "ratio", "eval", "is_weight", "truncated", "synced"):
        assert key in step
    assert sum(len(r["synced"]) for r in records if r["event"] == "step") > E2E_STEPS // 2
    syncs = [r for r in records if r["event"] == "sync"]
    assert syncs and all(r["latency_s"] >= 0 and r["serve_latency_s"] >= 0 for r in syncs)
    assert result.summary["delta_ratio_median"] > 2  # deltas are much smaller than the weights
    assert result.summary["swaps_bit_exact"] == result.summary["swaps"]
    assert result.plot_path is not None and result.plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = TinyTransformer.from_pretrained(result.final_dir)
    assert model.config == load_config().model


@pytest.mark.slow
def test_live_feedback_run(rl_run: tuple[Any, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Live mode, starting from version 1 of the first run as ``deltasync pull`` writes it."""
    from deltasync.rl_integration import run

    first, _ = rl_run
    start = tmp_path / "start"
    Subscriber(str(first.out_dir / "repo")).pull_to_dir(start, 1)
    config = load_config(None, out_dir=str(tmp_path / "live"), steps=6,
                         **{"warm_start.init_from": str(start), "live.enabled": True, "live.port": 0,
                            "live.user_delay": 0.02})
    result = run(config, echo=lambda line: None, progress=False)
    s = result.summary
    assert s["feedback"]["received"] >= 6 * 2 * 64 and s["feedback"]["refused"] == 0
    assert s["swaps_bit_exact"] == s["swaps"] and s["logprob_gap_max"] == 0.0
    assert s["warm_start_reward"] == pytest.approx(first.summary["warm_start_reward"])  # same weights as version 1
    records = read_metrics(result.metrics_path)
    steps = [r for r in records if r["event"] == "step"]
    assert all(r["samples"] > 0 and not math.isnan(r["reward"]) for r in steps)


def test_ray_backend_without_ray_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from deltasync.rl_integration.backends import make_backend

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed (the dev extra installs it)
    with pytest.raises(UsageError, match=r"pip install 'deltasync\[ray\]'"):
        make_backend("ray", queue_size=2)


@pytest.mark.slow
def test_ray_backend_run(rl_run: tuple[Any, list[dict[str, Any]]], tmp_path: Path) -> None:
    """The same workers as Ray actors (only where ``deltasync[ray]`` is installed)."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'deltasync[ray]')")
    from deltasync.rl_integration import run

    first, _ = rl_run
    start = tmp_path / "start"
    Subscriber(str(first.out_dir / "repo")).pull_to_dir(start, 1)
    config = load_config(None, out_dir=str(tmp_path / "ray"), steps=4,
                         **{"warm_start.init_from": str(start), "workers.backend": "ray"})
    # The local Ray node is started here, as the backend would (it joins one already up): its
    # raylet must register within Ray's own 30 s, which a loaded 2-core machine missed once
    # ("The current node timed out during startup"); that, and only that, is tried again.
    for attempt in range(3):
        try:
            ray.init(ignore_reinit_error=True)
            break
        except Exception as e:
            ray.shutdown()
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
    try:
        result = run(config, echo=lambda line: None, progress=False)
    finally:
        ray.shutdown()
    assert result.summary["swaps"] >= 2 and result.summary["swaps_bit_exact"] == result.summary["swaps"]


# -- the command line: reruns, the warm-start cache, the progress legend, the plot ---------------


@pytest.mark.slow
def test_rl_cli_refuses_to_replace_a_run_and_reuses_the_warm_start(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    config = tmp_path / "rl.json"
    config.write_text(json.dumps({
        "steps": 2, "digits": 2, "model": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                            "num_attention_heads": 2, "max_position_embeddings": 16},
        "warm_start": {"steps": 20, "batch_size": 32}, "workers": {"count": 1}, "gate": {"suite_size": 16},
    }))
    env = {**os.environ, "DELTASYNC_CACHE": str(tmp_path / "cache")}

    def rl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "deltasync", "rl", "run", "--config", str(config), "-q", *args],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)

    first = rl("--out", "run")
    assert first.returncode == 0, first.stderr
    assert "20 steps in" in first.stdout and "stale K:N: N of the batches trained on" in first.stdout, first.stdout
    again = rl("--out", "run")
    assert again.returncode == 2 and again.stdout == "", again.stdout
    assert again.stderr.startswith("deltasync: error: run holds a previous run (repo, checkpoints") and "--force" in again.stderr
    assert again.stderr.count("\n") == 1
    digest = Repository(str(tmp_path / "run" / "repo")).manifest(1).pb.version_digest
    forced = rl("--out", "run", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "20 steps, reused from " in forced.stdout and str(tmp_path / "cache" / "rl-warm-start") in forced.stdout
    # The reused weights are bit for bit those the warm start computes: version 1 is the same.
    assert Repository(str(tmp_path / "run" / "repo")).manifest(1).pb.version_digest == digest
    fresh = rl("--out", "other", "--no-warm-cache")
    assert fresh.returncode == 0 and "20 steps in" in fresh.stdout, fresh.stderr
    assert Repository(str(tmp_path / "other" / "repo")).manifest(1).pb.version_digest == digest
    assert "gap: " in subprocess.run([sys.executable, "-m", "deltasync", "rl", "run", "--help"], capture_output=True,
                                     text=True, env=env, timeout=60).stdout


@pytest.mark.slow
def test_plot_legends_cover_no_curve(rl_run: tuple[Any, list[dict[str, Any]]]) -> None:
    import matplotlib.pyplot as plt

    from deltasync.rl_integration.plot import draw_metrics

    _, records = rl_run
    fig = draw_metrics(records)
    try:
        fig.canvas.draw()
        legends = 0
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is None:
                continue
            legends += 1
            box, area = legend.get_window_extent(), ax.get_window_extent()
            assert not box.overlaps(area), f"{ax.get_title()}: legend {box} inside the plot {area}"
        assert legends == 6  # reward, bytes, sync, pause, log-prob gap, IS spread / routing
    finally:
        plt.close(fig)


# -- the vLLM worker's pieces that need no vLLM --------------------------------------------------


def test_vllm_completions_become_a_generation_and_the_tokenizer_is_the_tasks(tmp_path: Path) -> None:
    from deltasync.rl_integration.vllm_rollout import to_generation, write_tokenizer

    task = AdditionTask(2)
    prompts = task.prompts(np.array([12, 3]), np.array([34, 99]))
    choices = [  # vLLM's answer order is not the prompts' order; the second stops at EOS
        {"index": 1, "token_ids": [2, 0, 1, EOS], "logprobs": {"token_logprobs": [-0.1, -0.2, -0.3, -0.4]}},
        {"index": 0, "token_ids": [6, 4, 0, EOS, 7], "logprobs": {"token_logprobs": [-1.0, -2.0, -3.0, -4.0, -5.0]}},
    ]
    gen = to_generation(prompts, task.answer_len, choices)
    assert gen.mask.tolist() == [[True, True, True, True], [True, True, True, True]]
    assert gen.completions.tolist() == [[6, 4, 0, EOS], [2, 0, 1, EOS]]
    assert gen.logprobs[0].tolist() == pytest.approx([-1, -2, -3, -4])
    assert task.reward(prompts, gen.completions).tolist() == [1.0, 1.0]  # 12+34=46, 3+99=102, reversed
    short = [{"index": 0, "token_ids": [1, EOS], "logprobs": {"token_logprobs": [-0.5, -0.5]}},
             {"index": 1, "token_ids": [1], "logprobs": {"token_logprobs": []}}]
    with pytest.raises(DeltasyncError, match="returned 0 log-probs for 1 tokens"):
        to_generation(prompts, task.answer_len, short)
    with pytest.raises(DeltasyncError, match="1 completions for 2 prompts"):
        to_generation(prompts, task.answer_len, short[:1])
    tok = json.loads((write_tokenizer(tmp_path / "tok") / "tokenizer.json").read_text())
    assert tok["model"]["vocab"] == {ch: i for i, ch in enumerate("0123456789+=^$_")}
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "$" and cfg["bos_token"] == "^"


def test_vllm_workers_without_vllm_say_how_to_get_it(tmp_path: Path) -> None:
    from deltasync.rl_integration.vllm_rollout import VllmPolicy
    from deltasync.rl_integration.worker import WorkerSpec

    spec = WorkerSpec(worker_id=0, repo=str(tmp_path / "repo"), model=SMALL, digits=2, group_size=2,
                      prompts_per_batch=1, seed=0, inference="vllm", work_dir=str(tmp_path),
                      vllm_python=str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(UsageError, match=r"install_vllm\.sh"):
        VllmPolicy(spec)
    with pytest.raises(UsageError, match="cannot update fused MoE expert weights in place"):
        load_config(None, **{"model.num_local_experts": 4, "workers.inference": "vllm"})

"""The ``deltasync`` verl checkpoint engine, driven by verl's own classes on CPU.

verl's ``CheckpointEngineWorker`` (the rollout side's worker) builds the engine from a real
``RolloutConfig`` through ``custom_backend_module`` and hands ``receive_weights`` to a
server adapter; the trainer side calls ``send_weights`` with a trainer engine's
``get_per_tensor_param()`` export, as verl's actor worker does. The trainer engine and the
server adapters are fakes (no GPU, no SGLang server), as in verl's CPU tests; what applies
the flushes is verl's own SGLang delta loader (``delta_loader.apply_delta``).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is not installed here: scripts/install_verl.sh builds .venv-verl")

import torch
from torch import nn
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl.workers.rollout.sglang_rollout.delta_loader import apply_delta

from deltasync import Repository, Subscriber

STEPS = 6


class TinyLM(nn.Module):
    """A small decoder-shaped model; ``load_weights`` is the SGLang model API the loader calls."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 32, dtype=dtype)
        self.up = nn.Linear(32, 96, dtype=dtype)
        self.down = nn.Linear(96, 32, dtype=dtype)
        self.norm = nn.LayerNorm(32, dtype=dtype)
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h)))
        out: torch.Tensor = self.norm(h) @ self.embed.weight.T
        return out

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        state = self.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in weights:
                state[name].data.copy_(tensor)


class FakeTrainerEngine:
    """What verl's actor worker holds: fp32 master weights, AdamW, a bf16 per-tensor export."""

    def __init__(self) -> None:
        self.model = TinyLM()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(1)

    def train_step(self) -> None:
        ids = torch.randint(0, 64, (8, 12), generator=self.gen)
        loss = nn.functional.cross_entropy(self.model(ids[:, :-1]).reshape(-1, 64), ids[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.model.get_buffer("step").add_(1)

    def get_per_tensor_param(self) -> tuple[Iterator[tuple[str, torch.Tensor]], None]:
        def gen() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in self.model.state_dict().items():
                yield name, (t.to(torch.bfloat16) if t.is_floating_point() else t.clone())
        return gen(), None

    def exported(self) -> dict[str, torch.Tensor]:
        return dict(self.get_per_tensor_param()[0])


class FakeServerAdapter:
    """The rollout server side: applies what the engine yields as verl's adapters do."""

    def __init__(self) -> None:
        self.model = TinyLM(torch.bfloat16)
        self.flushes: list[dict[str, Any]] = []

    async def update_weights(self, weights: Any, global_steps: int | None = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> None:
        if wire_format == "delta_flush":
            async for named, _is_last in weights:
                import json

                spec = json.loads(bytes(dict(named)["__delta_spec__"].numpy().tobytes()))
                self.flushes.append(spec)
                apply_delta(self.model, named)  # verl's own SGLang loader
        else:
            self.model.load_weights([(name, t) async for name, t in weights])

    def bits(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    views = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(views[a[k].element_size()]),
                                                 b[k].reshape(-1).view(views[b[k].element_size()]))
        for k in a)


@pytest.fixture(autouse=True)
def _worker_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """verl's workers read their rank from the environment and start a torch.distributed group
    of one (as a Ray worker does): both end with each test, so later tests see neither."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def rollout_worker(repo: str, wire_format: str = "delta_flush") -> Any:
    """verl's own rollout-side worker, built from a real RolloutConfig (no Ray actor: called in-process)."""
    config = RolloutConfig(name="sglang", checkpoint_engine=CheckpointEngineConfig(
        backend="deltasync", custom_backend_module="deltasync.integrations.verl", update_weights_bucket_megabytes=1,
        engine_kwargs={"deltasync": {"repo": repo, "wire_format": wire_format, "timeout": 30}}))
    return CheckpointEngineWorker(config, None, server_adapter=FakeServerAdapter())


@pytest.fixture
def trainer_engine(tmp_path: Path) -> Any:
    import deltasync.integrations.verl  # noqa: F401  (what custom_backend_module does)

    return CheckpointEngineRegistry.new("deltasync", bucket_size=1 << 20, is_master=True,
                                        repo=str(tmp_path / "repo"))


def test_registered_under_its_name_through_verls_registry() -> None:
    from deltasync.integrations.verl import DeltasyncCheckpointEngine

    assert CheckpointEngineRegistry.get("deltasync") is DeltasyncCheckpointEngine


def test_round_trip_bit_exact_with_a_replica_that_skips_and_one_restarted(trainer_engine: Any, tmp_path: Path) -> None:
    repo = str(tmp_path / "repo")
    trainer = FakeTrainerEngine()
    steady = rollout_worker(repo)                     # takes every version, as delta flushes
    skipper = rollout_worker(repo)                    # takes versions 1, 4 and 6 only
    restarted = rollout_worker(repo, "named_tensors")  # whole/changed tensors; replaced after version 3
    for step in range(1, STEPS + 1):
        trainer.train_step()
        gen, _ = trainer.get_per_tensor_param()
        metrics = asyncio.run(trainer_engine.send_weights(gen, global_steps=step))
        assert metrics["checkpoint_engine/version"] == step
        want = trainer.exported()
        asyncio.run(steady.update_weights(global_steps=step))
        assert same_bits(steady.server_adapter.bits(), want), step
        if step in (1, 4, 6):
            asyncio.run(skipper.update_weights(global_steps=step))
            assert same_bits(skipper.server_adapter.bits(), want), step
        if step == 4:  # a replica process restarted mid-run: fresh engine, fresh server
            restarted = rollout_worker(repo, "named_tensors")
        asyncio.run(restarted.update_weights(global_steps=step))
        assert same_bits(restarted.server_adapter.bits(), want), step

    flushes = steady.server_adapter.flushes
    assert flushes[0]["encoding"] == "dense"  # first update: whole tensors
    assert {f["encoding"] for f in flushes[1:]} == {"indices", "dense"}  # changed elements; the int step buffer whole
    indexed = [p for f in flushes[1:] if f["encoding"] == "indices" for p in f["params"]]
    # a few percent of elements change per step, not the whole tensor
    changed = sum(p["val_end"] - p["val_start"] for p in indexed)
    assert 0 < changed < 0.5 * sum(t.numel() for t in trainer.exported().values()) * (STEPS - 1)
    versions = Repository(repo).versions()
    assert versions == list(range(1, STEPS + 1))
    assert Repository(repo).manifest(STEPS).pb.metadata["verl.global_steps"] == str(STEPS)


def test_a_changed_element_that_is_nan_goes_whole(trainer_engine: Any, tmp_path: Path) -> None:
    """The loaders read NaN as "unchanged"; a NaN that is news therefore travels as a dense flush."""
    repo = str(tmp_path / "repo")
    replica = rollout_worker(repo)
    state = {"w": torch.arange(16, dtype=torch.float32).to(torch.bfloat16).reshape(4, 4),
             "v": torch.ones(8, dtype=torch.bfloat16)}
    replica.server_adapter.model = _Holder(state)
    for step, change in ((1, None), (2, float("nan")), (3, -0.0)):
        if change is not None:
            state["w"][1, 2] = change
            state["v"][0] = 2.0
        asyncio.run(trainer_engine.send_weights(iter(list(state.items())), global_steps=step))
        asyncio.run(replica.update_weights(global_steps=step))
        assert same_bits(replica.server_adapter.model.tensors, state), step
    by_step = replica.server_adapter.flushes
    nan_flushes = [f for f in by_step if any(p["name"] == "w" for p in f["params"])]
    assert [f["encoding"] for f in nan_flushes] == ["dense", "dense", "indices"]


class _Holder(nn.Module):
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tensors = {k: torch.zeros_like(v) for k, v in state.items()}

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            self.tensors[name].copy_(t)


def test_a_restarted_trainer_resends_steps_under_new_versions(tmp_path: Path) -> None:
    """The trainer dies after step 3 and resumes from its step-1 checkpoint: steps 2 and 3 come again,
    with other weights, as versions 4 and 5; replicas get the new ones, not the old versions 2 and 3."""
    import deltasync.integrations.verl  # noqa: F401

    repo = str(tmp_path / "repo")
    replica = rollout_worker(repo)
    first = CheckpointEngineRegistry.new("deltasync", bucket_size=1 << 20, is_master=True, repo=repo)
    trainer = FakeTrainerEngine()
    for step in (1, 2, 3):
        trainer.train_step()
        asyncio.run(first.send_weights(trainer.get_per_tensor_param()[0], global_steps=step))
    resumed = CheckpointEngineRegistry.new("deltasync", bucket_size=1 << 20, is_master=True, repo=repo)
    trainer = FakeTrainerEngine()  # other data order from here: other weights
    trainer.gen.manual_seed(99)
    trainer.train_step()
    for step in (2, 3):
        trainer.train_step()
        metrics = asyncio.run(resumed.send_weights(trainer.get_per_tensor_param()[0], global_steps=step))
        assert metrics["checkpoint_engine/version"] == step + 2
        asyncio.run(replica.update_weights(global_steps=step))
        assert same_bits(replica.server_adapter.bits(), trainer.exported()), step


def test_a_replica_in_another_cluster_reads_through_a_relay(trainer_engine: Any, tmp_path: Path) -> None:
    """The trainer publishes to its store; the replica's repo is a relay (``deltasync serve``) in front of it."""
    repo = str(tmp_path / "repo")
    trainer = FakeTrainerEngine()
    trainer.train_step()
    asyncio.run(trainer_engine.send_weights(trainer.get_per_tensor_param()[0], global_steps=1))
    relay = subprocess.Popen([sys.executable, "-m", "deltasync", "serve", "--repo", repo, "--listen", "127.0.0.1:0",
                              "--poll-interval", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert relay.stdout is not None
        line = relay.stdout.readline()  # "serving REPO on 127.0.0.1:PORT (cache ...)"
        match = re.search(r" on (127\.0\.0\.1:\d+)", line)
        assert match, line + (relay.stderr.read() if relay.stderr else "")
        replica = rollout_worker(f"grpc://{match.group(1)}")
        for step in range(1, 4):
            if step > 1:
                trainer.train_step()
                asyncio.run(trainer_engine.send_weights(trainer.get_per_tensor_param()[0], global_steps=step))
            asyncio.run(replica.update_weights(global_steps=step))
            assert same_bits(replica.server_adapter.bits(), trainer.exported()), step
    finally:
        relay.terminate()
        relay.wait(timeout=30)


RANKS_SCRIPT = """
import asyncio, sys, torch, torch.distributed as dist
from verl.checkpoint_engine import CheckpointEngineRegistry
import deltasync.integrations.verl
dist.init_process_group("gloo")
rank = dist.get_rank()
engine = CheckpointEngineRegistry.new("deltasync", bucket_size=1 << 20, is_master=rank == 0, repo={repo!r})
torch.manual_seed(0)
state = {{f"layers.{{i}}.weight": torch.randn(64, 64).to(torch.bfloat16) for i in range(8)}}
for step in range(1, 4):
    for t in state.values():
        t[step, :4] += 1
    # every rank iterates the whole export, as verl's FSDP ranks do; each publishes its share
    metrics = asyncio.run(engine.send_weights(iter(list(state.items())), global_steps=step))
if rank == 0:
    torch.save(state, {final!r})
kind, version = type(engine._publisher).__name__, int(metrics["checkpoint_engine/version"])
print(f"rank {{rank}} {{kind}} version {{version}}", flush=True)  # one write: the ranks share the pipe
"""


@pytest.mark.slow
def test_every_trainer_rank_publishes_its_share(tmp_path: Path) -> None:
    repo, final = str(tmp_path / "repo"), str(tmp_path / "final.pt")
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT.format(repo=repo, final=final))
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29713", str(script)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} DistributedPublisher version 3" in proc.stdout, proc.stdout
    assert Repository(repo).versions() == [1, 2, 3]
    assert same_bits(dict(Subscriber(repo).pull()), torch.load(final))


def test_signed_versions_and_a_replica_that_trusts_another_key(tmp_path: Path) -> None:
    from deltasync import SignatureError

    for name in ("trainer", "stranger"):
        subprocess.run([sys.executable, "-m", "deltasync", "keygen", "--out", str(tmp_path / name)], check=True,
                       capture_output=True, timeout=120)
    repo = str(tmp_path / "repo")
    import deltasync.integrations.verl  # noqa: F401

    engine = CheckpointEngineRegistry.new("deltasync", bucket_size=1 << 20, is_master=True, repo=repo,
                                          signing_key=str(tmp_path / "trainer.key"))
    state = {"w": torch.ones(64, dtype=torch.bfloat16)}
    asyncio.run(engine.send_weights(iter(list(state.items())), global_steps=1))
    trusting = CheckpointEngineRegistry.new("deltasync", bucket_size=1 << 20, repo=repo, wire_format="named_tensors",
                                            trusted_keys=[str(tmp_path / "trainer.pub")])

    async def receive(replica: Any) -> dict[str, torch.Tensor]:
        return {n: t async for n, t in replica.receive_weights(global_steps=1)}

    assert same_bits(asyncio.run(receive(trusting)), state)
    wary = CheckpointEngineRegistry.new("deltasync", bucket_size=1 << 20, repo=repo, wire_format="named_tensors",
                                        trusted_keys=str(tmp_path / "stranger.pub"), timeout=2)
    with pytest.raises(SignatureError):
        asyncio.run(receive(wary))


def test_without_verl_one_line_says_what_to_install() -> None:
    code = "import sys; sys.modules['verl'] = None\nimport deltasync.integrations.verl"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "MissingDependencyError" in proc.stderr and "pip install 'deltasync[verl]'" in proc.stderr, proc.stderr

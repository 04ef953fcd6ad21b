"""``DeltasyncCallback`` in a real ``transformers.Trainer`` and a real TRL ``GRPOTrainer``.

Tiny Llama-shaped models and a word-level tokenizer are built in-process (no hub downloads);
each trainer runs a few optimizer steps on CPU. The repository must then hold one version
per step, and the latest version pulled back must equal ``model.state_dict()`` bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (scripts/install_verl.sh)")

import torch

from deltasync import Repository, Subscriber
from deltasync.integrations.transformers import DeltasyncCallback

#: transformers' Trainer and TrainingArguments refuse to start without accelerate (deltasync[transformers]
#: brings it); the project's own environment can have transformers through another package without it.
needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="accelerate is not installed here: scripts/install_verl.sh builds .venv-verl")

VOCAB = ["<pad>", "<eos>", "<bos>", *[str(i) for i in range(10)], "+", "=", "a", "b"]


def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return LlamaForCausalLM(config)


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call, unused-ignore]  # (untyped in transformers 5)
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(
            a[k].contiguous().view(views[a[k].element_size()]), b[k].contiguous().view(views[b[k].element_size()]))
        for k in a)


def check_repo(repo: str, steps: int, model: torch.nn.Module) -> None:
    r = Repository(repo)
    assert r.versions() == list(range(1, steps + 1))  # one version per optimizer step
    assert [r.manifest(v).pb.metadata["hf.global_step"] for v in r.versions()] == [str(s) for s in range(1, steps + 1)]
    pulled = Subscriber(repo).pull()
    assert same_bits(dict(pulled), {k: v.detach() for k, v in model.state_dict().items()})


class Sums(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 13, (n, 12), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@needs_accelerate
def test_trainer_publishes_one_version_per_step_bit_exact(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    model = tiny_llama()
    repo = str(tmp_path / "repo")
    callback = DeltasyncCallback(repo, every_n_steps=1, metadata={"run": "t1"})
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                             learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Sums(32), callbacks=[callback]).train()
    check_repo(repo, 4, model)
    assert Repository(repo).manifest(4).pb.metadata["run"] == "t1"
    assert len(callback.results) == 4 and callback.results[0].kind == "snapshot"


@needs_accelerate
def test_every_n_steps_and_the_end_of_training_publishing_in_the_background(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    model = tiny_llama()
    repo = str(tmp_path / "repo")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=5, per_device_train_batch_size=4,
                             learning_rate=1e-5, report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=True, disable_tqdm=True)
    callback = DeltasyncCallback(repo, every_n_steps=2, dtype=torch.bfloat16, background=True)
    Trainer(model=model, args=args, train_dataset=Sums(32), callbacks=[callback]).train()
    # bf16 of fp32 master weights at an RL-like learning rate: few elements change, versions are deltas
    assert [r.kind for r in callback.results] == ["snapshot", "delta", "delta"]
    r = Repository(repo)
    assert [r.manifest(v).pb.metadata["hf.global_step"] for v in r.versions()] == ["2", "4", "5"]  # 5: the end
    want = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert same_bits(dict(Subscriber(repo).pull()), want)


def test_grpo_trainer_publishes_one_version_per_step_bit_exact(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl", reason="TRL is not installed (scripts/install_verl.sh)")
    from datasets import Dataset

    model = tiny_llama()
    tokenizer = tiny_tokenizer()
    prompts = Dataset.from_dict({"prompt": [f"{a} + {b} =" for a, b in zip(range(8), range(8, 0, -1), strict=True)]})

    def reward_len(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(c.split())) for c in completions]

    repo = str(tmp_path / "repo")
    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=6, learning_rate=1e-3, report_to=[],
                          save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=prompts,
                              processing_class=tokenizer, callbacks=[DeltasyncCallback(repo)])
    trainer.train()
    check_repo(repo, 3, trainer.model)


DDP_SCRIPT = """
import sys, torch
from transformers import Trainer, TrainingArguments
sys.path.insert(0, {here!r})
from test_integration_transformers import Sums, tiny_llama
from deltasync.integrations.transformers import DeltasyncCallback
model = tiny_llama()
cb = DeltasyncCallback({repo!r}, background=True)  # publishing overlaps the next steps' DDP all-reduces
args = TrainingArguments(output_dir={out!r}, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
                         report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
                         ddp_backend="gloo")
Trainer(model=model, args=args, train_dataset=Sums(32), callbacks=[cb]).train()
if torch.distributed.get_rank() == 0:
    torch.save({{k: v.detach() for k, v in model.state_dict().items()}}, {final!r})
# One write of one line per rank (the two ranks share the pipe: print's separate writes interleave)
print(f"rank {{torch.distributed.get_rank()}} published {{[int(r) for r in cb.results]}}", flush=True)
"""


@needs_accelerate
@pytest.mark.slow
def test_ddp_two_ranks_publish_one_version_per_step(tmp_path: Path) -> None:
    """torchrun, two CPU processes (gloo): every rank encodes a share, one version per step."""
    repo, final = str(tmp_path / "repo"), str(tmp_path / "final.pt")
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT.format(here=str(Path(__file__).parent), repo=repo, out=str(tmp_path / "out"),
                                        final=final))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29711", str(script)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 published [1, 2, 3]" in proc.stdout and "rank 1 published [1, 2, 3]" in proc.stdout, proc.stdout
    r = Repository(repo)
    assert r.versions() == [1, 2, 3]
    assert same_bits(dict(Subscriber(repo).pull()), torch.load(final))


FSDP2_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import TrainerControl, TrainerState, TrainingArguments
sys.path.insert(0, {here!r})
from test_integration_transformers import tiny_llama
from deltasync.integrations.transformers import DeltasyncCallback
dist.init_process_group("gloo")
model = tiny_llama()
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
cb = DeltasyncCallback({repo!r})
args, state, control = TrainingArguments(output_dir={out!r}, report_to=[], use_cpu=True), TrainerState(), TrainerControl()
gen = torch.Generator().manual_seed(0)
for step in range(1, 4):  # the loop of Trainer, which does not run FSDP2 on CPU: step, then the callback
    ids = torch.randint(3, 13, (2, 12), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    state.global_step = step
    cb.on_step_end(args, state, control, model=model)
sd = model.state_dict()
full = {{k: v.full_tensor().detach() for k, v in sd.items()}}
if dist.get_rank() == 0:
    torch.save(full, {final!r})
kinds = sorted({{type(v).__name__ for v in sd.values()}})
print(f"rank {{dist.get_rank()}} kinds {{kinds}} published {{[int(r) for r in cb.results]}}", flush=True)  # one write
# both ranks leave together and close their groups, then skip the interpreter's teardown: a gloo
# worker thread can still hold FSDP's last all-gather (AsyncAllgatherCoalescedWork) and free its
# tensors while Python finalizes; taking the GIL then aborts the rank ("terminate called without
# an active exception", seen in core dumps in about 1 run in 20). Everything checked is written by then.
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@needs_accelerate
@pytest.mark.slow
def test_fsdp2_shards_are_published_as_slices_without_gathering(tmp_path: Path) -> None:
    """FSDP2 (fully_shard) on two CPU ranks: each rank publishes its DTensor shards; the version is the full model."""
    repo, final = str(tmp_path / "repo"), str(tmp_path / "final.pt")
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2_SCRIPT.format(here=str(Path(__file__).parent), repo=repo, out=str(tmp_path / "out"),
                                          final=final))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29712", str(script)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} kinds ['DTensor'] published [1, 2, 3]" in proc.stdout, proc.stdout
    r = Repository(repo)
    assert r.versions() == [1, 2, 3]
    full = torch.load(final)
    # every tensor stored as two slices, one from each rank's shard
    assert len(r.manifest(3).pb.tensors) == 2 * len(full)
    assert same_bits(dict(Subscriber(repo).pull()), full)


def test_without_transformers_one_line_says_what_to_install() -> None:
    code = "import sys; sys.modules['transformers'] = None\nimport deltasync.integrations.transformers"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "pip install 'deltasync[transformers]'" in proc.stderr, proc.stderr

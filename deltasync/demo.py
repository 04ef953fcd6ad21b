"""``deltasync demo``: the main job end to end on a local repository, no servers needed.

A tiny transformer is trained for a few AdamW steps; each step's bf16 weights are saved
as a Hugging Face style safetensors checkpoint, published, then the latest version is
pulled into a serving directory and checked byte for byte against the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from ._extras import require
from .progress import human_bytes


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def run_demo(workdir: Path, *, steps: int = 5, echo: Callable[[str], None] = print, progress: bool | None = None) -> None:
    require("torch", "deltasync demo")  # without it: one line naming the extra, not a traceback
    import torch
    from safetensors.torch import save_file

    from . import Publisher, PublisherConfig, Repository, Subscriber
    from .ops.verify import verify_repository

    workdir = Path(workdir)
    if workdir.exists():
        shutil.rmtree(workdir)
    repo_dir, ckpt_dir, serving = workdir / "repo", workdir / "checkpoints", workdir / "serving"
    torch.manual_seed(0)
    vocab, dim = 2048, 256
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, dim),
        torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True), num_layers=2
        ),
        torch.nn.Linear(dim, vocab),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    pub = Publisher(str(repo_dir), PublisherConfig(progress=progress))
    echo(f"demo: training a {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter transformer "
         f"for {steps} steps; repository {repo_dir}")
    last_ckpt = ckpt_dir
    for step in range(1, steps + 1):
        tokens = torch.randint(0, vocab, (8, 64))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        last_ckpt = ckpt_dir / f"step-{step:04d}"
        last_ckpt.mkdir(parents=True)
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(last_ckpt / "model.safetensors"), metadata={"format": "pt", "step": str(step)})
        (last_ckpt / "config.json").write_text(json.dumps({"vocab_size": vocab, "hidden_size": dim, "layers": 2}))
        r = pub.publish_dir(last_ckpt, cache_dir=workdir / "publish-cache", metadata={"step": str(step)})
        echo(f"  step {step}: loss {loss.item():.3f} -> version {r} ({r.kind}), "
             f"{human_bytes(r.raw_bytes)} raw, {human_bytes(r.stored_bytes)} stored ({r.ratio:.1f}x)")

    sub = Subscriber(str(repo_dir), progress=progress)
    latest = sub.update_dir(serving).version
    for f in sorted(p for p in last_ckpt.iterdir()):
        if _sha256(f) != _sha256(serving / f.name):
            raise AssertionError(f"pulled {f.name} differs from the checkpoint")
    report = verify_repository(str(repo_dir), progress=progress)
    repo = Repository(str(repo_dir))
    raw = sum(repo.manifest(v).pb.raw_bytes for v in repo.versions())
    stored = sum(repo.manifest(v).pb.stored_bytes for v in repo.versions())
    echo(f"pulled version {latest} into {serving}: every file sha256-identical to {last_ckpt}")
    echo(f"verified {len(report.versions)} versions ({report.chunks} chunks); "
         f"{human_bytes(raw)} of checkpoints stored in {human_bytes(stored)} ({raw / stored:.1f}x)")
    echo(f"try: {_command()} log --repo {repo_dir}")


def _command() -> str:
    """How to run ``deltasync`` from a shell here: the bare name only where it is this
    environment's (in a virtual environment not activated, its full path)."""
    here = Path(sys.executable).parent / "deltasync"
    found = shutil.which("deltasync")
    if found is not None and Path(found).resolve() == here.resolve():
        return "deltasync"
    if here.exists():
        return shlex.quote(str(here))
    return f"{shlex.quote(sys.executable)} -m deltasync"

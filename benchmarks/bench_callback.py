"""What ``DeltasyncCallback`` adds to a training step: a real ``transformers.Trainer``, with and without it.

Run from the repository root, in the environment that has transformers (``scripts/install_verl.sh``)::

    .venv-verl/bin/python -m benchmarks.bench_callback                # ~21M-parameter Llama, lr 1e-6
    .venv-verl/bin/python -m benchmarks.bench_callback --quick        # a small model, seconds
    .venv-verl/bin/python -m benchmarks.bench_callback --lr 1e-5 --steps 8 --json out.json
    .venv-verl/bin/python -m benchmarks.bench_callback --background  # encode and upload off the step

A random-init Llama-shaped model trains on random tokens with AdamW on fp32 weights (CPU);
the callback publishes the bf16 cast after every optimizer step to a local repository.
Timing callbacks placed around it split each step into the training step (``on_step_begin``
to just before the publish) and the publish, in the same run, so both see the same machine
load. The figure is the median of publish ÷ training step over the steps after the first
(the first version is a snapshot). Also printed: the fraction of bf16 elements that changed
per step, which the learning rate sets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def build_model(quick: bool) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if quick:
        config = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    else:
        config = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def run(quick: bool, lr: float, steps: int, repo: str, background: bool = False) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from deltasync.integrations.transformers import DeltasyncCallback

    class Clock(TrainerCallback):  # type: ignore[misc, unused-ignore]  # (untyped where transformers is absent)
        """Marks the time at ``on_step_begin`` (``at="begin"``) or at ``on_step_end``."""

        def __init__(self, marks: list[float], at: str) -> None:
            self.marks, self.at = marks, at

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            if self.at == "begin":
                self.marks.append(time.perf_counter())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            if self.at == "end":
                self.marks.append(time.perf_counter())

    class ChangeMeter(TrainerCallback):  # type: ignore[misc, unused-ignore]
        """Changed bf16 elements per step, measured before the step's clock starts."""

        def __init__(self) -> None:
            self.prev: dict[str, torch.Tensor] | None = None
            self.fractions: list[float] = []

        def on_step_begin(self, *args: Any, model: Any = None, **kwargs: Any) -> None:
            now = {k: v.detach().to(torch.bfloat16).view(torch.int16).clone() for k, v in model.state_dict().items()}
            if self.prev is not None:
                changed = sum(int((now[k] != self.prev[k]).sum()) for k in now)
                self.fractions.append(changed / sum(v.numel() for v in now.values()))
            self.prev = now

    model = build_model(quick)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    seq, batch = (64, 4) if quick else (128, 8)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (batch * steps, seq), generator=gen)]
    begins: list[float] = []
    trained: list[float] = []
    published: list[float] = []
    meter = ChangeMeter()
    publish = DeltasyncCallback(repo, dtype=torch.bfloat16, publish_at_end=False, background=background)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr,
                                 lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_strategy="no",
                                 use_cpu=True, disable_tqdm=True, seed=0)
        # on_step_begin: meter, then the clock; on_step_end: clock (trained), publish, clock (published)
        callbacks = [meter, Clock(begins, "begin"), Clock(trained, "end"), publish, Clock(published, "end")]
        Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    step_s = [t - b for b, t in zip(begins, trained, strict=True)][1:]  # after the first (a snapshot)
    publish_s = [p - t for t, p in zip(trained, published, strict=True)][1:]
    overheads = [p / s for p, s in zip(publish_s, step_s, strict=True)]
    return {
        "params": params, "lr": lr, "step_s_median": statistics.median(step_s),
        "publish_s_median": statistics.median(publish_s), "overhead_median": statistics.median(overheads),
        "changed_fraction_median": statistics.median(meter.fractions), "kinds": [r.kind for r in publish.results],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_callback", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--background", action="store_true",
                   help="DeltasyncCallback(background=True): the step pays the host copy (and waits for a publish still running)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_callback needs transformers: bash scripts/install_verl.sh, then .venv-verl/bin/python", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        s = run(args.quick, args.lr, args.steps, str(Path(tmp) / "repo"), args.background)
    print(f"{s['params'] / 1e6:.1f}M parameters, lr {args.lr:g}: {s['changed_fraction_median']:.2%} of bf16 elements "
          f"changed per step (median); training step {s['step_s_median'] * 1e3:.0f} ms, publish "
          f"{s['publish_s_median'] * 1e3:.0f} ms: the callback adds {s['overhead_median']:.1%} (median); "
          f"versions {s['kinds']}")
    if args.json:
        args.json.write_text(json.dumps(s, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

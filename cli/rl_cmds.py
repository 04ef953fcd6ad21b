"""The demo and the reference RL loop: demo, rl run, rl compare."""

from __future__ import annotations

from pathlib import Path

import click

from ._common import (
    cache_base,
    quiet_option,
    show_progress,
)


@click.command()
@click.option("--dir", "workdir", type=click.Path(path_type=Path), default=Path("deltasync-demo"), show_default=True)
@click.option("--steps", type=click.IntRange(2, 50), default=5, show_default=True)
@quiet_option
def demo(workdir: Path, steps: int, quiet: bool) -> None:
    """Train a tiny transformer for a few steps, publish each checkpoint, pull and verify."""
    from .._extras import import_needing_extras

    # The demo trains with torch: without it, one line naming the extra, not a traceback.
    demo_module = import_needing_extras("deltasync.demo", "deltasync demo")
    demo_module.run_demo(workdir, steps=steps, echo=click.echo, progress=show_progress(quiet))


@click.group()
def rl() -> None:
    """Reference asynchronous RL loop whose weights move only through deltasync."""


@rl.command("run")
@click.option("--config", "config_file", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              metavar="FILE", help="Settings (TOML or JSON, sections as in deltasync.rl_integration.config).")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="RL steps, one version each [default: 150].")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Rollout workers [default: 2].")
@click.option("--backend", type=click.Choice(["local", "ray"]), default=None,
              help="Workers as local processes, or as Ray actors (pip install 'deltasync[ray]') [default: local].")
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Run directory: repository, checkpoints, metrics.jsonl, plot.png [default: deltasync-rl].")
@click.option("--repo", default=None, metavar="URL", help="Repository to publish to (empty) [default: OUT/repo].")
@click.option("--seed", type=int, default=None, help="[default: 0]")
@click.option("--live", is_flag=True, default=None,
              help="Train on feedback posted over HTTP (with simulated users unless the config turns them off).")
@click.option("--feedback-port", type=click.IntRange(0, 65535), default=None, help="Port of the feedback endpoint (--live).")
@click.option("--rollout", type=click.Choice(["exact", "kv_bf16", "vllm"]), default=None,
              help="How workers generate: the trainer's own arithmetic (gap 0), incremental bf16 KV-cache decoding, "
                   "or vLLM servers (scripts/install_vllm.sh) [default: exact].")
@click.option("--experts", type=click.IntRange(min=0), default=None,
              help="Mixture-of-experts policy with this many experts per layer (Mixtral-style, top-2) [default: 0, dense].")
@click.option("--router-replay/--no-router-replay", default=None,
              help="MoE: the trainer routes every token to the experts the worker reported [default: off].")
@click.option("--force", is_flag=True, help="Replace the outputs of a previous run in --out [default: refuse].")
@click.option("--no-warm-cache", is_flag=True,
              help="Always train the warm start [default: reuse the weights of an earlier run with the same model, "
                   "task, seed and warm-start settings, kept under $DELTASYNC_CACHE/rl-warm-start, else "
                   "~/.cache/deltasync/rl-warm-start].")
@quiet_option
def rl_run(config_file: Path | None, steps: int | None, workers: int | None, backend: str | None, out_dir: Path | None,
           repo: str | None, seed: int | None, live: bool | None, feedback_port: int | None, rollout: str | None,
           experts: int | None, router_replay: bool | None, force: bool, no_warm_cache: bool, quiet: bool) -> None:
    """Warm-start a small transformer on addition, then improve it with asynchronous RL.

    \b
    A progress line per step (every ~10% when not on a terminal), e.g.
      rl 12/150 v13  reward 0.412  eval 0.455 (warm 0.398)  stale 1:1 2:1  gap 0  1.2 KiB/v 52.3x  sync 35 ms
    reward: mean reward of the step's training batches; eval: held-out score of the version served
    (warm: after the warm start); stale K:N: N of the batches trained on were sampled from weights K
    updates old; gap: the largest log-prob difference between trainer and worker for the same tokens
    (0: workers served exactly the trainer's weights); then bytes stored per version and its ratio,
    and the time from publish to every worker serving it.
    """
    from ..rl_integration import load_config, run

    config = load_config(
        config_file, steps=steps, seed=seed, repo=repo,
        out_dir=str(out_dir) if out_dir is not None else None,
        router_replay=router_replay,
        **{"workers.count": workers, "workers.backend": backend, "live.enabled": live, "live.port": feedback_port,
           "workers.inference": rollout, "model.num_local_experts": experts},
    )
    result = run(config, echo=click.echo, progress=False if quiet else None, force=force,
                 warm_start_cache=None if no_warm_cache else cache_base() / "rl-warm-start")
    for line in result.lines():
        click.echo(line)


@rl.command("compare")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option("--label", "labels", multiple=True, help="A name per run, in order [default: the directory names].")
@click.option("--out", "out_path", type=click.Path(path_type=Path, dir_okay=False), default=Path("compare.png"),
              show_default=True, help="PNG to write.")
def rl_compare(runs: tuple[Path, ...], labels: tuple[str, ...], out_path: Path) -> None:
    """Plot several runs' reward curves, log-prob gaps and routing mismatch on one figure."""
    from ..rl_integration.metrics import read_metrics
    from ..rl_integration.plot import plot_compare

    if labels and len(labels) != len(runs):
        raise click.UsageError(f"{len(labels)} --label for {len(runs)} runs")
    names = list(labels) or [r.name for r in runs]
    plot_compare({n: read_metrics(r / "metrics.jsonl") for n, r in zip(names, runs, strict=True)}, out_path)
    click.echo(f"wrote {out_path}")


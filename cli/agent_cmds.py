"""The agent: subscribe keeps a directory copy and/or an engine at the version to serve."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from deltasync.cli._common import (
    RetryLog,
    cli,
    dir_argument,
    fsync_option,
    local_dir,
    mib,
    move_aside_option,
    out_option,
    quiet_option,
    repo_option,
    show_progress,
    trusted_key_option,
    workers_option,
)
from deltasync.errors import UsageError


@cli.command()
@dir_argument
@repo_option
@out_option("Directory to keep at the version to serve (or DIR).")
@click.option("--state", "state_dir", type=click.Path(path_type=Path, file_okay=False), default=None, metavar="DIR",
              help="Engine-first: keep only the --engine at the version to serve, no directory copy; its state "
                   "(version, digest, figures) and the kept packs of its chain live in DIR/.deltasync "
                   "(`deltasync status --state DIR`). For torch:, fanout and vllm@URL engines (the vLLM workers pull "
                   "what changes from --repo; start the server from `deltasync pull --snapshot`).")
@click.option("--tensors", "patterns", multiple=True, metavar="PATTERN",
              help="torch engines: hold only the tensors whose names match PATTERN (fnmatch, e.g. 'layers.1?.*'; "
                   "repeatable); only their chunks are fetched and decoded. A FACTORY may also return "
                   "deltasync.Slice values (a shard of a tensor): only the chunks covering it are fetched.")
@click.option("--follow", is_flag=True, help="Keep running: bring the directory to every new target (SIGTERM stops).")
@click.option("--poll-interval", type=click.FloatRange(0.01, 3600), default=0.5, show_default=True, metavar="SECONDS",
              help="How often the repository's latest and pin refs are read.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port).")
@click.option("--metrics-host", default="", metavar="HOST", help="Address for --metrics-port [default: every interface].")
@click.option("--keep-versions", type=click.IntRange(min=0), default=8, show_default=True, metavar="K",
              help="Keep the delta payloads of the last K versions in DIR/.deltasync: rollbacks among them download nothing.")
@click.option("--retries", type=click.IntRange(min=1), default=5, show_default=True,
              help="Attempts per update (with backoff) before a run without --follow gives up.")
@click.option("--engine", "engine_spec", default=None, metavar="SPEC",
              help="Also swap each version into an engine: torch:MODULE:FACTORY (MODULE is imported from the "
                   "current directory or the Python path; FACTORY() takes no arguments and returns the torch.nn.Module "
                   "(or a dict of name -> tensor) to keep at each version, built on the device it serves from; its "
                   "tensors are overwritten in place), fanout[:MODULE:FACTORY] (the same, for rank 0 of a "
                   "torch.distributed group), vllm@URL (a vLLM with the deltasync backend: loads only what "
                   "changed), or http:sglang|vllm|generic@URL (the server reloads from the copy).")
@click.option("--worker-repo", default=None, metavar="URL",
              help="vllm@URL: the repository URL the vLLM workers pull from, as the server's host reaches it "
                   "(a relay near the server, say) [default: --repo].")
@click.option("--pause-mode", type=click.Choice(["keep", "wait", "abort"]), default="keep", show_default=True,
              help="vllm@URL: what the server does with requests in flight during a swap (keep: frozen, then resumed).")
@move_aside_option
@fsync_option
@trusted_key_option
@click.option("--ref-grace", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="SECONDS",
              help="With --trusted-key: keep following a signed ref this long past its expiry, with a warning "
                   "(a quiet publisher late with `deltasync refresh-refs`); beyond it the ref is refused.")
@workers_option
@quiet_option
def subscribe(
    directory: Path | None, repo: str, out: Path | None, follow: bool, poll_interval: float, metrics_port: int | None,
    metrics_host: str,
    keep_versions: int, retries: int, engine_spec: str | None, pause_mode: str, move_aside: bool, fsync: bool,
    trusted_keys: tuple[Path, ...], ref_grace: float, workers: int, quiet: bool, state_dir: Path | None,
    worker_repo: str | None,
    patterns: tuple[str, ...],
) -> None:
    """Bring a directory (and/or an engine) to the version to serve (the pinned one, else the latest); with
    --follow, keep it there.

    Resumes where a killed run stopped. State, figures and kept payloads live in DIR/.deltasync
    (see `deltasync status DIR`). SIGTERM or SIGINT stops after the current chunk, exit status 0.
    With --engine, a version that did not reach the engine is an error (retried; exit status 1
    once the retries of a run without --follow are spent). With --state DIR instead of a
    directory, the engine alone is kept (engine-first: nothing of the model is written to disk).
    """
    import signal

    from deltasync.local.agent import Agent, AgentConfig, Update

    if state_dir is not None:
        if directory is not None or out is not None:
            raise UsageError("give a directory to keep (DIR or --out DIR) or --state DIR for an engine alone, not both")
        if engine_spec is None:
            raise UsageError("--state DIR keeps an engine's state: give --engine too (or DIR to keep a directory copy)")
        if engine_spec.startswith("http"):
            raise UsageError(f"the engine {engine_spec} loads versions from files: keep a directory copy for it "
                             "(--out DIR) instead of --state")
    else:
        out = local_dir(directory, out, "subscribe")
    if patterns and not (engine_spec or "").startswith("torch"):
        raise UsageError("--tensors applies to torch:MODULE:FACTORY engines")
    retry_log = RetryLog(retries, follow)
    config = AgentConfig(
        poll_interval=poll_interval, metrics_port=metrics_port, metrics_host=metrics_host,
        keep_versions=keep_versions, retries=retries, workers=workers, progress=show_progress(quiet),
        move_aside=move_aside, fsync=fsync, ref_grace=ref_grace,
    )

    engine = None
    if engine_spec is not None:
        from deltasync.engines import build_engine

        options: dict[str, object] = {"repo": repo}
        if engine_spec.startswith(("http", "vllm@")):
            if out is not None:  # engine-first (--state): vLLM's workers pull from the repository
                options["model_dir"] = str(out)  # the server loads (from) the copy the agent serves
            if engine_spec.startswith("vllm@"):
                options["pause_mode"] = pause_mode
                if worker_repo is not None:
                    options["repo_url"] = worker_repo
        else:
            if out is not None:
                options["copy"] = str(out)  # a copy already at the version (a restart) is read, not fetched
            # MODULE from the current directory, as `python -m deltasync` finds it (the console
            # script's sys.path starts with its own bin directory instead).
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
        if trusted_keys:
            options["trusted_keys"] = trusted_keys
        if patterns:
            engine_spec, options["model"] = "torch", _held_tensors(engine_spec, patterns)
        engine = build_engine(engine_spec, **options)

    def report(u: Update) -> None:
        retry_log.failures = 0
        if state_dir is None:
            click.echo(f"version {u.version} ({u.how}, {mib(u.fetched_bytes)} fetched, {u.seconds:.2f}s)")
        swap = u.swap
        if swap is not None:
            # In-process engines at the copy's version are swapped from the fetched change
            # before the copy is rewritten; others after it, reading it (Agent(engine=...)).
            fetched = u.fetched_bytes if state_dir is not None else swap.fetched_bytes
            click.echo(f"engine serves version {swap.version} (pause {swap.pause_s * 1e3:.1f} ms, "
                       f"{swap.chunks_changed} chunks changed, {mib(fetched)} fetched, {u.seconds:.2f}s)")
        sys.stdout.flush()

    def ready(a: Agent) -> None:
        if a.metrics_port is not None:
            click.echo(f"metrics on http://{metrics_host or '0.0.0.0'}:{a.metrics_port}/metrics")
        if follow:
            click.echo(f"following {repo} into {out if state_dir is None else f'the engine (state in {state_dir})'}; "
                       "SIGTERM stops")
        sys.stdout.flush()

    agent: Agent
    if state_dir is not None:
        from deltasync.local.engine_agent import EngineAgent

        assert engine is not None
        agent = EngineAgent(engine, state_dir, config, repo=repo, trusted_keys=trusted_keys or None,
                            on_update=report, on_ready=ready)
    else:
        assert out is not None
        agent = Agent(repo, out, config, trusted_keys=trusted_keys, on_update=report, on_ready=ready, engine=engine)

    def on_signal(signum: int, frame: object) -> None:
        agent.stop()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C kills at once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    before = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with retry_log.installed():
            version = agent.run(follow=follow)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    what = out if state_dir is None else "the engine"
    if agent.stopping:
        if version is None:
            click.echo("stopped before any version was held; the next run resumes any update in progress")
        else:
            click.echo(f"stopped at version {version} ({what}); the next run resumes any update in progress")
    else:
        click.echo(f"{what} is at version {version}")


def _held_tensors(spec: str, patterns: tuple[str, ...]) -> dict[str, object]:
    """The tensors of a torch:MODULE:FACTORY model whose names match one of ``patterns``."""
    import fnmatch

    from deltasync.engines import _call_factory
    from deltasync.engines.torch_engine import held_tensors

    kind, _, ref = spec.partition(":")
    if kind != "torch" or not ref:
        raise UsageError("--tensors needs --engine torch:MODULE:FACTORY")
    model = _call_factory(ref)
    values = dict(model) if isinstance(model, dict) else held_tensors(model)
    held = {n: t for n, t in values.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    if not held:
        raise UsageError(f"no tensor of the model matches {' or '.join(patterns)}")
    return held


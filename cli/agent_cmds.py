"""The agent: subscribe keeps a directory copy (and an engine) at the version to serve."""

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
from deltasync.errors import DeltasyncError


@cli.command()
@dir_argument
@repo_option
@out_option("Directory to keep at the version to serve (or DIR).")
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
    trusted_keys: tuple[Path, ...], ref_grace: float, workers: int, quiet: bool,
) -> None:
    """Bring a directory to the version to serve (the pinned one, else the latest); with --follow, keep it there.

    Resumes where a killed run stopped. State, figures and kept payloads live in DIR/.deltasync
    (see `deltasync status DIR`). SIGTERM or SIGINT stops after the current chunk, exit status 0.
    """
    import signal

    from deltasync.local.agent import Agent, AgentConfig, Update

    out = local_dir(directory, out, "subscribe")
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
            options["model_dir"] = str(out)  # the server loads (from) the copy the agent serves
            if engine_spec.startswith("vllm@"):
                options["pause_mode"] = pause_mode
        else:
            options["copy"] = str(out)  # changed chunks come from the agent's copy: one fetch, one decode
            # MODULE from the current directory, as `python -m deltasync` finds it (the console
            # script's sys.path starts with its own bin directory instead).
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
        if trusted_keys:
            options["trusted_keys"] = trusted_keys
        engine = build_engine(engine_spec, **options)

    def report(u: Update) -> None:
        retry_log.failures = 0
        click.echo(f"version {u.version} ({u.how}, {mib(u.fetched_bytes)} fetched, {u.seconds:.2f}s)")
        if engine is not None:
            to_engine(u.version)
        sys.stdout.flush()

    def to_engine(version: int | None) -> None:
        # The engine stages (the changed chunks, read from the copy and verified) before its
        # pause; a failed swap leaves it serving its previous version, and the next update
        # tries again.
        assert engine is not None
        try:
            swap = engine.update(version)
        except DeltasyncError as e:
            click.echo(f"deltasync: error: engine update to version {version}: {e}", err=True)
            return
        if swap is not None:
            click.echo(f"engine serves version {swap.version} (pause {swap.pause_s * 1e3:.1f} ms, "
                       f"{swap.chunks_changed} chunks changed, {mib(swap.fetched_bytes)} fetched)")

    def ready(a: Agent) -> None:
        held = a.current()
        if engine is not None and held is not None:
            to_engine(held)  # the version the copy holds now; updates follow
        if a.metrics_port is not None:
            click.echo(f"metrics on http://{metrics_host or '0.0.0.0'}:{a.metrics_port}/metrics")
        if follow:
            click.echo(f"following {repo} into {out}; SIGTERM stops")
        sys.stdout.flush()

    agent = Agent(repo, out, config, trusted_keys=trusted_keys, on_update=report, on_ready=ready)

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
    if agent.stopping:
        if version is None:
            click.echo("stopped before any version was held; the next run resumes any update in progress")
        else:
            click.echo(f"stopped at version {version}; the next run resumes any update in progress")
    else:
        click.echo(f"{out} is at version {version}")


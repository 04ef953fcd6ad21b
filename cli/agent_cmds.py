"""The agent: subscribe keeps a directory copy and/or an engine at the version to serve."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import UsageError
from ._common import (
    RetryLog,
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
from .fleet_cmds import FleetHooks, HookOptions, report_options, start_hooks

#: The most nodes --packcast takes: node 0 keeps a record per node, so a WORLD mistyped by a few
#: digits would grow it until the kernel kills it. Larger fleets are several groups behind relays.
MAX_PACKCAST_WORLD = 4096


class FiniteSeconds(click.FloatRange):
    """A number of seconds in a range; ``nan`` (which compares false with both bounds, so
    click's range lets it through) and ``inf`` are refused like any other value out of it."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        import math

        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return number


@click.command()
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
@click.option("--shard", default=None, metavar="I/N",
              help="torch engines: hold only the I-th of N row slices (dimension 0) of each tensor, as "
                   "deltasync.Slice values: only the chunks covering it are fetched, decoded and written (with "
                   "--packcast, only those are received). Tensors with fewer than N rows (biases of small layers, "
                   "norms, scalars) are held whole by every shard. I counts from 0.")
@click.option("--packcast", "packcast", default=None, metavar="RANK/WORLD@HOST:PORT",
              help="With --state: this process is node RANK of WORLD nodes of a cluster. Node 0 follows --repo "
                   "(a relay) and listens on HOST:PORT; each new version's stored bytes are fetched by node 0 "
                   "once and broadcast to the others over a gloo group; every node stages what its engine "
                   "holds and records it in its own --state DIR. 'env' (or a part left out) takes torchrun's "
                   "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT+1.")
@click.option("--packcast-timeout", type=FiniteSeconds(0.1, 3600), default=30.0, show_default=True,
              metavar="SECONDS",
              help="--packcast: how long a node waits for another (ready, a piece, node 0 at start) before going "
                   "on without it (it then catches up from the relay).")
@click.option("--packcast-token-file", type=click.Path(path_type=Path), default=None, metavar="FILE",
              envvar="DELTASYNC_PACKCAST_TOKEN_FILE",
              help="--packcast: a file holding a secret shared by every node; every round and member record in "
                   "node 0's store carries its HMAC, and what does not is refused (docs/trust.md). Without it, "
                   "anyone who reaches HOST:PORT can move the followers. [env: DELTASYNC_PACKCAST_TOKEN_FILE]")
@click.option("--follow", is_flag=True, help="Keep running: bring the directory to every new target (SIGTERM stops).")
@click.option("--poll-interval", type=FiniteSeconds(0.01, 3600), default=0.5, show_default=True, metavar="SECONDS",
              help="How often the repository's latest and pin refs are read.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port).")
@click.option("--metrics-host", default="", metavar="HOST", help="Address for --metrics-port [default: every interface].")
@click.option("--keep-versions", type=click.IntRange(min=0), default=8, show_default=True, metavar="K",
              help="Keep the delta payloads of the last K versions in DIR/.deltasync: rollbacks among them reverse "
                   "them locally (download-free for versions published with --context-classes 0).")
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
@click.option("--ref-grace", type=FiniteSeconds(0, None), default=0.0, show_default=True, metavar="SECONDS",
              help="With --trusted-key: keep following a signed ref this long past its expiry, with a warning "
                   "(a quiet publisher late with `deltasync refresh-refs`); beyond it the ref is refused.")
@report_options
@workers_option
@quiet_option
def subscribe(
    directory: Path | None, repo: str, out: Path | None, follow: bool, poll_interval: float, metrics_port: int | None,
    metrics_host: str,
    keep_versions: int, retries: int, engine_spec: str | None, pause_mode: str, move_aside: bool, fsync: bool,
    trusted_keys: tuple[Path, ...], ref_grace: float, workers: int, quiet: bool, state_dir: Path | None,
    worker_repo: str | None,
    patterns: tuple[str, ...], shard: str | None, packcast: str | None, packcast_timeout: float,
    packcast_token_file: Path | None,
    node_name: str | None, cluster: str, report_to: str | None, report_token_file: Path | None, report_interval: float,
    verify_every: float | None,
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

    from ..agents import Agent, AgentConfig, BaseAgent, Update
    from ..engines.registry import find_engine

    found = find_engine(engine_spec) if engine_spec is not None else None  # None: build_engine says why
    kind = found[0] if found is not None else None
    from_factory = kind is not None and kind.holds_parts and bool(found and found[1])  # torch:MODULE:FACTORY
    if kind is not None and kind.in_process:
        # Before the factory is imported: a core-only install gets the extra to install, not a
        # traceback from inside the engine (or a factory's own `import torch`).
        from .._extras import require

        require("torch", f"--engine {engine_spec}")
    if packcast is not None and (state_dir is None or not from_factory):
        raise UsageError("--packcast keeps an engine on every node: give --state DIR and --engine torch:MODULE:FACTORY")
    if state_dir is not None:
        if directory is not None or out is not None:
            raise UsageError("give a directory to keep (DIR or --out DIR) or --state DIR for an engine alone, not both")
        if engine_spec is None:
            raise UsageError("--state DIR keeps an engine's state: give --engine too (or DIR to keep a directory copy)")
        if kind is not None and kind.loads_files:
            raise UsageError(f"the engine {engine_spec} loads versions from files: keep a directory copy for it "
                             "(--out DIR) instead of --state")
    else:
        out = local_dir(directory, out, "subscribe")
    if verify_every is not None and state_dir is None:
        raise UsageError("--verify-every checks an engine-first agent's live weights: give --state DIR and --engine")
    if patterns and (kind is None or not kind.holds_parts):
        raise UsageError("--tensors applies to torch:MODULE:FACTORY engines")
    shard_of = _parse_shard(shard) if shard is not None else None
    if shard_of is not None and not from_factory:
        raise UsageError("--shard applies to torch:MODULE:FACTORY engines")
    node = None
    if packcast is not None:
        from ..agents.packcast_spec import parse_packcast, read_token

        node = parse_packcast(packcast)
        if node[1] > MAX_PACKCAST_WORLD:
            raise UsageError(f"--packcast {packcast!r}: {node[1]} nodes is more than a group takes (at most "
                             f"{MAX_PACKCAST_WORLD}; a larger fleet is several groups, each behind a relay)")
        token = read_token(packcast_token_file) if packcast_token_file is not None else None
        # torch's c10d logs every failed attempt to reach a store with a C++ stack trace; packcast
        # says what failed itself (one line, or a warning per round). Set it to see them.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    retry_log = RetryLog(retries, follow)
    config = AgentConfig(
        poll_interval=poll_interval, metrics_port=metrics_port, metrics_host=metrics_host,
        keep_versions=keep_versions, retries=retries, workers=workers, progress=show_progress(quiet),
        move_aside=move_aside, fsync=fsync, ref_grace=ref_grace,
    )

    engine = None
    if engine_spec is not None:
        from ..engines import build_engine

        options: dict[str, object] = {"repo": repo}
        if kind is not None:
            if out is not None and kind.copy_option is not None:
                # the server loads (from) the copy the agent serves; an in-process engine reads a
                # copy already at the version (a restart) instead of fetching it
                options[kind.copy_option] = str(out)
            if "pause_mode" in kind.options:
                options["pause_mode"] = pause_mode
            if "repo_url" in kind.options and worker_repo is not None:
                options["repo_url"] = worker_repo
            # MODULE from the current directory, as `python -m deltasync` finds it (the console
            # script's sys.path starts with its own bin directory instead).
            if kind.in_process and os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
        if trusted_keys:
            options["trusted_keys"] = trusted_keys
        if kind is not None and (patterns or shard_of is not None):
            engine_spec, options["model"] = kind.name, _held_tensors(engine_spec, patterns, shard_of)
        engine = build_engine(engine_spec, **options)
        if isinstance(getattr(engine, "tensors", None), dict) and not engine.tensors:  # type: ignore[attr-defined]
            # Nothing to bring to a version: "at version N" would claim an engine that serves nothing.
            raise UsageError(f"--engine {engine_spec}: the model holds no tensors (does the factory return the "
                             "built model, with its parameters and buffers?)")

    hooks = FleetHooks()

    def report(u: Update) -> None:
        hooks.wake()
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

    def ready(a: BaseAgent) -> None:
        options = HookOptions(node=node_name, cluster=cluster, report_to=report_to, report_token_file=report_token_file,
                              report_interval=report_interval, verify_every=verify_every)
        started = start_hooks(a, state_dir or a.root, repo=repo, options=options)
        hooks.reporter, hooks.checker, hooks.control = started.reporter, started.checker, started.control
        if a.metrics_port is not None:
            click.echo(f"metrics on http://{metrics_host or '0.0.0.0'}:{a.metrics_port}/metrics")
        if follow:
            where = f" as packcast node {node[0]}/{node[1]} ({node[2]})" if node is not None else ""
            click.echo(f"following {repo} into {out if state_dir is None else f'the engine (state in {state_dir})'}"
                       f"{where}; SIGTERM stops")
        sys.stdout.flush()

    def round_done(r: RoundReport) -> None:
        members = f"{len(r.members)} nodes" if r.members else "left out: caught up from the relay"
        # Node 0 reads from the relay and sends; the others receive from it.
        moved = (f"{mib(r.upstream_bytes)} read from the relay and sent to the group" if node is not None and node[0] == 0
                 else f"{mib(r.received_bytes)} received from the group, {mib(r.upstream_bytes)} from the relay")
        click.echo(f"packcast round {r.round}, version {r.version} ({members}): {moved}"
                   + (f"; broadcast stopped: {r.broadcast_error}" if r.broadcast_error else ""))
        sys.stdout.flush()

    agent: BaseAgent
    if node is not None:
        from ..agents import PackcastAgent, PackcastOptions
        from ..engines.packcast import RoundReport

        assert engine is not None and state_dir is not None
        where = PackcastOptions(rank=node[0], world=node[1], master=node[2], timeout=packcast_timeout, token=token,
                                on_round=round_done)
        agent = PackcastAgent(engine, state_dir, config, packcast=where, trusted_keys=trusted_keys or None,
                              on_update=report, on_ready=ready)
    elif state_dir is not None:
        from ..agents import EngineAgent

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
        hooks.close()
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


def _held_tensors(spec: str, patterns: tuple[str, ...], shard: tuple[int, int] | None = None) -> dict[str, object]:
    """The tensors of a torch:MODULE:FACTORY model whose names match one of ``patterns`` (all
    without), each as its ``shard`` (I, N): the I-th of N row slices (see :func:`_row_slice`)."""
    import fnmatch

    from ..engines.registry import call_factory, find_engine
    from ..engines.torch_engine import held_tensors

    found = find_engine(spec)
    if found is None or not found[0].holds_parts or not found[1]:
        raise UsageError("--tensors and --shard need --engine torch:MODULE:FACTORY")
    model = call_factory(found[1])
    values = dict(model) if isinstance(model, dict) else held_tensors(model)
    held = {n: t for n, t in values.items() if not patterns or any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    if not held:
        raise UsageError(f"no tensor of the model matches {' or '.join(patterns)}")
    if shard is not None:
        held = {n: _row_slice(n, t, *shard) for n, t in held.items()}
    return held


def _parse_shard(text: str) -> tuple[int, int]:
    i, slash, n = text.partition("/")
    if not slash or not i.strip().isdigit() or not n.strip().isdigit() or int(n) < 1 or int(i) >= int(n):
        raise UsageError(f"--shard must be I/N with 0 <= I < N (e.g. 1/4: the second of four row slices), got {text!r}")
    return int(i), int(n)


def _row_slice(name: str, t: object, i: int, n: int) -> object:
    """Rows ``[i*R//n, (i+1)*R//n)`` of ``t`` (R rows) as a Slice viewing its memory (written in
    place); a tensor with fewer than ``n`` rows (or none) is held whole."""
    import torch

    from ..format.slices import Slice

    if not isinstance(t, torch.Tensor):
        raise UsageError(f"--shard: {name!r} is already a slice (the FACTORY returns deltasync.Slice values); "
                         "give one or the other")
    rows = t.shape[0] if t.dim() else 0
    if rows < n:
        return t
    start, stop = i * rows // n, (i + 1) * rows // n
    return Slice(t.detach()[start:stop], (start, *(0,) * (t.dim() - 1)), tuple(t.shape))


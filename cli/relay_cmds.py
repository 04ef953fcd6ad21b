"""The relay: serve a repository to subscribers as a caching gRPC relay."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from ..errors import UsageError
from ._common import (
    REPO_FORMS,
    WARNINGS,
    repo_url,
)


@click.command()
@click.option("--repo", required=True, metavar="URL",
              callback=repo_url, help=f"Upstream repository: {REPO_FORMS}; a relay's upstream may be another relay.")
@click.option("--listen", required=True, metavar="HOST:PORT", help="Address to serve on (port 0: any free port).")
@click.option("--cache", "cache_dir", type=click.Path(path_type=Path), default=None,
              help="Cache directory (LMDB index + object files), kept across restarts [default: a temporary one].")
@click.option("--cache-max-bytes", default=None, metavar="SIZE",
              help="Evict least recently used objects beyond this size, e.g. 500G [default: half the free space of "
                   "the cache's disk at start, printed]. Whatever the limit, a full disk evicts, and an object that "
                   "cannot fit is passed through uncached.")
@click.option("--poll-interval", type=click.FloatRange(0.01, 60), default=0.5, show_default=True, metavar="SECONDS",
              help="How often the upstream is checked for a new version.")
@click.option("--warm/--no-warm", default=True, show_default=True,
              help="Fetch each new version (manifest, packs, blobs) into the cache as soon as the relay hears of it, "
                   "before agents ask (while anyone watches the relay).")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Serve an object to readers while it is still being fetched from the upstream "
                   "(--no-stream: only once it is whole in the cache).")
@click.option("--cluster-relays", default=None, metavar="HOST:PORT,HOST:PORT[,…]",
              help="The relays serving this cluster side by side, this one included, as its agents name them (the "
                   "same list on each): every object over 1 MiB is fetched in shares, each relay's own upstream link "
                   "carrying its pieces and the relays filling each other, so the cluster's ingress is the sum of "
                   "their links (see docs/cli.md, Across clusters) [default: this relay fetches everything itself].")
@click.option("--push-bytes", default="32M", show_default=True, metavar="SIZE",
              help="Over an upstream relay: ask it to push a new version's packs on its Watch stream right after "
                   "the version's event when they total at most this (a small delta then arrives one way after "
                   "the commit instead of a round trip later; every pack checked as always); 0: never. Relays in "
                   "--cluster-relays ask for none (each fetches its share).")
@click.option("--advertise", default=None, metavar="HOST:PORT",
              help="This relay's entry in --cluster-relays [default: the --listen address].")
@click.option("--tls-cert", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Serve TLS with this PEM certificate (clients use grpcs://).")
@click.option("--tls-key", type=click.Path(path_type=Path, dir_okay=False), default=None, help="PEM key of --tls-cert.")
@click.option("--token-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Require this bearer token from every client [default: $DELTASYNC_RELAY_TOKEN(_FILE) if set].")
@click.option("--accept-writes", is_flag=True, default=False,
              help="Let publishers holding the write token write the repository through this relay (Put, Delete).")
@click.option("--write-token-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The write token (distinct from the read token; it also reads) "
                   "[default: $DELTASYNC_RELAY_WRITE_TOKEN(_FILE) with --accept-writes].")
@click.option("--max-object-bytes", default="256M", show_default=True, metavar="SIZE",
              help="Largest object a publisher may upload.")
@click.option("--upload-window", default="32M", show_default=True, metavar="SIZE",
              help="Bytes one upload may have in flight (granted ahead of what reached disk): about this per round "
                   "trip per upload (32M: some 160 MiB/s at 200 ms; see docs/cli.md, Across clusters).")
@click.option("--upload-buffer", default="256M", show_default=True, metavar="SIZE",
              help="Memory for uploads, all publishers together (the credit granted to uploads in flight; small "
                   "uploads held whole); uploads over 4 MiB are spooled to files in the cache directory as they "
                   "arrive.")
@click.option("--max-uploads", type=click.IntRange(1, 1024), default=8, show_default=True,
              help="Uploads received at once (each held in memory or spooled until written); more wait.")
@click.option("--write-quota", default=None, metavar="SIZE",
              help="Most bytes the upstream repository may hold (counted at start, then through this relay's writes); "
                   "uploads past it are refused [default: none].")
@click.option("--report-token-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Take fleet reports from agents and relays below carrying one of the tokens in this file (one "
                   "per line: TOKEN for any cluster, or CLUSTER TOKEN for that cluster's nodes only) [default: "
                   "take no reports].")
@click.option("--cluster", default="", metavar="NAME",
              help="The cluster of nodes reporting here without naming one [default: the --listen address].")
@click.option("--upstream-report-token-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="The report token of the upstream relay, to forward the fleet table to it [default: the first "
                   "any-cluster token of --report-token-file].")
@click.option("--report-interval", type=click.FloatRange(0.1, 600), default=2.0, show_default=True,
              metavar="SECONDS", help="Seconds between forwards of the fleet table to an upstream relay.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
              help="Serve Prometheus metrics (the fleet's nodes by state, lag per cluster) at "
                   "http://HOST:PORT/metrics (0: any free port).")
@click.option("--metrics-host", default="", metavar="HOST", help="Address for --metrics-port [default: every interface].")
@click.option("--http", "http_listen", default=None, metavar="HOST:PORT",
              help="Serve the fleet page at http://HOST:PORT/fleet (each cluster's nodes, versions and states; lag "
                   "over the last hour; read-only, no external assets) [default: none].")
def serve(
    repo: str, listen: str, cache_dir: Path | None, cache_max_bytes: str | None, poll_interval: float,
    warm: bool, stream: bool, cluster_relays: str | None, push_bytes: str, advertise: str | None,
    tls_cert: Path | None, tls_key: Path | None, token_file: Path | None, accept_writes: bool,
    write_token_file: Path | None, upload_window: str, upload_buffer: str, max_object_bytes: str, max_uploads: int,
    write_quota: str | None,
    report_token_file: Path | None, cluster: str, upstream_report_token_file: Path | None, report_interval: float,
    metrics_port: int | None, metrics_host: str, http_listen: str | None,
) -> None:
    """Serve a repository to subscribers as a caching gRPC relay (grpc://HOST:PORT; relays chain)."""
    import logging

    from ..progress import human_bytes
    from ..relay import build_server, parse_size, run_until_signalled
    from ..relay.fleet import read_report_tokens
    from ..storage.wire import read_token, read_write_token

    logging.getLogger("deltasync").removeHandler(WARNINGS)  # the relay logs every line its own way
    logging.basicConfig(level=logging.INFO, format="deltasync relay: %(message)s")
    limit = parse_size(cache_max_bytes) if cache_max_bytes is not None else None
    if write_token_file is not None and not accept_writes:
        raise UsageError("--write-token-file needs --accept-writes (a read-only relay takes no write token)")

    server = build_server(
        repo, listen, cache_dir, cache_max_bytes=limit, poll_interval=poll_interval, warm=warm, stream=stream,
        cluster_relays=cluster_relays.split(",") if cluster_relays else None, advertise=advertise,
        push_bytes=parse_size(push_bytes),
        tls_cert=tls_cert, tls_key=tls_key, token=read_token(None, token_file),
        accept_writes=accept_writes,
        write_token=read_write_token(None, write_token_file) if accept_writes else None,
        max_object_bytes=parse_size(max_object_bytes), max_uploads=max_uploads, upload_buffer=parse_size(upload_buffer),
        upload_window=parse_size(upload_window),
        write_quota=parse_size(write_quota) if write_quota is not None else None,
        report_tokens=read_report_tokens(report_token_file) if report_token_file is not None else None,
        cluster=cluster, report_interval=report_interval,
        upstream_report_token=read_token(None, upstream_report_token_file) if upstream_report_token_file else None,
    )
    metrics = None
    page = None

    def ready() -> None:
        nonlocal metrics, page
        writes = ", accepting writes" if accept_writes else ""
        reports = ", taking fleet reports" if report_token_file is not None else ""
        cache = server.cache
        size = "" if cache is None or cache.max_bytes is None else f" up to {human_bytes(cache.max_bytes)}" + (
            f" ({cache.limit_note})" if cache.limit_note else "")
        click.echo(f"serving {server.upstream_url} on {server.address} (cache {server.cache_dir}{size}{writes}"
                   f"{reports}); SIGTERM stops")
        if metrics_port is not None:
            from ..metrics import MetricsServer

            metrics = MetricsServer(server.fleet.metrics, port=metrics_port, host=metrics_host)
            click.echo(f"metrics on http://{metrics_host or '0.0.0.0'}:{metrics.port}/metrics")
        if http_listen is not None:
            from ..relay.page import FleetPage

            page = FleetPage(server.fleet, http_listen, token=server.config.token)
            click.echo(f"fleet page on {page.url}")
        sys.stdout.flush()

    try:
        run_until_signalled(server, on_ready=ready)
    finally:
        if metrics is not None:
            metrics.close()
        if page is not None:
            page.close()
    click.echo("relay stopped")


"""What the commands share: the click group ``cli``, the options several commands take, and
the helpers that print results, name local directories and turn library warnings into lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from click.decorators import FC

from ..errors import UsageError


def cache_base() -> Path:
    """Where deltasync keeps its local caches: $DELTASYNC_CACHE, else ~/.cache/deltasync."""
    return Path(os.environ.get("DELTASYNC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "deltasync"
    ))


def emit_json(obj: object) -> None:
    click.echo(json.dumps(obj, sort_keys=True, default=json_default))


def json_default(o: object) -> object:
    """JSON for what results hold besides plain values: dataclasses, sets, paths."""
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)  # Path and anything else: its text


def local_dir(positional: Path | None, out: Path | None, command: str) -> Path:
    """The local directory, given as the DIR argument or as --out DIR (either, for every command)."""
    if positional is not None and out is not None and os.path.abspath(positional) != os.path.abspath(out):
        raise UsageError(f"two directories given ({positional} and --out {out}); give DIR or --out DIR")
    directory = positional if positional is not None else out
    if directory is None:
        raise UsageError(f"give the local directory: deltasync {command} DIR (or --out DIR)")
    if directory.exists() and not directory.is_dir():
        # A file of a copy (DIR/config.json), not the copy: a version is a whole directory.
        raise UsageError(f"{directory} is a file, not a directory: give the directory that holds the copy "
                         f"(deltasync {command} DIR)")
    return directory


def ca_hint(message: str) -> str:
    """A TLS failure against a relay: say how to trust its certificate."""
    if "CERTIFICATE_VERIFY_FAILED" not in message and "certificate verify failed" not in message.lower():
        return message
    ca = os.environ.get("DELTASYNC_RELAY_CA")
    if ca:
        return f"{message} [the relay's certificate is not signed by $DELTASYNC_RELAY_CA={ca}]"
    return (f"{message} [the relay's certificate is self-signed or from a private CA: "
            "set DELTASYNC_RELAY_CA=/path/to/relay-ca.pem (for a self-signed relay, its --tls-cert file)]")


def show_progress(quiet: bool) -> bool | None:
    return False if quiet else None  # None: only on a terminal


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="deltasync")
def cli() -> None:
    """deltasync: lossless, compressed weight deltas from an RL trainer to inference fleets."""


def repo_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and value.lower().startswith("memory://"):
        raise click.BadParameter(
            "memory:// repositories live inside one process and vanish when the command exits; "
            "use a path, file:///abs/path, s3://bucket/prefix or grpc://host:port"
        )
    return value


#: Every form --repo takes (memory:// is the library's only: it vanishes with the process).
REPO_FORMS = ("a path (./repo), file:///abs/path, s3://bucket/prefix, grpc://host:port[,host2:port2] "
              "or grpcs://host:port[,...] (relays, TLS with $DELTASYNC_RELAY_CA; writable with "
              "$DELTASYNC_RELAY_WRITE_TOKEN(_FILE) when they serve --accept-writes)")


repo_option = click.option(
    "--repo", required=True, metavar="URL", callback=repo_url, help=f"Repository: {REPO_FORMS}.",
)


move_aside_option = click.option(
    "--move-aside", is_flag=True,
    help="Move files in the directory that are not the repository's (weights, configs a loader would read) into "
         "DIR/.deltasync/aside/ [default: refuse, naming them].",
)


fsync_option = click.option(
    "--fsync", is_flag=True,
    help="Flush each version to disk before serving it [default: no flush; after a power loss the copy is checked "
         "and repaired before its next update].",
)


quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress output.")


workers_option = click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
                              help="Threads for encoding/decoding (0: one per core).")


dir_argument = click.argument("directory", required=False, type=click.Path(path_type=Path), metavar="[DIR]")


def out_option(help_text: str) -> Callable[[FC], FC]:
    return click.option("--out", type=click.Path(path_type=Path), default=None, metavar="DIR", help=help_text)


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts) instead of text.")


trusted_key_option = click.option(
    "--trusted-key", "trusted_keys", multiple=True, type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
    help="Refuse versions not signed by this ed25519 public key (PEM, see keygen; repeatable for key rotation).",
)


def json_fields(obj: object) -> dict[str, Any]:
    """A result dataclass as a dict of JSON values."""
    out: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(obj), default=json_default))  # type: ignore[call-overload]
    return out


def ratio(raw: int, stored: int) -> str:
    """raw / stored as publish, log and inspect all print it."""
    return f"{raw / stored:.1f}x" if stored else "inf"


class WarningLines(logging.Handler):
    """Warnings of the library's loggers as one `deltasync: warning: ...` line each on stderr."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"deltasync: warning: {record.getMessage()}", err=True)


WARNINGS = WarningLines()


class RetryLog(logging.Handler):
    """The agent's "update failed" warnings, one line each on stderr.

    A failure the agent retries is a warning naming the attempt; the failure that ends the
    command is not printed here: the command's own error line says it, once.
    """

    def __init__(self, retries: int | None, follow: bool) -> None:
        super().__init__(logging.WARNING)
        self.retries, self.follow, self.failures = retries, follow, 0

    def emit(self, record: logging.LogRecord) -> None:
        from ..agents.config import FINAL

        message = record.getMessage()
        if not message.startswith("update failed: "):
            click.echo(f"deltasync: warning: {message}", err=True)
            return
        self.failures += 1
        error = sys.exc_info()[1]
        if not self.follow and (self.retries is None or self.failures >= self.retries or isinstance(error, FINAL)):
            return  # it ends the command, whose error line says it
        attempt = "retrying" if self.follow else f"attempt {self.failures} of {self.retries}; retrying"
        click.echo(f"deltasync: warning: update failed ({attempt}): {ca_hint(message.removeprefix('update failed: '))}",
                   err=True)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        logger = logging.getLogger("deltasync.agents")
        before = logger.propagate
        logger.addHandler(self)
        logger.propagate = False
        try:
            yield
        finally:
            logger.removeHandler(self)
            logger.propagate = before


def mib(n: int) -> str:
    from ..progress import human_bytes

    return human_bytes(n)


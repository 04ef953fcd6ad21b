"""The ``deltasync`` command line: thin click commands over the library.

Heavy imports (numpy, torch, zstd) happen inside commands so ``--help`` is instant. Every
DeltasyncError becomes one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import logging
import os
import sys

import click

# Each command module registers its commands on the group ``cli`` when imported.
from deltasync.cli import agent_cmds, copy_cmds, fleet_cmds, publish_cmds, relay_cmds, repo_cmds, rl_cmds  # noqa: F401
from deltasync.cli._common import WARNINGS, ca_hint, cli
from deltasync.errors import DeltasyncError


def main(argv: list[str] | None = None) -> None:
    # gRPC's C core logs to stderr on its own (TLS handshake failures, connection resets):
    # the command's one-line errors say what matters. GRPC_VERBOSITY=INFO brings them back.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    logging.getLogger("deltasync").addHandler(WARNINGS)
    try:
        rc = cli.main(args=argv, prog_name="deltasync", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("deltasync: aborted", err=True)
        sys.exit(130)
    except click.UsageError as e:
        # One line, like every other error; the command's --help is named for the details.
        where = f" (see deltasync {e.ctx.command_path.split(' ', 1)[1]} --help)" if e.ctx and " " in e.ctx.command_path else ""
        click.echo(f"deltasync: error: {e.format_message()}{where}", err=True)
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except DeltasyncError as e:
        click.echo(f"deltasync: error: {ca_hint(str(e))}", err=True)
        sys.exit(e.exit_code)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        click.echo(f"deltasync: error: {e.strerror or e}{where}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("deltasync: interrupted", err=True)
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()

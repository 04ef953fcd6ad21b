"""The ``deltasync`` command line: thin click commands over the library.

Heavy imports (numpy, torch, zstd) happen inside commands so ``--help`` is instant. Every
DeltasyncError becomes one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from ..errors import DeltasyncError
from . import agent_cmds, copy_cmds, fleet_cmds, publish_cmds, relay_cmds, repo_cmds, rl_cmds
from ._common import WARNINGS, ca_hint, cli

#: every command of ``deltasync``, by group module (a command module only defines its commands)
COMMANDS: tuple[click.Command, ...] = (
    agent_cmds.subscribe,
    copy_cmds.pull, copy_cmds.status, copy_cmds.check, copy_cmds.rollback,
    fleet_cmds.fleet,
    publish_cmds.publish, publish_cmds.squash, publish_cmds.keygen, publish_cmds.pin, publish_cmds.refresh_refs,
    publish_cmds.cache,
    relay_cmds.serve,
    repo_cmds.log, repo_cmds.verify, repo_cmds.inspect, repo_cmds.gc,
    rl_cmds.demo, rl_cmds.rl,
)
for _command in COMMANDS:
    cli.add_command(_command)


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

"""The command line's packcast options: ``--packcast RANK/WORLD@HOST:PORT`` (or torchrun's
variables) and ``--packcast-token-file``."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import UsageError


def parse_packcast(spec: str, environ: Mapping[str, str] | None = None) -> tuple[int, int, str]:
    """``RANK/WORLD@HOST:PORT`` as ``(rank, world, "host:port")``. ``env`` (or a part left
    out: ``RANK/WORLD``, ``@HOST:PORT``) takes torchrun's variables: RANK, WORLD_SIZE,
    MASTER_ADDR, and MASTER_PORT + 1 (torchrun's own store listens on MASTER_PORT)."""
    env = os.environ if environ is None else environ
    text = "" if spec == "env" else spec
    ranks, at, where = text.partition("@")

    def from_env(name: str, what: str) -> str:
        value = env.get(name)
        if not value:
            raise UsageError(f"--packcast {spec!r} leaves the {what} out and {name} is not set: give "
                             "RANK/WORLD@HOST:PORT (e.g. 3/32@node0:29600)")
        return value

    if ranks:
        r, slash, w = ranks.partition("/")
        if not slash or not r.strip().isdigit() or not w.strip().isdigit():
            raise UsageError(f"--packcast must be RANK/WORLD@HOST:PORT (e.g. 3/32@node0:29600), got {spec!r}")
        rank, world = int(r), int(w)
    else:
        r, w = from_env("RANK", "rank"), from_env("WORLD_SIZE", "world size")
        if not r.isdigit() or not w.isdigit():
            raise UsageError(f"RANK and WORLD_SIZE must be integers, got {r!r} and {w!r}")
        rank, world = int(r), int(w)
    if where:
        host, colon, port = where.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--packcast must be RANK/WORLD@HOST:PORT with a port in 1..65535, got {spec!r}")
    elif at:
        raise UsageError(f"--packcast {spec!r}: HOST:PORT after @ is missing")
    else:
        host = from_env("MASTER_ADDR", "host")
        master_port = from_env("MASTER_PORT", "port")
        if not master_port.isdigit() or not 0 < int(master_port) < 65535:
            raise UsageError(f"MASTER_PORT must be a port number, got {master_port!r}")
        port = str(int(master_port) + 1)
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"--packcast {spec!r}: rank {rank} is not in 0..{world - 1} (RANK/WORLD: this node's rank "
                         "and the number of nodes)")
    return rank, world, f"{host}:{port}"


def read_token(path: str | os.PathLike[str]) -> bytes:
    """The shared secret in ``path`` (surrounding whitespace dropped); UsageError when it
    cannot be read or is empty."""
    try:
        with open(path, "rb") as f:
            token = f.read(1 << 16).strip()
    except OSError as e:
        raise UsageError(f"--packcast-token-file {os.fspath(path)}: {e.strerror or e}") from None
    if not token:
        raise UsageError(f"--packcast-token-file {os.fspath(path)} is empty: put a shared secret in it "
                         "(e.g. `openssl rand -hex 32`)")
    return token


__all__ = ["parse_packcast", "read_token"]

"""The relay (``deltasync serve``): a gRPC server that caches a repository inside one cluster
and re-serves it. :mod:`~deltasync.relay.server` is the service, :mod:`~deltasync.relay.cache`
its LRU object cache, :mod:`~deltasync.relay.wire` the wire definition it shares with its
clients (the ``grpc://`` store in :mod:`deltasync.storage`). The server's names are imported
on first use, so the wire definition does not pull in grpcio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["RelayConfig", "RelayServer", "build_server", "parse_size", "run_until_signalled"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .._extras import import_needing_extras

    return getattr(import_needing_extras("deltasync.relay.server", "the relay"), name)


if TYPE_CHECKING:
    from .server import RelayConfig, RelayServer, build_server, parse_size, run_until_signalled

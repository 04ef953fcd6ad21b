"""The relay (``deltasync serve``): a gRPC server that caches a repository inside one cluster
and re-serves it. :mod:`~deltasync.relay.server` is the service, :mod:`~deltasync.relay.cache`
its LRU object cache; the client side is the ``grpc://`` store (:mod:`deltasync.storage`)."""

from __future__ import annotations

from .._extras import require

require("grpc", "the relay")  # before the server's own imports, to name the extra if it is missing

from .server import RelayConfig, RelayServer, build_server, parse_size, run_until_signalled  # noqa: E402

__all__ = ["RelayConfig", "RelayServer", "build_server", "parse_size", "run_until_signalled"]

"""The relay (``deltasync serve``): a gRPC server that caches a repository inside one cluster
and re-serves it. :mod:`~deltasync.relay.server` is the service, :mod:`~deltasync.relay.cache`
its LRU object cache; the client side is the ``grpc://`` store (:mod:`deltasync.storage`)."""

from __future__ import annotations

from .server import RelayConfig, RelayServer, build_server, parse_size, run_until_signalled

__all__ = ["RelayConfig", "RelayServer", "build_server", "parse_size", "run_until_signalled"]

"""The relay (``deltasync serve``): a gRPC server that caches a repository inside one cluster
and re-serves it. :mod:`~deltasync.relay.server` is the service, :mod:`~deltasync.relay.cache`
its LRU object cache, and the wire definition it shares with its clients is the ``grpc://`` store's
(``deltasync/storage/_wire.py``). The server's names are imported on first use: importing
this package does not pull in grpcio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

#: public name -> module (the server's names pull in grpcio: imported on first use)
_LAZY: _lazy.Table = dict.fromkeys(("RelayConfig", "RelayServer", "build_server", "parse_size", "run_until_signalled"), "server")
__all__ = sorted(_LAZY)
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals(), lambda name: "the relay")

if TYPE_CHECKING:
    from .server import (
        RelayConfig as RelayConfig,
        RelayServer as RelayServer,
        build_server as build_server,
        parse_size as parse_size,
        run_until_signalled as run_until_signalled,
    )

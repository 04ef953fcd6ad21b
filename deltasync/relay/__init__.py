"""The relay (``deltasync serve``): a caching gRPC server in front of a repository.

Subscribers in one cluster read the repository through the relay (``grpc://host:port``)
instead of from its origin, so every byte crosses the WAN once per cluster:

- **Get** streams an object (or a byte range of it) in 1 MiB chunks under gRPC flow control.
  Immutable objects (packs, blobs, manifests, squashes) are fetched from the upstream once, whole, into
  the cache (:mod:`deltasync.relay.cache`), however many subscribers ask at the same moment
  (single flight per key), and every range of them is then served from the file. While the
  fetch runs, readers are served from its temporary file as the pieces land (a range once it
  is covered; the last piece of an object only once the whole passed its checks), so a pack
  behind a slow link reaches agents, and relays below, piece by piece rather than after the
  whole pack; a fetch that fails ends its readers' streams with DATA_LOSS (corrupt, wrong
  size) or UNAVAILABLE (upstream unreachable), never a short stream, and leaves no entry.
  ``refs/latest``, listings and other keys always go to the upstream.
- **Watch** pushes newly committed versions. One feed per relay follows the upstream, shared
  by all watchers: it polls ``refs/latest`` every ``poll_interval`` (listing ``manifests/``
  when the ref moves, and every ``rescan_interval`` in case a publisher died between manifest
  and ref), or, when the upstream is itself a relay, follows that relay's Watch stream.
  Idle streams get a keepalive event; watchers are ended with UNAVAILABLE when the upstream
  stays unreachable, so they move on to another relay. With ``warm`` (the default) each new
  version the feed learns of is fetched into the cache at once, manifest then packs and
  blobs (``warm_concurrency`` objects at a time), so the WAN transfer overlaps the agents'
  reaction to the event rather than following their first request.
- The upstream is any repository URL: a path, ``s3://…``, or ``grpc://`` of another relay,
  so relays form trees across clusters.
- **UploadSession**/**Upload**/**Put**/**Delete** (only with ``accept_writes``, only from clients carrying the
  write token, only of the repository layout's names: ``repo.repository.is_layout_key``): a
  publisher in another cluster writes the repository through the relay. An upload
  streams in 1 MiB pieces, into memory up to :data:`~.uploads.SPOOL_BYTES` (4 MiB) and, when larger, into
  a file under the cache's ``tmp/`` as it arrives (mapped read-only for the checks and the
  upstream put, removed after): at most ``max_uploads`` at once. Its memory is one budget for
  all uploads (``upload_buffer``): an Upload sends only within the credit the relay grants it
  from that budget (at most ``upload_window`` ahead of its bytes on disk), and one waiting for
  its turn sends nothing past its header; an UploadSession carries objects one after another
  under credit that outlives each (the next one's first bytes leave with its header); an old
  Put is charged a window of the budget (:mod:`.uploads`). It is checked (its size, the digest its
  header announces, for ``packs/<xxh3>.pack`` and ``blobs/<xxh3>`` the digest in the
  key, a manifest or squash as every reader validates it) and only then written with the upstream store's own
  atomic put, so nothing partial or corrupt is ever visible; ``if_absent`` passes through, so
  the conditional manifest put keeps exactly one winner. A manifest or squash is refused while
  a pack or blob it names is missing upstream.

The relay's parts, one module each: :mod:`.config` (how it serves), :mod:`.server` (start,
stop, the event loop), :mod:`.service` (the RPCs), :mod:`.fetch` (single-flight fetches
into the cache, streamed as they land), :mod:`.feed` (the version feed and warming),
:mod:`.uploads` (Upload, Put and Delete: credit, spool, checks, quota), :mod:`.gauge` (the upstream's
measured round trip and rate), :mod:`.shares` (the relays of one cluster fetching each object in
shares over their own links, ``cluster_relays``), :mod:`.auth` (tokens and the keys a
client may name), :mod:`.cache` (the object cache).

The wire definition it shares with its clients is the ``grpc://`` store's
(:mod:`deltasync.storage.wire`). The server's names are imported on first use: importing this
package does not pull in grpcio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

#: public name -> module (the server's names pull in grpcio: imported on first use)
_LAZY: _lazy.Table = {
    **dict.fromkeys(("RelayConfig", "parse_size"), "config"),
    **dict.fromkeys(("RelayServer", "build_server", "run_until_signalled"), "server"),
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals(), lambda name: "the relay")

if TYPE_CHECKING:
    from .config import RelayConfig as RelayConfig, parse_size as parse_size
    from .server import RelayServer as RelayServer, build_server as build_server, run_until_signalled as run_until_signalled

"""How a relay serves: :class:`RelayConfig`, checked when built, and :func:`parse_size` for the
command line's sizes. Nothing here imports grpcio."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError


@dataclass(kw_only=True)
class RelayConfig:
    """How a relay serves. Built by :func:`build_server`."""

    listen: str
    """``HOST:PORT`` to serve on; port 0 picks a free port (see ``RelayServer.port``)."""
    cache_dir: Path | None = None
    """Cache directory, kept across restarts. None: a temporary one, removed at stop."""
    cache_max_bytes: int | None = None
    """Evict least recently used objects beyond this many bytes. None: half the free space of the
    cache's disk at start (relay/cache.py, ``DEFAULT_DISK_SHARE``). A full disk evicts whatever
    the limit; an object that cannot fit is passed through uncached."""
    poll_interval: float = 0.5
    """Seconds between checks of the upstream for a new version."""
    rescan_interval: float = 10.0
    """Seconds between full listings of the upstream's manifests (the ref is only a hint)."""
    keepalive_interval: float = 10.0
    """Seconds of silence after which a watcher gets a keepalive event."""
    upstream_grace: float = 10.0
    """Seconds the upstream may stay unreachable before watchers are sent elsewhere."""
    hint_ttl: float = 3.0
    """Seconds a relay following an upstream relay's Watch answers reads of the refs, the marker
    and the ``squashes/`` listing from the copies sent with the newest version's event (a
    hint readers check as any read: relay/feed.py) instead of asking across its link; 0: never.
    A ref moved upstream without a new version (a pin) is seen this much later at most (the
    marker and the listing, which change rarely, are served 10 times as long)."""
    fetch_piece_bytes: int = 8 << 20
    """Objects larger than this are fetched from the upstream in ranges of this size."""
    fetch_pieces_in_flight: int = 32
    """Most ranged reads requested from the upstream at once, all fetches together (the memory
    bound: this x ``fetch_piece_bytes``, 256 MiB). How many are kept in flight is measured:
    about the upstream's rate x round trip / ``fetch_piece_bytes`` + 1, at least 4
    (:mod:`deltasync.relay.gauge`)."""
    workers: int = 32
    """Threads for upstream reads, cache file reads and index writes."""
    tls_cert: Path | None = None
    """PEM certificate (chain) to serve TLS with; needs ``tls_key``. None: plaintext."""
    tls_key: Path | None = None
    """PEM private key of ``tls_cert``."""
    token: str | None = None
    """Bearer token every client must send (``authorization: Bearer …``). None: no check."""
    accept_writes: bool = False
    """Serve Put and Delete (publishing through the relay); needs ``write_token``."""
    write_token: str | None = None
    """Bearer token a client must send to write (it also reads); distinct from ``token``."""
    max_object_bytes: int = 256 << 20
    """Largest object a client may upload (a pack is 64 MiB by default)."""
    max_uploads: int = 8
    """Uploads received at once (each held in memory or spooled until written); more wait their turn."""
    upload_window: int = 32 << 20
    """Bytes one upload is granted ahead of what reached the relay's disk, and grpc's
    flow-control window of each stream (see ``uploads.UPLOAD_WINDOW_BYTES``): about this per
    round trip per upload."""
    upload_buffer: int = 256 << 20
    """Bytes of uploads in the relay's memory, all uploads together (the credit granted to
    uploads, small ones held whole); an upload over 4 MiB, or one that does not fit, is spooled
    to a file in the cache directory as it arrives."""
    write_quota: int | None = None
    """Most bytes the upstream repository may hold (counted when the relay starts, then through
    its own writes); uploads past it are refused."""
    stream: bool = True
    """Serve an object while it is still being fetched from the upstream. False: only once it
    is whole in the cache (the path before streaming, kept to measure against)."""
    warm: bool = True
    """Fetch each new version's manifest, packs and blobs into the cache as soon as the
    version feed (which follows the upstream while anyone watches) learns of it."""
    warm_concurrency: int = 4
    """Objects warmed at once."""
    push_bytes: int = 32 << 20
    """Over an upstream relay: the packs of a new version totalling at most this are asked to be
    pushed on its Watch stream right after the version's event, so they cross the link one way
    after the commit, not a round trip later (relay/push.py: each checked as any fetch, read
    from the upstream as before if anything is amiss). 0: never; not asked without ``warm`` or
    with ``cluster_relays`` (each relay of a cluster fetches only its share)."""
    report_tokens: list[tuple[str, str | None]] | None = None
    """Tokens agents and relays below report with, each for any cluster (None) or one
    (``--report-token-file``, :func:`deltasync.relay.fleet.parse_report_tokens`). None: no reports taken."""
    cluster: str = ""
    """The cluster of the nodes that report here without naming one ("": this relay's address)."""
    report_interval: float = 2.0
    """Seconds between forwards of the fleet table to an upstream relay."""
    upstream_report_token: str | None = None
    """The report token of the upstream relay (None: the first of ``report_tokens`` for any cluster)."""
    cluster_relays: list[str] | None = None
    """The relays serving this cluster side by side, this one included, ``HOST:PORT`` each as the
    cluster's agents name them, the same list on each (``--cluster-relays``). Each object larger
    than 1 MiB is then fetched in shares: every relay reads the pieces it owns over its own
    upstream link and the others from the relays that own them, so the cluster's ingress is
    the sum of its links (relay/shares.py). None: this relay fetches everything itself."""
    advertise: str | None = None
    """This relay's entry in ``cluster_relays``. None: ``HOST:PORT`` of ``listen`` (the bound
    port when ``listen`` asks for port 0)."""

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise UsageError(f"invalid listen address {self.listen!r} (expected HOST:PORT)")
        if not 0 <= self.hint_ttl <= 600:
            raise UsageError(f"hint_ttl must be in 0..600 seconds, got {self.hint_ttl}")
        for name in ("poll_interval", "rescan_interval", "keepalive_interval", "upstream_grace"):
            if not getattr(self, name) > 0:
                raise UsageError(f"{name} must be positive, got {getattr(self, name)}")
        if self.cache_max_bytes is not None and self.cache_max_bytes < 0:
            raise UsageError(f"cache_max_bytes must not be negative, got {self.cache_max_bytes}")
        if self.fetch_pieces_in_flight < 1:
            raise UsageError(f"fetch_pieces_in_flight must be positive, got {self.fetch_pieces_in_flight}")
        if self.fetch_piece_bytes < 1 or self.workers < 2:
            raise UsageError("fetch_piece_bytes must be positive and workers at least 2")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise UsageError("TLS needs both a certificate and its key")
        if self.token is not None and not self.token.strip():
            raise UsageError("the bearer token is empty")
        if self.accept_writes and not (self.write_token and self.write_token.strip()):
            raise UsageError("a relay accepting writes needs a write token (--write-token-file)")
        if self.write_token is not None and not self.accept_writes:
            raise UsageError("a write token is given but the relay does not accept writes (--accept-writes)")
        if self.write_token is not None and self.write_token == self.token:
            raise UsageError("the write token must differ from the read token")
        if not 64 << 10 <= self.upload_window <= 1 << 30:
            raise UsageError(f"upload_window must be between 64 KiB and 1 GiB, got {self.upload_window}")
        if self.upload_buffer < 1 << 20:
            raise UsageError(f"upload_buffer must be at least 1 MiB (one piece), got {self.upload_buffer}")
        if self.max_object_bytes < 1 or self.max_uploads < 1:
            raise UsageError("max_object_bytes and max_uploads must be positive")
        if not 0 <= self.push_bytes <= 1 << 30:
            raise UsageError(f"push_bytes must be in 0..1 GiB, got {self.push_bytes}")
        if self.warm_concurrency < 1:
            raise UsageError(f"warm_concurrency must be positive, got {self.warm_concurrency}")
        if not 0.1 <= self.report_interval <= 600:
            raise UsageError(f"report_interval must be in 0.1..600 seconds, got {self.report_interval}")
        if self.write_quota is not None and (self.write_quota < 0 or not self.accept_writes):
            raise UsageError("a write quota must not be negative, and needs --accept-writes")
        if self.advertise is not None and self.cluster_relays is None:
            raise UsageError("an advertised address names this relay among cluster relays: give them too")
        if self.cluster_relays is not None:
            self.cluster_relays = check_members(self.cluster_relays, self.advertise)


def check_members(members: Sequence[str], me: str | None = None) -> list[str]:
    """``members`` checked (``host:port`` each, no repeats, at least two), with ``me`` among them when given."""
    out = [m.strip() for m in members if m.strip()]
    for m in out:
        host, sep, port = m.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"invalid cluster relay address {m!r} (expected HOST:PORT)")
    if len(set(out)) != len(out):
        raise UsageError(f"the cluster relays {', '.join(out)} name one relay twice")
    if len(out) < 2:
        raise UsageError("the cluster relays must name at least two relays, this one included "
                         f"(got {', '.join(out) or 'none'})")
    if me is not None and me not in out:
        raise UsageError(f"this relay ({me}) is not among the cluster relays {', '.join(out)}: list it as the "
                         "cluster's agents name it, or give its address there (advertise)")
    return out


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"500G"``, ``"1.5TiB"``, ``"1048576"`` → bytes (binary multiples)."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"invalid size {text!r} (e.g. 500G, 1.5T, 1048576)")
    power = " kmgtp".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * 1024**power)

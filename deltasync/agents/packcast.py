"""A packcast agent: an engine-first agent on every node of a cluster, node 0 fetching for all.

``PackcastAgent(engine, state_dir, rank=r, world=w, master="node0:29600").run(follow=True)``
on each node (``deltasync subscribe --engine SPEC --state DIR --packcast r/w@node0:29600``).
Node 0 follows the repository as an engine-first agent does (the pin, else the latest; the
relay's Watch stream, retries with backoff, signed refs, identity checks: agents/directory.py) and
takes every new target to every node through one packcast round (engines/packcast.py): it fetches the
version's stored bytes from the relay once and broadcasts them; each node's engine stages
from them. The other nodes follow the rounds. Every node is an engine-first agent with a
state directory of its own (``deltasync status --state DIR``: the version its engine holds,
digest, lag, bytes, last error) and its kept objects (restarts read them, not the relay).

* A node left out of a round (late, slow, restarted) catches up from the relay, bit-exact; a
  node that comes back is brought in by a round of its own, even when node 0 has nothing new
  (node 0 starts one for a node that joined). A dead node holds the others up for at most
  ``timeout`` seconds.
* Node 0 gone (killed, or stopped: its close is a round too): the others follow the
  repository themselves, as plain engine-first agents, and join node 0 again when it is back
  (they try every ``rejoin_interval`` seconds).
* What a node's engine holds (``TorchEngine.holdings``: ``--tensors``, ``--shard``) decides
  what it receives: nodes that hold the same share form one stream (engines/packcast.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..engines.packcast import PackCache, PackcastNode, RoundReport
from ..errors import DeltasyncError, GroupError, ObjectNotFoundError, StoreError, UsageError
from ..format.signing import PublicKeyLike
from ..local.state import PullStopped
from ..repo.repository import LATEST, MAX_REF_BYTES, PIN, Repository
from ..storage import Store, WrappingStore
from .config import AgentConfig, Update
from .directory import Agent
from .engine import EngineAgent

if TYPE_CHECKING:
    from ..engines.base import Engine, SwapRecord

log = logging.getLogger("deltasync.agents")


class PackcastAgent(EngineAgent):
    """Keeps ``engine`` current as node ``rank`` of ``world`` of a packcast (see the module doc).

    >>> engine = TorchEngine(model, "grpc://relay:7070")
    >>> PackcastAgent(engine, "/var/lib/deltasync", rank=r, world=32, master="node0:29600").run(follow=True)

    The engine is rebound to read its repository through a :class:`PackCache` (objects
    received from the group first; the one it reads through already, if it has one).
    ``master``: ``host:port`` where node 0 listens for the others (its ``torch.distributed``
    key-value store). ``token``: a secret every node shares (records in the store carry its
    HMAC; without it, whoever reaches ``master`` can move the followers: docs/trust.md).
    ``timeout``: seconds a node waits for another. ``on_round`` receives
    each round's :class:`RoundReport` (bytes received from the group and read from the relay).
    Other arguments are :class:`EngineAgent`'s. Raises UsageError when node 0 cannot listen at
    ``master`` or another node finds no node 0 there within ``timeout``.
    """

    node_class: type[PackcastNode] = PackcastNode
    """The node each agent runs (a benchmark's subclass models its links)."""

    def __init__(
        self,
        engine: Engine,
        state_dir: str | os.PathLike[str],
        config: AgentConfig | None = None,
        *,
        rank: int,
        world: int,
        master: str,
        timeout: float = 30.0,
        piece_bytes: int = 4 << 20,
        backend: str = "gloo",
        rejoin_interval: float = 10.0,
        token: bytes | None = None,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
        on_update: Callable[[Update], None] | None = None,
        on_ready: Callable[[Agent], None] | None = None,
        on_round: Callable[[RoundReport], None] | None = None,
    ) -> None:
        if not 0 <= rank < world:
            raise UsageError(f"packcast rank must be in 0..{world - 1}, got {rank}")
        sub = getattr(engine, "subscriber", None)
        top = getattr(getattr(sub, "repo", None), "store", None)
        if top is None:
            raise UsageError(f"the {engine.kind} engine does not stage versions in this process (no subscriber)")
        reads = top
        while not isinstance(reads, PackCache) and isinstance(reads, WrappingStore):
            reads = reads.inner
        cache = reads if isinstance(reads, PackCache) else PackCache(top)
        super().__init__(engine, state_dir, config, repo=cache, trusted_keys=trusted_keys, on_update=on_update,
                         on_ready=on_ready)  # which rebinds the engine to read through the cache
        self.packcast = cache
        self.rank, self.world, self.master = rank, world, master
        self.timeout, self.piece_bytes, self.backend = timeout, piece_bytes, backend
        self.rejoin_interval = rejoin_interval
        self.token = token
        self.on_round = on_round
        self.last_round: RoundReport | None = None
        self._pending: tuple[int, dict[str, Any]] | None = None  # a follower's round to take
        self._rounds = False  # in a move that takes a round (not a restore from the kept objects)
        self._last_try = -float("inf")
        self.node: PackcastNode | None = None
        try:
            self.node = self._connect(timeout)
        except GroupError as e:
            raise UsageError(f"{e} (is node 0 running, `--packcast 0/{world}@{master}`?)") from None

    def _connect(self, timeout: float) -> PackcastNode:
        self._last_try = time.monotonic()
        assert self.engine is not None
        node = self.node_class(self.engine, self.packcast, rank=self.rank, world=self.world, master=self.master,
                            timeout=timeout, piece_bytes=self.piece_bytes, backend=self.backend, token=self.token)
        node.timeout = self.timeout  # a short wait to connect, the usual one for the rounds
        return node

    @property
    def connected(self) -> bool:
        """Whether this node takes part in node 0's rounds now (a follower: False while it
        follows the repository itself, node 0 being gone)."""
        return self.node is not None

    def run(self, *, follow: bool = False) -> int | None:
        try:
            return super().run(follow=follow)
        finally:
            if self.rank == 0 and self.node is not None:
                with contextlib.suppress(DeltasyncError, RuntimeError):
                    self.node.close()  # the others follow the repository until a node 0 is back

    # -- following -------------------------------------------------------------------------------

    def _observe(self) -> int | None:
        if self.rank == 0:
            return super()._observe()
        if self.node is None and time.monotonic() - self._last_try >= self.rejoin_interval:
            try:
                self.node = self._connect(min(self.timeout, 2.0))
                log.warning("packcast node %d: joined node 0 at %s again", self.rank, self.master)
            except (GroupError, UsageError):
                pass
        if self.node is None:
            return super()._observe()  # the repository itself, until node 0 is back
        if time.monotonic() - self._identity_read_at >= self.config.relist_interval:
            try:
                self._check_identity(self._repository())
            except (StoreError, OSError) as e:
                # The relay out of reach does not keep a node from node 0's rounds: their
                # manifests come from the group and are checked on arrival; the identity is
                # read again at the next listing.
                self._identity_read_at = time.monotonic()
                log.warning("packcast node %d: repository identity not read (%s); taking node 0's rounds", self.rank, e)
        # No round for a while (twice the timeout, at least a minute): this node reads the refs
        # itself, and moves on its own if node 0 has fallen silent on a newer target.
        idle = time.monotonic() + max(2 * self.timeout, 60.0)
        try:
            got = self.node.next_round(lambda: self._stop.is_set() or time.monotonic() > idle)
        except GroupError as e:
            return self._detach(str(e), logging.WARNING)
        if got is None:
            if not self._stop.is_set():
                return self._own_target("no round from node 0 for a while")
            raise PullStopped(self.current() or 0)  # run() ends on it
        n, header = got
        if header.get("stop"):
            return self._detach(f"packcast node {self.rank}: node 0 at {self.master} closed the group", logging.INFO)
        refused = self._refuse(int(header["version"]), header.get("note") or {})
        if refused is not None:
            log.error("packcast node %d: round %d names version %s: %s; refused, reading the refs itself",
                      self.rank, n, header["version"], refused)
            return self._own_target(refused)
        self._pending = n, header
        # Receiving starts now: the manifests the agent reads before the round come from the
        # group too (the stream starts with them), not once per node from the relay.
        self.node.start_round(n, header)
        version = int(header["version"])
        note: Mapping[str, Any] = header.get("note") or {}
        now = time.time()
        with self._lock:
            f = self.figures
            latest = note.get("latest", version)
            if latest != f.latest_version:
                f.latest_seen_unix = now
            f.latest_version, f.pinned_version, f.target_version = latest, note.get("pinned"), version
            current = self.current()
            if current == version:
                f.stale_since_unix = None
            elif f.stale_since_unix is None:
                f.stale_since_unix = now
        self._flush()
        return version

    def _refuse(self, version: int, note: Mapping[str, Any]) -> str | None:
        """With trusted keys: why the round's version is not what the signed refs node 0
        forwarded say (checked as an agent reading the repository's refs: signature,
        repository, expiry, no older than seen), None when it is. The pin names the version;
        without one the version is at most the latest and, unless a signed pin says so, never
        older than the one this node's engine holds."""
        if self.trusted_keys is None:
            return None
        refs = note.get("refs")
        if not isinstance(refs, dict):
            return "node 0 forwarded no signed refs with it"
        repo = self._repository()
        repo = Repository(_Forwarded(repo.store, refs), trusted_keys=self.trusted_keys,
                          ref_grace=self.config.ref_grace, ref_memory=self._state_db())
        if self._identity is not None:
            repo.assume_identity(self._identity[0])
        try:
            pin = repo.read_ref("pin")
            latest = repo.read_ref("latest")
            for ref in (pin, latest):
                if ref is not None:
                    repo.accept_ref(ref)
        except (DeltasyncError, OSError) as e:
            return f"the refs forwarded with it do not check ({e})"
        if pin is not None and pin.version is not None:
            return None if version == pin.version else f"the signed pin names version {pin.version}"
        if latest is None or latest.version is None:
            return "no signed refs/latest was forwarded with it"
        if version > latest.version:
            return f"the signed refs/latest names version {latest.version}"
        current = self.current()
        if current is not None and version < current:
            return f"older than the version {current} held, and no signed pin names it"
        return None

    def _own_target(self, why: str) -> int | None:
        """The target as this node reads the refs itself (node 0 silent, or its round refused)."""
        try:
            return super()._observe()
        except (StoreError, OSError) as e:
            log.warning("packcast node %d: %s, and the repository's refs could not be read (%s)", self.rank, why, e)
            return self.current()

    def _refs(self) -> dict[str, str | None]:
        """Node 0: the refs as stored (signed ones checked by each follower with keys)."""
        out: dict[str, str | None] = {}
        for key in (LATEST, PIN):
            try:
                out[key] = self.store.get(key, max_bytes=MAX_REF_BYTES).decode("ascii", "replace")
            except ObjectNotFoundError:
                out[key] = None
            except (StoreError, OSError) as e:
                log.warning("packcast node 0: %s not read to forward (%s)", key, e)
                out[key] = None
        return out

    def _detach(self, why: str, level: int) -> int | None:
        log.log(level, "%s; following the repository until it is back", why)
        self.node = None
        self._pending = None
        self._last_try = time.monotonic()
        return super()._observe()

    def _needs_update(self, target: int) -> bool:
        if self.rank == 0:
            # A node that joined (a restart, a late start) is brought in by a round even when
            # node 0 has nothing new.
            return super()._needs_update(target) or (self.node is not None and self.node.joins_pending())
        return self._pending is not None or super()._needs_update(target)

    def _move(self, sub: Any, repo: Any, previous: int | None, target: int) -> str:
        self._rounds = True
        try:
            how = super()._move(sub, repo, previous, target)
        finally:
            self._rounds = False
            if self._pending is not None and self.node is not None:  # failed before its round
                self._pending = None
                self.node.drop_round()
        report = self.last_round
        if report is not None and report.version == target:
            how += f"; packcast round {report.round}: {_size(report.received_bytes)} from the group, " \
                   f"{_size(report.upstream_bytes)} from the relay; links {_size(report.link_sent)} sent, " \
                   f"{_size(report.link_received)} received"
        if self.rank != 0 and self.node is not None:
            self._wake.set()  # straight back to waiting for the next round
        return how

    def _engine_update(self, engine: Engine, target: int, force: bool) -> SwapRecord | None:
        node = self.node
        if not self._rounds or node is None:
            return super()._engine_update(engine, target, force)

        def apply(version: int) -> SwapRecord | None:
            return EngineAgent._engine_update(self, engine, version, force)

        self.last_round = None
        if self.rank == 0:
            note = {"latest": self.figures.latest_version, "pinned": self.figures.pinned_version,
                    "refs": self._refs()}
            report = node.update(target, apply=apply, note=note)
        else:
            pending, self._pending = self._pending, None
            if pending is None:
                return super()._engine_update(engine, target, force)
            report = node.take_round(*pending, apply=apply)
        self.last_round = report
        if self.on_round is not None:
            self.on_round(report)
        return report.record


class _Forwarded(WrappingStore):
    """The repository's store with the refs node 0 forwarded in place of the stored ones."""

    def __init__(self, inner: Store, refs: Mapping[str, Any]) -> None:
        super().__init__(inner)
        self.refs = refs

    def _get(self, key: str, byte_range: tuple[int, int] | None) -> bytes:
        if key in (LATEST, PIN):
            raw = self.refs.get(key)
            if not isinstance(raw, str):
                raise ObjectNotFoundError(key)
            data = raw.encode("ascii", "replace")
            return data if byte_range is None else data[byte_range[0]: byte_range[0] + byte_range[1]]
        return super()._get(key, byte_range)


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


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


__all__ = ["PackcastAgent", "parse_packcast", "read_token"]

"""A packcast agent: an engine-first agent on every node of a cluster, node 0 fetching for all.

``PackcastAgent(engine, state_dir, packcast=PackcastOptions(rank=r, world=w, master="node0:29600")).run(follow=True)``
on each node (``deltasync subscribe --engine SPEC --state DIR --packcast r/w@node0:29600``).
Node 0 follows the repository as an engine-first agent does (the pin, else the latest; the
relay's Watch stream, retries with backoff, signed refs, identity checks: watch.py, base.py) and
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

The agent is an engine-first agent (:class:`~.engine.EngineAgent`) whose source of targets is
:class:`PackcastRounds`: node 0's rounds, or the repository watched while node 0 is gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engines.packcast import PackCache, PackcastNode, RoundReport
from ..errors import DeltasyncError, GroupError, ObjectNotFoundError, StoreError, UsageError
from ..format.signing import PublicKeyLike
from ..local.state import PullStopped
from ..repo.repository import LATEST, MAX_REF_BYTES, PIN, Repository
from ..storage import Store, WrappingStore
from .config import AgentConfig, Update
from .engine import EngineAgent
from .watch import Targets

if TYPE_CHECKING:
    from ..engines.base import Engine, SwapRecord

log = logging.getLogger("deltasync.agents")


@dataclass(frozen=True, kw_only=True)
class PackcastOptions:
    """Where a node sits in its packcast group and how it waits for the others."""

    rank: int
    """This node's rank, 0 (the one that reads the repository) to ``world - 1``."""
    world: int
    """Nodes in the group."""
    master: str
    """``host:port`` where node 0 listens for the others (its ``torch.distributed`` key-value store)."""
    timeout: float = 30.0
    """Seconds a node waits for another."""
    piece_bytes: int = 4 << 20
    """Bytes per piece of a round's stream."""
    backend: str = "gloo"
    """The ``torch.distributed`` backend of the group."""
    rejoin_interval: float = 10.0
    """Seconds between a follower's tries to join node 0 again while it is gone."""
    token: bytes | None = field(default=None, repr=False)
    """A secret every node shares (records in the store carry its HMAC; without it, whoever
    reaches ``master`` can move the followers: docs/trust.md)."""
    on_round: Callable[[RoundReport], None] | None = None
    """Receives each round's :class:`RoundReport` (bytes received from the group and read from the relay)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise UsageError(f"packcast rank must be in 0..{self.world - 1}, got {self.rank}")


class PackcastAgent(EngineAgent):
    """Keeps ``engine`` current as node ``packcast.rank`` of a packcast group (see the module doc).

    >>> engine = TorchEngine(model, "grpc://relay:7070")
    >>> node = PackcastOptions(rank=r, world=32, master="node0:29600")
    >>> PackcastAgent(engine, "/var/lib/deltasync", packcast=node).run(follow=True)

    The engine is rebound to read its repository through a :class:`PackCache` (objects
    received from the group first; the one it reads through already, if it has one). Other
    arguments are :class:`EngineAgent`'s. Raises UsageError when node 0 cannot listen at
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
        packcast: PackcastOptions,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
        on_update: Callable[[Update], None] | None = None,
        on_ready: Callable[[EngineAgent], None] | None = None,
    ) -> None:
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
        self.rounds = PackcastRounds(self, cache, packcast, self.node_class)
        self.source = self.rounds

    @property
    def connected(self) -> bool:
        """Whether this node takes part in node 0's rounds now (a follower: False while it
        follows the repository itself, node 0 being gone)."""
        return self.rounds.node is not None

    @property
    def last_round(self) -> RoundReport | None:
        """What this node did in the round of its last move (None: it took none)."""
        return self.rounds.last_round


class PackcastRounds(Targets):
    """The targets of node ``options.rank``: node 0 reads the repository (``agent.watch``) and
    runs a round per target; the others take node 0's rounds, and watch the repository
    themselves while node 0 is gone or silent, or when its round is refused."""

    def __init__(self, agent: EngineAgent, cache: PackCache, options: PackcastOptions,
                 node_class: type[PackcastNode] = PackcastNode) -> None:
        self.agent = agent
        self.cache = cache
        self.options = options
        self.node_class = node_class
        self.last_round: RoundReport | None = None
        self._pending: tuple[int, dict[str, Any]] | None = None  # a follower's round to take
        self._last_try = -float("inf")
        self.node: PackcastNode | None = None
        try:
            self.node = self._connect(options.timeout)
        except GroupError as e:
            raise UsageError(f"{e} (is node 0 running, `--packcast 0/{options.world}@{options.master}`?)") from None

    @property
    def rank(self) -> int:
        return self.options.rank

    def _connect(self, timeout: float) -> PackcastNode:
        self._last_try = time.monotonic()
        o = self.options
        node = self.node_class(self.agent.engine, self.cache, rank=o.rank, world=o.world, master=o.master,
                               timeout=timeout, piece_bytes=o.piece_bytes, backend=o.backend, token=o.token)
        node.timeout = o.timeout  # a short wait to connect, the usual one for the rounds
        return node

    def start(self, follow: bool) -> None:
        self.agent.watch.start(follow)

    def close(self) -> None:
        self.agent.watch.close()
        if self.rank == 0 and self.node is not None:
            with contextlib.suppress(DeltasyncError, RuntimeError):
                self.node.close()  # the others follow the repository until a node 0 is back

    # -- the targets ------------------------------------------------------------------------------

    def observe(self) -> int | None:
        agent, watch = self.agent, self.agent.watch
        if self.rank == 0:
            return watch.observe()
        if self.node is None and time.monotonic() - self._last_try >= self.options.rejoin_interval:
            try:
                self.node = self._connect(min(self.options.timeout, 2.0))
                log.warning("packcast node %d: joined node 0 at %s again", self.rank, self.options.master)
            except (GroupError, UsageError):
                pass
        if self.node is None:
            return watch.observe()  # the repository itself, until node 0 is back
        if time.monotonic() - watch.identity_read_at >= agent.config.relist_interval:
            try:
                watch.check_identity(agent.repository())
            except (StoreError, OSError) as e:
                # The relay out of reach does not keep a node from node 0's rounds: their
                # manifests come from the group and are checked on arrival; the identity is
                # read again at the next listing.
                watch.identity_read_at = time.monotonic()
                log.warning("packcast node %d: repository identity not read (%s); taking node 0's rounds", self.rank, e)
        # No round for a while (twice the timeout, at least a minute): this node reads the refs
        # itself, and moves on its own if node 0 has fallen silent on a newer target.
        idle = time.monotonic() + max(2 * self.options.timeout, 60.0)
        try:
            got = self.node.next_round(lambda: agent.stopping or time.monotonic() > idle)
        except GroupError as e:
            return self._detach(str(e), logging.WARNING)
        if got is None:
            if not agent.stopping:
                return self._own_target("no round from node 0 for a while")
            raise PullStopped(agent.current() or 0)  # run() ends on it
        n, header = got
        if header.get("stop"):
            return self._detach(f"packcast node {self.rank}: node 0 at {self.options.master} closed the group",
                                logging.INFO)
        version = int(header["version"])
        note: Mapping[str, Any] = header.get("note") or {}
        refused = self._refuse(version, note)
        if refused is not None:
            log.error("packcast node %d: round %d names version %s: %s; refused, reading the refs itself",
                      self.rank, n, header["version"], refused)
            return self._own_target(refused)
        self._pending = n, header
        # Receiving starts now: the manifests the agent reads before the round come from the
        # group too (the stream starts with them), not once per node from the relay.
        self.node.start_round(n, header)
        agent.book.saw(latest=note.get("latest", version), pinned=note.get("pinned"), target=version,
                       current=agent.current(), stale_since=time.time)
        return version

    def _refuse(self, version: int, note: Mapping[str, Any]) -> str | None:
        """With trusted keys: why the round's version is not what the signed refs node 0
        forwarded say (checked as an agent reading the repository's refs: signature,
        repository, expiry, no older than seen), None when it is. The pin names the version;
        without one the version is at most the latest and, unless a signed pin says so, never
        older than the one this node's engine holds."""
        agent = self.agent
        if agent.trusted_keys is None:
            return None
        refs = note.get("refs")
        if not isinstance(refs, dict):
            return "node 0 forwarded no signed refs with it"
        repo = Repository(_Forwarded(agent.store, refs), trusted_keys=agent.trusted_keys,
                          ref_grace=agent.config.ref_grace, ref_memory=agent.state_db())
        if agent.watch.identity is not None:
            repo.assume_identity(agent.watch.identity[0])
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
        current = agent.current()
        if current is not None and version < current:
            return f"older than the version {current} held, and no signed pin names it"
        return None

    def _own_target(self, why: str) -> int | None:
        """The target as this node reads the refs itself (node 0 silent, or its round refused)."""
        try:
            return self.agent.watch.observe()
        except (StoreError, OSError) as e:
            log.warning("packcast node %d: %s, and the repository's refs could not be read (%s)", self.rank, why, e)
            return self.agent.current()

    def _detach(self, why: str, level: int) -> int | None:
        log.log(level, "%s; following the repository until it is back", why)
        self.node = None
        self._pending = None
        self._last_try = time.monotonic()
        return self.agent.watch.observe()

    # -- a move -----------------------------------------------------------------------------------

    def due(self) -> bool:
        if self.rank == 0:
            # A node that joined (a restart, a late start) is brought in by a round even when
            # node 0 has nothing new.
            return self.node is not None and self.node.joins_pending()
        return self._pending is not None

    def deliver(self, target: int, apply: Callable[[int], SwapRecord | None]) -> SwapRecord | None:
        node = self.node
        if node is None:
            return apply(target)
        self.last_round = None
        if self.rank == 0:
            f = self.agent.figures
            report = node.update(target, apply=apply,
                                 note={"latest": f.latest_version, "pinned": f.pinned_version, "refs": self._refs()})
        else:
            pending, self._pending = self._pending, None
            if pending is None:
                return apply(target)
            report = node.take_round(*pending, apply=apply)
        self.last_round = report
        if self.options.on_round is not None:
            self.options.on_round(report)
        return report.record

    def _refs(self) -> dict[str, str | None]:
        """Node 0: the refs as stored (signed ones checked by each follower with keys)."""
        out: dict[str, str | None] = {}
        for key in (LATEST, PIN):
            try:
                out[key] = self.agent.store.get(key, max_bytes=MAX_REF_BYTES).decode("ascii", "replace")
            except ObjectNotFoundError:
                out[key] = None
            except (StoreError, OSError) as e:
                log.warning("packcast node 0: %s not read to forward (%s)", key, e)
                out[key] = None
        return out

    def abandoned(self) -> None:
        if self._pending is not None and self.node is not None:  # failed before its round
            self._pending = None
            self.node.drop_round()

    def moved(self, target: int, how: str) -> str:
        self.abandoned()  # a round left untaken by a move that did not reach the engine
        report = self.last_round
        if report is not None and report.version == target:
            how += f"; packcast round {report.round}: {_size(report.received_bytes)} from the group, " \
                   f"{_size(report.upstream_bytes)} from the relay; links {_size(report.link_sent)} sent, " \
                   f"{_size(report.link_received)} received"
        if self.rank != 0 and self.node is not None:
            self.agent.wake()  # straight back to waiting for the next round
        return how


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


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


__all__ = ["PackcastAgent", "PackcastOptions", "PackcastRounds"]

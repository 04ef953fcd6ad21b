"""Many trainer ranks, one version.

Under torch.distributed each rank holds part of the state: whole tensors, or slices of
tensors (``deltasync.Slice``) as FSDP and tensor parallelism produce them. Every rank
encodes and uploads its own chunks in parallel against its own previous bits; rank 0
commits the one manifest once every rank's packs are durable. A rank that fails makes the
version fail on every rank: nothing is committed, each rank abandons what it uploaded, and
every rank raises the same error, so the next attempt (a snapshot) starts clean.

Coordination uses small object collectives on a gloo group of its own, with its own
timeout, so a rank that dies surfaces as an error after ``timeout`` seconds, not a hang.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import (
    CommittedError,
    DeltasyncError,
    DistributedPublishError as DistributedPublishError,  # defined there; importable here too
    UsageError,
)
from ..format.slices import Slice
from ..repo.leases import Lease
from ..repo.repository import Repository, open_repository
from ..storage import Store
from ..v1 import manifest_pb2 as pb
from .commit import COMMIT_ATTEMPTS, Draft, commit, deleted_error, missing_objects, restore_packs, signing_policy
from .config import PublisherConfig
from .encode import Bits, Encoded, SourceTensor, abandon, encode, log, memory_bases, state_sources
from .result import PublishResult

if TYPE_CHECKING:
    import torch


@dataclass
class _Decision:
    version: int = 0
    parent: int | None = None
    delta: bool = False
    limit: int | None = None
    owners: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    latest: tuple[int | None] | None = None
    """(the latest version,) as rank 0 listed it: the commit's history parent when the version
    is the next one, without listing the manifests again (Draft.latest)."""


class DistributedPublisher:
    """Publish one version from every rank of a torch.distributed job.

    >>> pub = DistributedPublisher("s3://bucket/run-7")       # on every rank
    >>> v = pub.publish({"layers.0.w": Slice(local, offsets=(rank * 1024, 0), full_shape=(4096, 4096))})

    All ranks must call ``publish`` together. A tensor held whole by several ranks (a
    replicated norm, say) is encoded once, by the lowest rank holding it.
    """

    def __init__(
        self,
        repo: str | Store | Repository,
        config: PublisherConfig | None = None,
        *,
        group: Any = None,
        timeout: float = 600.0,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("DistributedPublisher needs an initialised torch.distributed process group")
        ranks = None if group is None else dist.get_process_group_ranks(group)
        # Our own gloo group: object collectives work on any backend's ranks, and the timeout is ours.
        self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout))
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.repo = open_repository(repo)
        self.config = config or PublisherConfig()
        self._bits: dict[str, Bits] = {}  # this rank's part of the last version, the next delta's base
        self._bits_version: int | None = None
        self._lease: Lease | None = None  # (rank 0) the lease of the version being published

    # -- collectives (every failure becomes a DeltasyncError) ----------------------------------

    def _all_gather(self, obj: object) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:
            raise DeltasyncError(f"rank group failed during publish (a rank died or timed out): {e}") from None
        return out

    def _broadcast(self, obj: object) -> Any:
        import torch.distributed as dist

        box = [obj]
        try:
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        except RuntimeError as e:
            raise DeltasyncError(f"rank group failed during publish (a rank died or timed out): {e}") from None
        return box[0]

    # -- publish -------------------------------------------------------------------------------

    def publish(
        self,
        state: Mapping[str, torch.Tensor | Slice],
        *,
        version: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> PublishResult:
        """Commit this rank's part of ``state`` with every other rank's; every rank gets the result."""
        start = time.monotonic()
        sources: list[SourceTensor] = []
        error: str | None = None
        try:
            sources = state_sources(state)
        except Exception as e:
            error = str(e)
        metas = self._all_gather({"keys": [s.key for s in sources], "base": self._bits_version, "error": error})
        failures = {r: m["error"] for r, m in enumerate(metas) if m["error"]}
        if failures:
            raise DistributedPublishError(version, failures)

        decision: _Decision | None = None
        lease = None
        if self.rank == 0:
            # Rank 0 holds one lease for the version, from before any rank uploads until its
            # commit: gc deletes no pack or blob meanwhile (repo/leases.py). It is written while
            # the latest version is read (one round trip for both), as Publisher does.
            decision, lease = self._decide_leased(metas, version)
        self._lease = lease  # released beside the commit's last requests (commit's after_commit)
        try:
            return self._publish_decided(self._broadcast(decision), sources, version, metadata, start)
        finally:
            self._lease = None
            if lease is not None:
                lease.release()  # after a failure (after the commit: done already)

    def _decide_leased(self, metas: list[dict[str, Any]], version: int | None) -> tuple[_Decision, Lease | None]:
        """(Rank 0) The decision, and the lease taken beside its read of the latest version."""
        try:
            self.repo.create()  # before the lease: a repository's first publish makes it one (later: no request)
        except DeltasyncError as e:
            return _Decision(error=str(e)), None
        lease = Lease(self.repo.store, f"publish of the next version ({self.world} ranks)")
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-lease") as pool:
            leased = pool.submit(lease.__enter__)
            try:
                decision = self._decide(metas, version)
            finally:
                failed = leased.exception()  # waits for the lease's write
        if failed is not None or decision.error:
            lease.release()  # a lease written without its publish: gone at once (else it expires)
            if failed is not None:  # told to every rank (raised here, it would leave them waiting)
                why = str(failed) if isinstance(failed, DeltasyncError) else f"{type(failed).__name__}: {failed}"
                return _Decision(error=f"cannot write the publish lease: {why}"), None
            return decision, None
        lease.what = f"publish of version {decision.version} ({self.world} ranks)"  # from its next renewal
        return decision, lease

    def _publish_decided(self, decision: object, sources: list[SourceTensor], version: int | None,
                         metadata: Mapping[str, str] | None, start: float) -> PublishResult:
        assert isinstance(decision, _Decision)
        if decision.error:
            raise DistributedPublishError(version, {0: decision.error})
        mine = [s for s in sources if decision.owners.get(s.key) == self.rank]

        self._bits_version = None  # the in-memory base is rewritten in place below
        delta = decision.delta
        restores = 0
        new_bits: dict[str, Bits] = {}
        encoded, error = self._encode_mine(mine, decision, delta, new_bits)
        while True:
            results = self._all_gather(_wire(encoded, error))
            outcome = self._finish(results, decision, delta, metadata, start, restores) if self.rank == 0 else None
            outcome = self._broadcast(outcome)
            if outcome == "snapshot":
                if encoded is not None:
                    abandon(self.repo.store, encoded)
                delta = False  # the delta came out larger than a snapshot's worth: store a snapshot
                new_bits = {}
                encoded, error = self._encode_mine(mine, decision, delta, new_bits)
                continue
            if isinstance(outcome, list):
                # Packs a concurrent gc deleted before the commit: each rank stores again
                # those of its own chunks (encode.py docstring), then rank 0 checks again.
                restores += 1
                if encoded is not None:
                    try:
                        encoded = restore_packs(self.repo.store, self.config, encoded, mine, set(outcome))
                    except Exception as e:
                        error = str(e) if isinstance(e, DeltasyncError) else f"{type(e).__name__}: {e}"
                        abandon(self.repo.store, encoded)
                        encoded = None
                continue
            if isinstance(outcome, tuple):
                raise CommittedError(outcome[1], outcome[2])
            if isinstance(outcome, PublishResult):
                self._bits = new_bits
                self._bits_version = outcome.version
                return outcome
            if encoded is not None:
                abandon(self.repo.store, encoded)
            assert isinstance(outcome, dict)
            raise DistributedPublishError(decision.version, outcome)

    def _decide(self, metas: list[dict[str, Any]], version: int | None) -> _Decision:
        try:
            repo = self.repo
            latest = repo.latest()
            if version is None:
                version = (latest or 0) + 1
            elif version < 1 or (latest is not None and version <= latest):
                raise UsageError(f"version {version} is not newer than the latest version {latest}")
            owners: dict[str, int] = {}
            for r, m in enumerate(metas):
                for key in m["keys"]:
                    owners.setdefault(key, r)
            decision = _Decision(version=version, parent=latest, owners=owners, latest=(latest,))
            if latest is not None and all(m["base"] == latest for m in metas) and signing_policy(repo, latest):
                chain = repo.chain(latest)
                if len(chain) < self.config.snapshot_every:
                    decision.delta = True
                    decision.limit = int(self.config.max_delta_fraction * chain[0].pb.stored_bytes)
            return decision
        except DeltasyncError as e:
            return _Decision(error=str(e))

    def _encode_mine(
        self, mine: list[SourceTensor], decision: _Decision, delta: bool, new_bits: dict[str, Bits]
    ) -> tuple[Encoded | None, str | None]:
        try:
            bases = memory_bases(self.repo, self._bits, decision.parent) if delta else {}
            encoded = encode(self.repo.store, self.config, mine, [], bases,
                             label=f"publish v{decision.version} rank {self.rank}", keep=new_bits, base_arrays=self._bits)
            return encoded, None
        except Exception as e:
            return None, f"{type(e).__name__}: {e}" if not isinstance(e, DeltasyncError) else str(e)

    def _finish(
        self,
        results: list[dict[str, Any]],
        decision: _Decision,
        delta: bool,
        metadata: Mapping[str, str] | None,
        start: float,
        restores: int,
    ) -> PublishResult | str | list[str] | dict[int, str] | tuple[str, int, str]:
        failures = {r: res["error"] for r, res in enumerate(results) if res["error"]}
        if failures:
            return failures
        stored = sum(res["stored"] for res in results)
        if delta and decision.limit is not None and stored > decision.limit:
            return "snapshot"
        tensors: list[pb.Tensor] = []
        packs: list[pb.Pack] = []
        for res in results:
            base_index = len(packs)
            packs.extend(pb.Pack(key=k, size=s) for k, s in res["packs"])
            for raw in res["tensors"]:
                t = pb.Tensor.FromString(raw)
                for c in t.chunks:
                    if c.length:
                        c.pack += base_index
                tensors.append(t)
        merged = Encoded(tensors, packs, stored, sum(res["raw"] for res in results), set())
        try:
            missing = missing_objects(self.repo.store, [], merged)
            if missing and restores >= COMMIT_ATTEMPTS - 1:
                raise deleted_error(decision.version, missing, restores + 1)
            if missing:
                log.warning("version %d: %d pack(s) deleted before the commit (a gc with a --grace shorter than this "
                            "publish?); storing them again (attempt %d of %d)", decision.version, len(missing),
                            restores + 2, COMMIT_ATTEMPTS)
                return missing
            draft = Draft(version=decision.version, parent=decision.parent, snapshot=not delta, files=[],
                          metadata=metadata, blob_bytes=0, start=start, latest=decision.latest)
            return commit(self.repo, self.config, draft, merged, lease=self._lease)
        except CommittedError as e:
            return ("committed", e.version, str(e))  # the version exists: no rank may remove its packs
        except DeltasyncError as e:
            return {0: str(e)}


def _wire(encoded: Encoded | None, error: str | None) -> dict[str, Any]:
    if encoded is None:
        return {"error": error or "unknown failure", "tensors": [], "packs": [], "stored": 0, "raw": 0}
    return {
        "error": None,
        "tensors": [t.SerializeToString() for t in encoded.tensors],
        "packs": [(p.key, p.size) for p in encoded.packs],
        "stored": encoded.stored,
        "raw": encoded.raw,
    }

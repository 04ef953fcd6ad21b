"""A verl checkpoint engine named ``deltasync``: trainer ranks publish versions, rollout replicas pull them.

verl (0.9+) moves weights from its actor workers to its rollout replicas through a
checkpoint engine chosen by name. Importing this module registers :class:`DeltasyncCheckpointEngine`
under ``"deltasync"`` with verl's own ``CheckpointEngineRegistry``; verl imports it itself
when the config names this module::

    actor_rollout_ref.rollout.checkpoint_engine.backend=deltasync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=deltasync.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync.repo=s3://bucket/run-7

**Trainer side.** ``send_weights`` publishes one version per call, numbered by verl's
``global_steps`` where that is newer than the latest version. Under torch.distributed every
actor rank iterates the full-tensor export (the assembly is collective) and publishes its
share of the tensors through :class:`deltasync.DistributedPublisher`, so encoding and upload
run on every rank in parallel; rank 0 commits. Single-process trainers use :class:`deltasync.Publisher`.

**Rollout side.** ``receive_weights`` waits for the version, pulls it (every chunk verified
against the manifest's digests, through a relay's ``grpc://`` for replicas in other
clusters; a replica that skipped versions takes the cheapest chain or squash) and yields
what verl's server adapters take:

* ``wire_format="delta_flush"`` (default): the flushes of verl's own ``delta_sharded``
  engine, so verl's SGLang loader and vLLM transfer backend apply them unchanged. Changed
  elements go as ``indices`` flushes (int32 positions plus values; the loaders write them
  through a NaN mask). A tensor whose change cannot be said that way (a changed element
  that is NaN, an integer tensor, 2^31 elements or more) and every tensor of a replica's
  first update go whole, as ``dense`` flushes.
* ``wire_format="named_tensors"``: ``(name, tensor)`` pairs, every tensor on a replica's
  first update and the changed tensors after.

The positions are found on the rollout host (a bit comparison with the version it holds),
so what crosses the network between clusters is deltasync's compressed delta, not verl's
positions and values.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import MissingDependencyError, UsageError

try:
    import torch
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
    from verl.checkpoint_engine.delta_sync.encode import DeltaParam, checksum
except ModuleNotFoundError as e:  # one line saying what to install, not verl's traceback
    if (e.name or "").split(".")[0] not in ("verl", "torch"):
        raise
    raise MissingDependencyError(e.name or "verl", "verl", "the deltasync verl checkpoint engine") from None

from .. import Publisher, PublisherConfig, Subscriber

log = logging.getLogger(__name__)

BACKEND = "deltasync"
STEP_KEY = "verl.global_steps"  # version metadata: the trainer step it holds
WIRE_FORMATS = ("delta_flush", "named_tensors")
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_INDEXED = 1 << 31  # verl's indices encoding: int32 positions


@dataclass
class _Bucket:
    """One flush being filled: pieces of a single dtype (a flush's values tensor is uniform)."""

    dense: bool
    params: list[DeltaParam] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    positions_n: int = 0  # elements so far, the next piece's offsets
    values_n: int = 0


class DeltasyncCheckpointEngine(CheckpointEngine):
    """verl's checkpoint-engine contract over a deltasync repository (module docstring).

    verl builds it with ``bucket_size`` (and ``is_master`` on trainer ranks) plus the
    config's ``engine_kwargs.deltasync``: ``repo`` (required: a path, ``s3://`` or, for
    rollout replicas, ``grpc://``), ``wire_format``, ``snapshot_every``, ``squash_strides``,
    ``signing_key`` / ``trusted_keys`` (PEM files), ``timeout`` (seconds a replica waits
    for a version), ``device`` (where yielded tensors go; default CUDA where there is one).
    """

    def __init__(
        self,
        bucket_size: int = 512 << 20,
        is_master: bool = False,
        *,
        repo: str,
        wire_format: str = "delta_flush",
        snapshot_every: int = 20,
        squash_strides: Sequence[int] = (),
        signing_key: str | None = None,
        trusted_keys: str | Sequence[str] | None = None,
        workers: int = 0,
        timeout: float = 600.0,
        poll_interval: float = 0.05,
        device: str | None = None,
        **_ignored: Any,
    ) -> None:
        if not repo:
            raise UsageError("the deltasync checkpoint engine needs engine_kwargs.deltasync.repo (a repository URL)")
        if wire_format not in WIRE_FORMATS:
            raise UsageError(f"wire_format must be one of {WIRE_FORMATS}, got {wire_format!r}")
        if bucket_size < 1:
            raise UsageError(f"bucket_size must be positive, got {bucket_size}")
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.repo = repo
        self.wire_format = wire_format  # read by verl's CheckpointEngineWorker for the server adapter
        self.config = PublisherConfig(snapshot_every=snapshot_every, squash_strides=tuple(squash_strides),
                                      workers=workers, progress=False)
        self.signing_key = signing_key
        self.trusted_keys = trusted_keys
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._publisher: Any = None
        self._subscriber: Subscriber | None = None
        self._held: Mapping[str, torch.Tensor] | None = None  # the version this replica last yielded
        self.held_version: int | None = None

    # -- topology: none; the repository is the meeting point ------------------------------------

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    # -- trainer side ----------------------------------------------------------------------------

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publish the tensors ``weights`` yields as one version; returns verl's sync metrics."""
        start = time.monotonic()
        state: dict[str, torch.Tensor] = {}
        rank, world = _rank_world()
        async for name, tensor in _aiter(weights):
            # Every rank iterates (a sharded export gathers collectively); each keeps its share.
            if world == 1 or zlib.crc32(name.encode()) % world == rank:
                state[name] = tensor.detach().to("cpu")
        metadata = {STEP_KEY: str(global_steps)} if global_steps is not None else None
        result = await asyncio.to_thread(self._publish, state, global_steps, metadata, world)
        return {
            "checkpoint_engine/version": float(result.version),
            "checkpoint_engine/payload_mbytes": result.stored_bytes / (1 << 20),
            "checkpoint_engine/raw_mbytes": result.raw_bytes / (1 << 20),
            "checkpoint_engine/publish_s": time.monotonic() - start,
        }

    def _publish(self, state: dict[str, torch.Tensor], step: int | None, metadata: dict[str, str] | None,
                 world: int) -> Any:
        if self._publisher is None:
            from .. import DistributedPublisher

            if world > 1:
                if self.signing_key is not None:
                    raise UsageError("signing_key is not supported with several trainer ranks")
                self._publisher = DistributedPublisher(self.repo, self.config)
            else:
                self._publisher = Publisher(self.repo, self.config, signing_key=self.signing_key)
        latest = self._publisher.repo.latest()
        version = step if step is not None and step > (latest or 0) else None
        return self._publisher.publish(state, version=version, metadata=metadata)

    # -- rollout side ----------------------------------------------------------------------------

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[Any]:
        """Yield the update to version ``global_steps`` (or the next one) in ``wire_format``."""
        if self._subscriber is None:
            keys = [self.trusted_keys] if isinstance(self.trusted_keys, str) else self.trusted_keys
            self._subscriber = Subscriber(self.repo, trusted_keys=None if keys is None else list(keys))
        target = await asyncio.to_thread(self._wait_for, global_steps)
        state = await asyncio.to_thread(self._subscriber.pull, target)
        old = self._held
        if self.wire_format == "named_tensors":
            for name, tensor in state.items():
                if old is None or name not in old or not _same_bits(old[name], tensor):
                    yield name, tensor.to(self.device)
        else:
            for flush in self.flushes(old, state):
                yield flush
        self._held, self.held_version = state, target

    def _wait_for(self, step: int | None) -> int:
        """The latest version, once it holds trainer step ``step`` or a later one (None: once
        it is newer than the version this replica holds). By the step in its metadata, not
        its id: a restarted trainer re-sends steps under new ids."""
        assert self._subscriber is not None
        repo = self._subscriber.repo
        deadline = time.monotonic() + self.timeout
        while True:
            latest = repo.latest()
            if latest is not None:
                if step is None:
                    if self.held_version is None or latest > self.held_version:
                        return latest
                else:
                    held = repo.manifest(latest).pb.metadata.get(STEP_KEY)
                    if (int(held) if held is not None else latest) >= step:
                        return latest
            if time.monotonic() > deadline:
                want = f"holding step {step}" if step is not None else "newer than the one held"
                raise UsageError(f"no version {want} in {self.repo} after {self.timeout:.0f}s (latest: {latest})")
            time.sleep(self.poll_interval)

    def flushes(
        self, old: Mapping[str, torch.Tensor] | None, new: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
        """verl ``delta_flush`` items taking a holder of ``old`` (None: anything) to ``new``."""
        pending: tuple[list[tuple[str, torch.Tensor]], bool] | None = None
        for flush in self._assemble(old, new):
            if pending is not None:
                yield pending
            pending = (flush, False)
        if pending is not None:
            yield pending[0], True

    def _assemble(self, old: Mapping[str, torch.Tensor] | None, new: Mapping[str, torch.Tensor]) -> Iterator[
            list[tuple[str, torch.Tensor]]]:
        buckets: dict[tuple[bool, torch.dtype], _Bucket] = {}
        for name, tensor in new.items():
            flat = tensor.reshape(-1)
            prev = None if old is None else old.get(name)
            dense = prev is None or prev.shape != tensor.shape or prev.dtype != tensor.dtype
            positions = values = None
            if not dense:
                assert prev is not None
                changed = _changed_positions(prev.reshape(-1), flat)
                if changed.numel() == 0:
                    continue
                values = flat[changed]
                # The loaders skip NaN sources (the mask): a NaN that is news must go whole.
                dense = (not tensor.is_floating_point() or flat.numel() >= _MAX_INDEXED
                         or bool(torch.isnan(values).any()))
                positions = changed.to(torch.int32)
            key = (dense, tensor.dtype)
            bucket = buckets.setdefault(key, _Bucket(dense))
            if dense:
                positions, values = None, flat
            assert values is not None
            n = int(values.numel())
            pos_start, val_start = 4 * bucket.positions_n, bucket.values_n
            bucket.params.append(DeltaParam(
                name=name, dtype=_dtype_name(tensor.dtype), shape=list(tensor.shape),
                pos_start=0 if dense else pos_start, pos_end=0 if dense else pos_start + 4 * n, pos_width=4,
                val_start=val_start, val_end=val_start + n,
            ))
            if positions is not None:
                bucket.positions.append(positions)
                bucket.positions_n += n
            bucket.values.append(values)
            bucket.values_n += n
            bucket.nbytes += values.nbytes + (0 if positions is None else positions.nbytes)
            if bucket.nbytes >= self.bucket_size:
                yield self._seal(buckets.pop(key))
        for bucket in buckets.values():  # the flushes not yet full
            yield self._seal(bucket)

    def _seal(self, bucket: _Bucket) -> list[tuple[str, torch.Tensor]]:
        values = torch.cat(bucket.values).to(self.device)
        if bucket.dense:
            positions = torch.empty(0, dtype=torch.uint8, device=values.device)
        else:
            positions = torch.cat(bucket.positions).contiguous().view(torch.uint8).to(self.device)
        spec = {
            "encoding": "dense" if bucket.dense else "indices",
            "params": [vars(p) for p in bucket.params],
            "checksum": int(checksum(positions, values)),
        }
        if bucket.dense:
            spec["verify"] = False
        raw = bytearray(json.dumps(spec).encode())
        spec_t = torch.frombuffer(raw, dtype=torch.uint8).to(self.device)
        named = [("__delta_spec__", spec_t), ("__values__", values)]
        if not bucket.dense:
            named.insert(1, ("__positions__", positions))
        return named


# -- helpers --------------------------------------------------------------------------------------


async def _aiter(items: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Positions whose bit patterns differ (not values: -0.0 vs 0.0 and NaN payloads count)."""
    view = _INT_VIEW[new.element_size()]
    return (old.view(view) != new.view(view)).nonzero().reshape(-1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = _INT_VIEW[a.element_size()]
    return bool(torch.equal(a.reshape(-1).view(view), b.reshape(-1).view(view)))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


CheckpointEngineRegistry.register(BACKEND)(DeltasyncCheckpointEngine)

__all__ = ["BACKEND", "DeltasyncCheckpointEngine"]

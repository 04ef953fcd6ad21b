"""``DeltasyncCallback``: a ``transformers.TrainerCallback`` that publishes the model as it trains.

>>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[DeltasyncCallback("s3://bucket/run-7")])

Every ``every_n_steps`` optimizer steps, and once at the end of training, the weights
under the names of ``model.state_dict()`` become one version, with the step in its metadata
(``hf.global_step``). Any ``Trainer`` subclass honours the callback, TRL's trainers
(``GRPOTrainer``, ``SFTTrainer``, ...) included.

Rank-aware: one version per step however many processes train.

* One process: a :class:`deltasync.Publisher`.
* torch.distributed (DDP, FSDP, tensor parallel): every rank calls the callback, and a
  :class:`deltasync.DistributedPublisher` commits one version from all of them. A tensor
  sharded as a ``DTensor`` (FSDP2 ``fully_shard``, tensor parallelism) is published from its
  shards, each rank its own ``deltasync.Slice``: nothing is gathered. Whole tensors held by
  every rank (DDP, FSDP2's replicated ones) are spread over the ranks by name, so each rank
  encodes and uploads a share in parallel.
* A model whose state dict is not one of these (FSDP1's flat parameters, DeepSpeed ZeRO-3
  partitions) gives ``state_dict_fn``: a callable returning this rank's part (or rank 0
  everything, the others ``{}``), e.g. ``lambda model: accelerator.get_state_dict(model)``.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..errors import MissingDependencyError, UsageError

try:
    import torch
    from transformers import TrainerCallback
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in ("transformers", "torch"):
        raise
    raise MissingDependencyError(e.name or "transformers", "transformers", "deltasync's Trainer callback") from None

from .. import DistributedPublisher, Publisher, PublisherConfig, Slice

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from .. import PublishResult

log = logging.getLogger(__name__)

StateDictFn = Callable[[torch.nn.Module], Mapping[str, Any]]


class DeltasyncCallback(TrainerCallback):
    """Publish ``model.state_dict()`` to ``repo`` every ``every_n_steps`` optimizer steps and at the end.

    ``repo``: a repository URL (a path, ``s3://``; not ``grpc://``, which is read-only).
    ``config``, ``signing_key``: as :class:`deltasync.Publisher` takes them (one process;
    signing with several ranks is refused, as ``DistributedPublisher`` does not sign).
    ``metadata``: added to every version's, beside ``hf.global_step`` and ``hf.epoch``.
    ``dtype``: cast floating tensors to it first (e.g. ``torch.bfloat16``: what inference
    serves, from fp32 master weights); None publishes them as they are.
    ``state_dict_fn``: where the state comes from when ``model.state_dict()`` is not it
    (module docstring). ``background``: take the host copy in the step, then encode and
    upload in a thread while training goes on (one publish in flight; the end of training
    waits for the last). ``timeout``: seconds a rank waits for the others while publishing.
    ``results`` lists every :class:`deltasync.PublishResult` this process saw.
    """

    def __init__(
        self,
        repo: str,
        every_n_steps: int = 1,
        *,
        config: PublisherConfig | None = None,
        signing_key: Any = None,
        metadata: Mapping[str, str] | None = None,
        dtype: torch.dtype | None = None,
        state_dict_fn: StateDictFn | None = None,
        publish_at_end: bool = True,
        background: bool = False,
        timeout: float = 600.0,
    ) -> None:
        if every_n_steps < 1:
            raise UsageError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if dtype is not None and not dtype.is_floating_point:
            raise UsageError(f"dtype must be a floating dtype, got {dtype}")
        self.repo = repo
        self.every_n_steps = every_n_steps
        self.config = config or PublisherConfig(progress=False)
        self.signing_key = signing_key
        self.metadata = dict(metadata or {})
        self.dtype = dtype
        self.state_dict_fn = state_dict_fn
        self.publish_at_end = publish_at_end
        self.background = background
        self.timeout = timeout
        self.results: list[PublishResult] = []
        self._publisher: Publisher | DistributedPublisher | None = None
        self._last_step: int | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[PublishResult] | None = None

    # -- Trainer events ---------------------------------------------------------------------------

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        if model is not None and state.global_step % self.every_n_steps == 0:
            self._start(model, state.global_step, state.epoch)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        if model is not None and self.publish_at_end and self._last_step != state.global_step:
            self._start(model, state.global_step, state.epoch)
        self.wait()

    # -- publishing -----------------------------------------------------------------------------

    def publish(self, model: torch.nn.Module, step: int, epoch: float | None = None) -> PublishResult:
        """Publish ``model`` now as the version of ``step`` (every rank calls this together)."""
        self.wait()
        rank, world = _rank_world()
        return self._commit(self._snapshot(model, rank, world), step, epoch, world)

    def wait(self) -> PublishResult | None:
        """With ``background``: wait for the publish in flight (its error is raised here)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def _start(self, model: torch.nn.Module, step: int, epoch: float | None) -> None:
        if not self.background:
            self.publish(model, step, epoch)
            return
        # The host copy is taken now, in the step; encoding and upload overlap the next steps.
        # One publish in flight at a time: the next one waits for it (versions stay in order).
        rank, world = _rank_world()
        state = self._snapshot(model, rank, world)
        self.wait()
        self._open(world)  # here, not in the thread: a DistributedPublisher's group is made on the default group
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="deltasync-publish")
        self._pending = self._executor.submit(self._commit, state, step, epoch, world)
        self._last_step = step

    def _snapshot(self, model: torch.nn.Module, rank: int, world: int) -> dict[str, torch.Tensor | Slice]:
        with torch.no_grad():
            raw = self.state_dict_fn(model) if self.state_dict_fn is not None else model.state_dict()
            return self._share(raw, rank, world)

    def _commit(self, state: dict[str, torch.Tensor | Slice], step: int, epoch: float | None,
                world: int) -> PublishResult:
        metadata = {**self.metadata, "hf.global_step": str(step)}
        if epoch is not None:
            metadata["hf.epoch"] = f"{epoch:g}"
        result = self._open(world).publish(state, metadata=metadata)
        self._last_step = step
        self.results.append(result)
        log.info("deltasync: step %d published as version %d (%s, %d bytes stored)",
                 step, result.version, result.kind, result.stored_bytes)
        return result

    def _open(self, world: int) -> Publisher | DistributedPublisher:
        if self._publisher is None:
            if world > 1:
                if self.signing_key is not None:
                    raise UsageError("signing_key is not supported with several ranks (DistributedPublisher does not sign)")
                self._publisher = DistributedPublisher(self.repo, self.config, timeout=self.timeout)
            else:
                self._publisher = Publisher(self.repo, self.config, signing_key=self.signing_key)
        return self._publisher

    def _share(self, raw: Mapping[str, Any], rank: int, world: int) -> dict[str, torch.Tensor | Slice]:
        """This rank's part of the version: its DTensor shards as Slices, its share of whole tensors."""
        out: dict[str, torch.Tensor | Slice] = {}
        for name, value in raw.items():
            if not isinstance(value, torch.Tensor):
                continue  # FSDP/DeepSpeed state dicts may carry non-tensor extras
            piece = _dtensor_slice(value, self._cast)
            if piece is not None:
                if piece.tensor.numel():
                    out[name] = piece
            elif world == 1 or zlib.crc32(name.encode()) % world == rank:
                out[name] = self._cast(value.detach())
        return out

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        dtype = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
        # in the background the trainer goes on changing its tensors in place: take a copy
        return t.to(device="cpu", dtype=dtype, copy=self.background)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _dtensor_slice(value: torch.Tensor, cast: Callable[[torch.Tensor], torch.Tensor]) -> Slice | None:
    """A DTensor's local shard as a Slice of the full tensor (None: not a DTensor).

    Shards of ``Shard(d)`` placements follow ``torch.chunk`` along ``d`` (what DTensor does);
    ``Replicate`` leaves a dimension whole, published once (by the lowest rank holding it).
    """
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # torch without the public DTensor module
        return None
    if not isinstance(value, DTensor):
        return None
    full = tuple(value.shape)
    offsets = [0] * len(full)
    mesh = value.device_mesh
    coords = mesh.get_coordinate()
    if coords is None:
        return Slice(cast(value.to_local()[tuple(slice(0, 0) for _ in full)]), tuple(offsets), full)
    # along each sharded dim, this rank's offset: the sizes of the chunks before it
    sizes = list(full)
    for mesh_dim, placement in enumerate(value.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard):
            raise UsageError(f"cannot publish a DTensor with placement {placement} (partial sums): reduce it first")
        d, n, i = placement.dim, mesh.size(mesh_dim), coords[mesh_dim]
        step = -(-sizes[d] // n)
        start = min(i * step, sizes[d])
        offsets[d] += start
        sizes[d] = max(0, min(step, sizes[d] - start))
    local = cast(value.to_local().detach())
    if tuple(local.shape) != tuple(sizes):  # padded or uneven layouts this arithmetic does not know
        raise UsageError(f"DTensor shard of shape {tuple(local.shape)} does not match the expected {tuple(sizes)}")
    return Slice(local.contiguous(), tuple(offsets), full)

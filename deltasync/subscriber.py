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
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterator
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
from .errors import ChecksumMismatchError, CorruptObjectError, DeltasyncError, ObjectNotFoundError
from .manifest import ManifestInfo, check_relpath
from .progress import Progress
from .repository import Repository
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
    for rel in new_files:
        dest = out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / rel, dest)
    if old is not None:
        for rel in set(old.files) - set(new_files):
            with contextlib.suppress(OSError, DeltasyncError):
                check_relpath(rel)
                (out / rel).unlink()
    shutil.rmtree(staging, ignore_errors=True)


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
        self.tensors = {i.version: i.tensors_by_name() for i in infos}

    def steps(self, name: str, idx: int, stop_at: int | None) -> tuple[list[tuple[ManifestInfo, pb.Chunk]], bool]:
        """Records needed for chunk ``idx`` of ``name``, newest first; True if they end at ``stop_at``."""
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

    def cost(self, stop_at: int | None) -> int:
        target = self.infos[-1]
        total = 0
        for t in target.pb.tensors:
            for idx in range(len(t.chunks)):
                steps, _ = self.steps(t.name, idx, stop_at)
                total += sum(c.length for _, c in steps)
        return total


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
        self, repo: str | Store | Repository, *, workers: int = 0, progress: bool | None = None
    ) -> None:
        self.repo = repo if isinstance(repo, Repository) else Repository(repo)
        self.workers = workers or os.cpu_count() or 1
        self.progress = progress
        self._mem_version: int | None = None
        self._mem_bits: dict[str, Bits] = {}
        self.last_plan: Plan | None = None

    # -- planning ----------------------------------------------------------------------------

    def plan(self, target: int, local: int | None) -> tuple[Plan, _Chain]:
        """The cheaper of: the chain from ``local``, or the nearest snapshot and its chain."""
        full_chain = _Chain(self.repo.chain(target))
        best = Plan(target, None, tuple(full_chain.by_version), full_chain.cost(None))
        chain = full_chain
        if local is not None and local <= target:
            with contextlib.suppress(DeltasyncError):
                inc = self.repo.chain(target, stop_at=local)
                if inc[0].version == local:
                    inc_chain = _Chain(inc)
                    cost = inc_chain.cost(local)
                    if cost <= best.fetch_bytes:
                        best = Plan(target, local, tuple(inc_chain.by_version), cost)
                        chain = inc_chain
        return best, chain

    # -- library -----------------------------------------------------------------------------

    def pull(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """The tensors of ``version`` (default: latest), bit-identical to what was published."""
        target = self.repo.resolve(version)
        info = self.repo.manifest(target)
        local: _LocalBits | None = None
        if self._mem_version is not None:
            bits = self._mem_bits

            def read_mem(name: str, off: int, length: int) -> Bits | None:
                arr = bits.get(name)
                return arr[off : off + length] if arr is not None and off + length <= arr.nbytes else None

            local = _LocalBits(self._mem_version, read_mem)
        out = {t.name: np.empty(t.nbytes, dtype=np.uint8) for t in info.pb.tensors}

        # Workers write straight into the output arrays: first touches of fresh memory then
        # happen in parallel, not one chunk at a time on the consuming thread.
        self._run(info, local, lambda t, off, data: None, dest=out)
        self._mem_version, self._mem_bits = target, out
        # The tensors share memory with the base of the next pull. That is safe: a caller who
        # changes them only costs that pull a repair, since every base chunk is digest-checked.
        return {t.name: bits_to_tensor(out[t.name], t.dtype, tuple(t.shape)) for t in info.pb.tensors}

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
            header, offsets = build_header([(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in held.pb.tensors])
            for t, o in zip(held.pb.tensors, offsets, strict=True):
                layout[t.name] = (root / LIBRARY_FILE, len(header) + o, t.nbytes)

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
        if not files:  # a version published from a state dict: one safetensors file
            header, offsets = build_header([(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in info.pb.tensors])
            files = [pb.File(path=LIBRARY_FILE, kind=pb.File.SAFETENSORS, header=header)]
            placement = {t.name: (LIBRARY_FILE, o) for t, o in zip(info.pb.tensors, offsets, strict=True)}
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
                digests[f.path] = StreamDigest()
                digests[f.path].update(f.header)

            header_len = {f.path: len(f.header) for f in files}

            def sink(t: pb.Tensor, off: int, data: Bits) -> None:
                fname, data_offset = placement[t.name]
                os.pwrite(fds[fname], data.data, header_len[fname] + data_offset + off)
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
    ) -> None:
        """Materialise every chunk of ``info`` in order: into ``dest`` arrays by tensor name
        (written by the workers), and through ``sink`` (called in order on this thread)."""
        plan, chain = self.plan(info.version, local.version if local is not None else None)
        self.last_plan = plan
        use_local = local if plan.base is not None else None
        snapshot_chain: list[_Chain] = [chain] if plan.base is None else []

        def full_chain() -> _Chain:
            if not snapshot_chain:
                snapshot_chain.append(_Chain(self.repo.chain(info.version)))
            return snapshot_chain[0]

        progress = Progress(f"pull v{info.version}", info.pb.raw_bytes, enabled=self.progress)
        codec = info.codec

        def job(t: pb.Tensor, idx: int, off: int, length: int) -> Bits:
            bits = materialise(t, idx, off, length)
            if dest is not None:
                dest[t.name][off : off + length] = bits
            return bits

        def materialise(t: pb.Tensor, idx: int, off: int, length: int) -> Bits:
            width = dtypes.element_width(t.dtype)
            target = t.chunks[idx]
            base: Bits | None = None
            steps: list[tuple[ManifestInfo, pb.Chunk]] | None = None
            if local is not None:
                held = local.read(t.name, off, length)
                if held is not None:
                    held_digest = digest(held)
                    if held_digest == target.target_digest:
                        return held  # already there (idempotent, resumable)
                    if use_local is not None:
                        inc, at_local = chain.steps(t.name, idx, use_local.version)
                        if at_local and inc and inc[-1][1].base_digest == held_digest:
                            base, steps = held, inc
            if steps is None:
                steps, _ = full_chain().steps(t.name, idx, None)
            return self._apply(t, idx, length, width, base, steps)

        def jobs() -> Iterator[tuple[pb.Tensor, int, Callable[[], Bits]]]:
            for t in info.pb.tensors:
                width = dtypes.element_width(t.dtype)
                for idx, (off, length) in enumerate(codec.chunk_ranges(t.nbytes, width)):
                    yield t, off, _bind(job, t, idx, off, length)

        window: deque[tuple[pb.Tensor, int, Future[Bits]]] = deque()
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="deltasync-pull") as pool:
            try:
                for t, off, fn in jobs():
                    window.append((t, off, pool.submit(fn)))
                    if len(window) >= 2 * self.workers:
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
    ) -> Bits:
        bits = base
        for info, c in reversed(steps):  # oldest first
            if c.encoding == SAME:
                continue  # bits are unchanged; the digest below still checks the final result
            pack = info.pb.packs[c.pack]
            where = f"version {info.version}, tensor {t.name!r}, chunk {idx} (pack {pack.key})"
            try:
                payload = self.repo.store.get(pack.key, (c.offset, c.length))
                bits = info.codec.decode(EncodedChunk(c.encoding, payload), bits, width, length)
            except CorruptObjectError as e:
                raise CorruptObjectError(where, e.detail) from None
            except ObjectNotFoundError:
                # A committed version names this pack: its absence is damage, as verify reports it.
                raise CorruptObjectError(where, "pack is missing") from None
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


def _bind(fn: Callable[[pb.Tensor, int, int, int], Bits], t: pb.Tensor, idx: int, off: int, length: int) -> Callable[[], Bits]:
    return lambda: fn(t, idx, off, length)

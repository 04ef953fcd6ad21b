"""The subscriber: brings a local copy (tensors in memory, or a directory) to a version.

The public face of the pull side. Planning is :mod:`~deltasync.pull.plan`, the chunk by
chunk work :mod:`~deltasync.pull.pipeline`, tensor and region requests
:mod:`~deltasync.pull.select`, and directory copies :mod:`~deltasync.local.slotfill`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..format.signing import PublicKeyLike
from ..format.slices import Region
from ..repo.repository import Repository, open_repository
from ..storage import Store
from .pipeline import ChunkPipeline, LocalBits
from .plan import Chain, Plan, Planner, Want
from .select import assemble, select_tensors

if TYPE_CHECKING:
    import torch

    from ..local.slotfill import FillResult

Bits = npt.NDArray[np.uint8]

__all__ = ["PulledState", "Subscriber", "state_url"]


def state_url(url: str) -> str:
    """A repository URL as recorded in a copy's state: plain paths made absolute."""
    return url if "://" in url or not url else os.path.abspath(url)


class PulledState(dict[str, "torch.Tensor"]):
    """The tensors a :meth:`Subscriber.pull` returned (a plain ``dict`` by tensor name), with
    the ``version`` they are and the ``plan`` the pull took (its path and stored bytes read)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, version: int, plan: Plan) -> None:
        super().__init__(tensors)
        self.version = version
        self.plan = plan

    def __reduce__(self) -> tuple[Any, ...]:
        # Saved (pickle, torch.save) as an OrderedDict of its tensors, what module.state_dict()
        # gives: torch.load(weights_only=True) and readers without deltasync load it.
        return (OrderedDict, (list(self.items()),))


class Subscriber:
    """Pulls versions from a repository.

    >>> state = Subscriber("./repo").pull(v)            # dict of tensors, bit-identical
    >>> Subscriber("./repo").pull_to_dir("./serving")    # the latest version, as files

    One subscriber remembers the tensors it last pulled (the base of its next pull), so share
    one between threads only for directory pulls, which keep their state in the directory.
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
        self.planner = Planner(self.repo)
        self.pipeline = ChunkPipeline(self.repo, self.planner, workers=self.workers, progress=progress)
        self._mem_version: int | None = None
        self._mem_bits: dict[str, Bits] = {}

    def plan(self, target: int, local: int | None, want: Want | None = None, *, squashes: bool = True) -> tuple[Plan, Chain]:
        """The cheapest way to ``target`` in stored bytes, from ``local`` or from a snapshot
        (see :meth:`deltasync.pull.plan.Planner.plan`)."""
        return self.planner.plan(target, local, want, squashes=squashes)

    # -- library -----------------------------------------------------------------------------

    def pull(
        self,
        version: int | None = None,
        *,
        tensors: Iterable[str] | None = None,
        regions: Mapping[str, Region] | None = None,
    ) -> PulledState:
        """Tensors of ``version`` (default: latest), bit-identical to what was published.

        By default every tensor; ``tensors`` pulls only those names and ``regions`` only a
        hyper-rectangle of a tensor (what one tensor-parallel inference rank holds), each
        fetching just the chunks that hold those bytes. Tensors published as slices by
        several ranks come back whole (parts no rank published read as zeros). The result is
        a dict by tensor name that also says which ``version`` it is and the ``plan`` taken.
        """
        target = self.repo.resolve(version)
        info = self.repo.manifest(target)
        local: LocalBits | None = None
        if self._mem_version is not None:
            bits = self._mem_bits

            def read_mem(key: str, off: int, length: int) -> Bits | None:
                arr = bits.get(key)
                return arr[off : off + length] if arr is not None and off + length <= arr.nbytes else None

            local = LocalBits(self._mem_version, read_mem)
        want, requests = select_tensors(info, tensors, regions)
        entries = info.entries()
        # np.empty commits no memory until touched: a partial pull costs only what it fills.
        out = {key: np.empty(entries[key].nbytes, dtype=np.uint8) for key in (want or entries)}
        # Workers write straight into the output arrays: first touches of fresh memory then
        # happen in parallel, not one chunk at a time on the consuming thread.
        plan = self.pipeline.run(info, local, _discard, dest=out, want=want)
        self._mem_version, self._mem_bits = target, out
        # The tensors share memory with the base of the next pull. That is safe: a caller who
        # changes them only costs that pull a repair, since every base chunk is digest-checked.
        return PulledState({name: assemble(req, out) for name, req in requests.items()}, version=target, plan=plan)

    # -- directories -------------------------------------------------------------------------

    def pull_to_dir(
        self,
        out: str | os.PathLike[str],
        version: int | None = None,
        *,
        stop: Callable[[], bool] | None = None,
        move_aside: bool = False,
        fsync: bool = False,
    ) -> int:
        """Alias of :meth:`update_dir` that returns only the version ``out`` now holds.

        One operation, two spellings: ``update_dir`` is the name the library and docs use;
        this one stays for the callers (docs/engines.md named it) that want the version alone."""
        return self.update_dir(out, version, stop=stop, move_aside=move_aside, fsync=fsync).version

    def update_dir(
        self,
        out: str | os.PathLike[str],
        version: int | None = None,
        *,
        stop: Callable[[], bool] | None = None,
        move_aside: bool = False,
        fsync: bool = False,
    ) -> FillResult:
        """Bring directory ``out`` to ``version`` (default: latest), in O(changed bytes).

        ``out`` keeps two slots of files (slots.py): the one not served is brought to the
        target in place (slotfill.py), every chunk written is verified, and one atomic
        switch serves it; on any error ``out`` keeps serving what it served. A fill that
        stops (an error, a kill, ``stop``) is resumed by the next pull, to any version.
        ``stop`` is asked between chunks; once it returns True the pull raises PullStopped.
        Files in ``out`` that are not the repository's are refused (UsageError naming them)
        or, with ``move_aside``, moved into ``out/.deltasync/aside/``. ``fsync`` flushes the
        slot to disk before the switch (else a copy is checked after a power loss). Another
        process changing ``out`` meanwhile gets CopyInUseError.
        """
        from ..local.slotfill import FillOptions, update_copy

        target = self.repo.resolve(version)
        info = self.repo.manifest(target)
        root = Path(out)
        root.mkdir(parents=True, exist_ok=True)
        return update_copy(self, root, info,
                           FillOptions(stop=stop, move_aside=move_aside, fsync=fsync, repo_url=state_url(self.repo.url)))

    def check(self, version: int) -> Plan:
        """Rebuild ``version`` chunk by chunk from its snapshot, verifying every step; output discarded."""
        return self.pipeline.run(self.repo.manifest(version), None, _discard, squashes=False)


def _discard(t: Any, off: int, data: Bits) -> None:
    """A sink for pulls whose output lands elsewhere (``dest`` arrays) or nowhere (checks)."""

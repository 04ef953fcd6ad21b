"""What a publisher is told (:class:`PublisherConfig`) and what it answers (:class:`PublishResult`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..format.codec import PlanesZstdCodec

if TYPE_CHECKING:
    from .squash import SquashResult


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """How versions are encoded and stored."""

    codec: PlanesZstdCodec = field(default_factory=PlanesZstdCodec)
    """Chunk codec and its parameters (recorded in every manifest)."""
    workers: int = 0
    """Encoding threads; 0 means one per CPU core."""
    snapshot_every: int = 20
    """Store every K-th version of a chain as a snapshot (the first version always is)."""
    max_delta_fraction: float = 0.5
    """A delta larger than this fraction of the last snapshot is stored as a snapshot instead."""
    pack_bytes: int = 64 << 20
    """Target size of one pack (the unit of upload and download)."""
    progress: bool | None = None
    """Show a progress line; None: only when stderr is a terminal."""
    skip_unchanged: bool = False
    """When the tensors, files and metadata equal the latest version's, commit nothing and
    return a result of kind ``unchanged`` naming that version (the command line's default)."""
    follow_symlinks: bool = False
    """``publish_dir``: publish files reached through symbolic links that lead out of the
    checkpoint directory or into other directories (a Hugging Face cache snapshot links into
    its ``blobs/``). Off: such a link is an error naming it. Dangling links and special files
    (FIFOs, sockets, devices) are errors either way."""
    squash_strides: tuple[int, ...] = ()
    """After committing version C, also store C as one delta from C - s for each stride s
    dividing C (a squash, see squash.py), when that is smaller than what a subscriber at
    C - s would fetch: far-behind subscribers then skip the versions in between. Each
    squash rebuilds the changed chunks of C - s from the repository, after the commit."""

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise UsageError(f"workers must be >= 0, got {self.workers}")
        if self.snapshot_every < 1:
            raise UsageError(f"snapshot_every must be >= 1, got {self.snapshot_every}")
        if not 0 < self.max_delta_fraction <= 10:
            raise UsageError(f"max_delta_fraction must be in (0, 10], got {self.max_delta_fraction}")
        if self.pack_bytes < 1 << 16:
            raise UsageError(f"pack_bytes must be at least 64 KiB, got {self.pack_bytes}")
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 2 for s in self.squash_strides):
            raise UsageError(f"squash_strides must be integers >= 2, got {self.squash_strides!r}")

    @property
    def threads(self) -> int:
        return self.workers or os.cpu_count() or 1


class PublishResult(int):
    """The version id a publish committed, with what it took.

    It *is* the id (an ``int``: ``v = pub.publish(state)`` and ``repo.manifest(v)`` work as
    they always did), and carries the details: ``kind`` is ``"snapshot"``, ``"delta"`` or
    ``"unchanged"`` (nothing committed: the id is the latest version's), ``parent``,
    ``raw_bytes`` and ``stored_bytes`` of the version, ``seconds`` from start to commit, the
    ``squashes`` written after the commit, and ``warnings``: problems after the commit that
    did not undo it (the publish cache could not be refreshed, say), each also logged.
    Returned per call, so one publisher shared by threads never mixes up whose figures are
    whose.
    """

    kind: str
    parent: int | None
    raw_bytes: int
    stored_bytes: int
    seconds: float
    squashes: tuple[SquashResult, ...]
    warnings: tuple[str, ...]

    def __new__(
        cls,
        version: int,
        *,
        kind: str,
        parent: int | None,
        raw_bytes: int,
        stored_bytes: int,
        seconds: float,
        squashes: Sequence[SquashResult] = (),
        warnings: Sequence[str] = (),
    ) -> PublishResult:
        if kind not in ("snapshot", "delta", "unchanged"):
            raise ValueError(f"unknown publish kind {kind!r}")
        self = super().__new__(cls, version)
        fields = {"kind": kind, "parent": parent, "raw_bytes": raw_bytes, "stored_bytes": stored_bytes,
                  "seconds": seconds, "squashes": tuple(squashes), "warnings": tuple(warnings)}
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"PublishResult is immutable (tried to set {name!r})")

    @property
    def version(self) -> int:
        return int(self)

    @property
    def ratio(self) -> float:
        """Raw bytes per stored byte (infinite when nothing was stored)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else float("inf")

    def with_squashes(self, squashes: Sequence[SquashResult]) -> PublishResult:
        return PublishResult(self.version, kind=self.kind, parent=self.parent, raw_bytes=self.raw_bytes,
                             stored_bytes=self.stored_bytes, seconds=self.seconds, squashes=squashes,
                             warnings=self.warnings)

    def with_warning(self, warning: str) -> PublishResult:
        return PublishResult(self.version, kind=self.kind, parent=self.parent, raw_bytes=self.raw_bytes,
                             stored_bytes=self.stored_bytes, seconds=self.seconds, squashes=self.squashes,
                             warnings=(*self.warnings, warning))

    def __str__(self) -> str:  # int's own text: f"version {result}" reads as before
        return str(int(self))

    def __repr__(self) -> str:
        return (f"PublishResult(version={int(self)}, kind={self.kind!r}, parent={self.parent}, "
                f"raw_bytes={self.raw_bytes}, stored_bytes={self.stored_bytes}, seconds={self.seconds:.3f})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (int(self), self.kind, self.parent, self.raw_bytes, self.stored_bytes, self.seconds,
                           self.squashes, self.warnings))


def _rebuild(version: int, kind: str, parent: int | None, raw: int, stored: int, seconds: float,
             squashes: tuple[SquashResult, ...], warnings: tuple[str, ...] = ()) -> PublishResult:
    return PublishResult(version, kind=kind, parent=parent, raw_bytes=raw, stored_bytes=stored, seconds=seconds,
                         squashes=squashes, warnings=warnings)

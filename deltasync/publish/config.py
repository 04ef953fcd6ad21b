"""What a publisher is told: :class:`PublisherConfig` (what it answers is :mod:`~deltasync.publish.result`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import UsageError
from ..format.codec import PlanesZstdCodec


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

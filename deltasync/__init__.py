"""deltasync: lossless, compressed weight deltas from an RL trainer to inference fleets."""

from __future__ import annotations

from .codec import PlanesZstdCodec
from .errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptObjectError,
    DeltasyncError,
    RepositoryNotFoundError,
    UsageError,
    VersionConflictError,
    VersionNotFoundError,
)
from .distributed import DistributedPublisher, DistributedPublishError
from .publisher import Publisher, PublisherConfig, PublishResult
from .repository import Repository
from .slices import Region, Slice
from .subscriber import Subscriber

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ChecksumMismatchError",
    "CorruptObjectError",
    "DeltasyncError",
    "DistributedPublishError",
    "DistributedPublisher",
    "PlanesZstdCodec",
    "PublishResult",
    "Publisher",
    "PublisherConfig",
    "Region",
    "Repository",
    "RepositoryNotFoundError",
    "Slice",
    "Subscriber",
    "UsageError",
    "VersionConflictError",
    "VersionNotFoundError",
]

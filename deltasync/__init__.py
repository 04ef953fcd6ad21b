"""deltasync: lossless, compressed weight deltas from an RL trainer to inference fleets.

The public names below are imported on first use, so that ``deltasync --help`` and other
light entry points do not pay for numpy, zstd and friends.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Agent": "agent",
    "AgentConfig": "agent",
    "rollback": "agent",
    "PlanesZstdCodec": "codec",
    "DistributedPublishError": "distributed",
    "DistributedPublisher": "distributed",
    "CheckpointError": "errors",
    "ChecksumMismatchError": "errors",
    "CorruptObjectError": "errors",
    "DeltasyncError": "errors",
    "RepositoryNotFoundError": "errors",
    "SignatureError": "errors",
    "UsageError": "errors",
    "VersionConflictError": "errors",
    "VersionNotFoundError": "errors",
    "PublishResult": "publisher",
    "Publisher": "publisher",
    "PublisherConfig": "publisher",
    "Repository": "repository",
    "Region": "slices",
    "Slice": "slices",
    "Subscriber": "subscriber",
}

__all__ = [
    "Agent",
    "AgentConfig",
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
    "SignatureError",
    "Slice",
    "Subscriber",
    "UsageError",
    "VersionConflictError",
    "VersionNotFoundError",
    "rollback",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deltasync' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"deltasync.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from .agent import Agent, AgentConfig, rollback
    from .codec import PlanesZstdCodec
    from .distributed import DistributedPublisher, DistributedPublishError
    from .errors import (
        CheckpointError,
        ChecksumMismatchError,
        CorruptObjectError,
        DeltasyncError,
        RepositoryNotFoundError,
        SignatureError,
        UsageError,
        VersionConflictError,
        VersionNotFoundError,
    )
    from .publisher import Publisher, PublisherConfig, PublishResult
    from .repository import Repository
    from .slices import Region, Slice
    from .subscriber import Subscriber

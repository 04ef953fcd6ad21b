"""deltasync: lossless, compressed weight deltas from an RL trainer to inference fleets.

The public names below are imported on first use, so that ``deltasync --help`` and other
light entry points do not pay for numpy, zstd and friends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _aliases, _extras

__version__ = "0.1.0"

_aliases.install()  # old flat module names (deltasync.gc, deltasync.subscriber, ...) still import

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Agent": "agent",
    "AgentConfig": "agent",
    "rollback": "agent",
    "PlanesZstdCodec": "format.codec",
    "DistributedPublisher": "publish.distributed",
    "CheckpointError": "errors",
    "ChecksumMismatchError": "errors",
    "CorruptObjectError": "errors",
    "DeltasyncError": "errors",
    "RepositoryNotFoundError": "errors",
    "SignatureError": "errors",
    "UsageError": "errors",
    "VersionConflictError": "errors",
    "VersionNotFoundError": "errors",
    "PublishResult": "publish.publisher",
    "Publisher": "publish.publisher",
    "PublisherConfig": "publish.publisher",
    "Repository": "repo.repository",
    "Region": "format.slices",
    "Slice": "format.slices",
    "Subscriber": "pull.subscriber",
    "RepositoryFormatError": "errors",
    "EmptyRepositoryError": "errors",
    "ObjectNotFoundError": "errors",
    "ObjectExistsError": "errors",
    "ObjectTooLargeError": "errors",
    "StoreError": "errors",
    "CommittedError": "errors",
    "RefError": "errors",
    "MissingDependencyError": "errors",
    "CopyInUseError": "errors",
    "PullStopped": "errors",
    "DistributedPublishError": "errors",
    "EngineError": "errors",
    "StaleUpdateError": "errors",
    "GroupError": "errors",
    "WorkerError": "errors",
    "FeedbackError": "errors",
    "PulledState": "pull.subscriber",
}

__all__ = [
    "Agent",
    "AgentConfig",
    "CheckpointError",
    "ChecksumMismatchError",
    "CommittedError",
    "CopyInUseError",
    "CorruptObjectError",
    "DeltasyncError",
    "DistributedPublishError",
    "DistributedPublisher",
    "EmptyRepositoryError",
    "EngineError",
    "FeedbackError",
    "GroupError",
    "MissingDependencyError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "PlanesZstdCodec",
    "PublishResult",
    "Publisher",
    "PublisherConfig",
    "PullStopped",
    "PulledState",
    "RefError",
    "Region",
    "Repository",
    "RepositoryFormatError",
    "RepositoryNotFoundError",
    "SignatureError",
    "Slice",
    "StaleUpdateError",
    "StoreError",
    "Subscriber",
    "UsageError",
    "VersionConflictError",
    "VersionNotFoundError",
    "WorkerError",
    "rollback",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deltasync' has no attribute {name!r}")
    value = getattr(_extras.import_needing_extras(f"deltasync.{module}", f"deltasync.{name}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from .agent import (
        Agent,
        AgentConfig,
        rollback,
    )
    from .errors import (
        CheckpointError,
        ChecksumMismatchError,
        CommittedError,
        CopyInUseError,
        CorruptObjectError,
        DeltasyncError,
        DistributedPublishError,
        EmptyRepositoryError,
        EngineError,
        FeedbackError,
        GroupError,
        MissingDependencyError,
        ObjectExistsError,
        ObjectNotFoundError,
        ObjectTooLargeError,
        PullStopped,
        RefError,
        RepositoryFormatError,
        RepositoryNotFoundError,
        SignatureError,
        StaleUpdateError,
        StoreError,
        UsageError,
        VersionConflictError,
        VersionNotFoundError,
        WorkerError,
    )
    from .format.codec import (
        PlanesZstdCodec,
    )
    from .format.slices import (
        Region,
        Slice,
    )
    from .publish.distributed import (
        DistributedPublisher,
    )
    from .publish.publisher import (
        Publisher,
        PublisherConfig,
        PublishResult,
    )
    from .pull.subscriber import (
        PulledState,
        Subscriber,
    )
    from .repo.repository import (
        Repository,
    )

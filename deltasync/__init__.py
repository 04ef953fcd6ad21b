"""deltasync: lossless, compressed weight deltas from an RL trainer to inference fleets.

The public names below are imported on first use (:mod:`deltasync._lazy`), so that
``deltasync --help`` and other light entry points do not pay for numpy, zstd and friends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _lazy

__version__ = "0.1.0"

#: public name -> the module that defines it: the only list of these names
_LAZY: _lazy.Table = {
    "CheckpointError": "errors",
    "ChecksumMismatchError": "errors",
    "CommittedError": "errors",
    "CopyInUseError": "errors",
    "CorruptObjectError": "errors",
    "DeltasyncError": "errors",
    "DistributedPublishError": "errors",
    "EmptyRepositoryError": "errors",
    "EngineError": "errors",
    "GroupError": "errors",
    "HistoryError": "errors",
    "InjectedFailure": "errors",
    "MissingDependencyError": "errors",
    "MissingReferencesError": "errors",
    "ObjectExistsError": "errors",
    "ObjectNotFoundError": "errors",
    "ObjectRangeError": "errors",
    "ObjectTooLargeError": "errors",
    "PullStopped": "errors",
    "RefError": "errors",
    "RepositoryFormatError": "errors",
    "RepositoryIdentityError": "errors",
    "RepositoryNotFoundError": "errors",
    "SignatureError": "errors",
    "SparseVerifyError": "errors",
    "StaleUpdateError": "errors",
    "StoreError": "errors",
    "UsageError": "errors",
    "VersionConflictError": "errors",
    "VersionNotFoundError": "errors",
    "PlanesZstdCodec": "format.codec",
    "Region": "format.slices",
    "Slice": "format.slices",
    "Repository": "repo.repository",
    "PublishResult": "publish.publisher",
    "Publisher": "publish.publisher",
    "PublisherConfig": "publish.publisher",
    "DistributedPublisher": "publish.distributed",
    "PulledState": "pull.subscriber",
    "Subscriber": "pull.subscriber",
    "Agent": "agents.directory",
    "AgentConfig": "agents.config",
    "EngineAgent": "agents.engine",
    "rollback": "agents.directory",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = _lazy.exports(__name__, _LAZY, globals())

if TYPE_CHECKING:  # the same names for type checkers (tests/test_structure.py keeps the two equal)
    from .agents.config import AgentConfig as AgentConfig
    from .agents.directory import (
        Agent as Agent,
        rollback as rollback,
    )
    from .agents.engine import EngineAgent as EngineAgent
    from .errors import (
        CheckpointError as CheckpointError,
        ChecksumMismatchError as ChecksumMismatchError,
        CommittedError as CommittedError,
        CopyInUseError as CopyInUseError,
        CorruptObjectError as CorruptObjectError,
        DeltasyncError as DeltasyncError,
        DistributedPublishError as DistributedPublishError,
        EmptyRepositoryError as EmptyRepositoryError,
        EngineError as EngineError,
        GroupError as GroupError,
        HistoryError as HistoryError,
        InjectedFailure as InjectedFailure,
        MissingDependencyError as MissingDependencyError,
        MissingReferencesError as MissingReferencesError,
        ObjectExistsError as ObjectExistsError,
        ObjectNotFoundError as ObjectNotFoundError,
        ObjectRangeError as ObjectRangeError,
        ObjectTooLargeError as ObjectTooLargeError,
        PullStopped as PullStopped,
        RefError as RefError,
        RepositoryFormatError as RepositoryFormatError,
        RepositoryIdentityError as RepositoryIdentityError,
        RepositoryNotFoundError as RepositoryNotFoundError,
        SignatureError as SignatureError,
        SparseVerifyError as SparseVerifyError,
        StaleUpdateError as StaleUpdateError,
        StoreError as StoreError,
        UsageError as UsageError,
        VersionConflictError as VersionConflictError,
        VersionNotFoundError as VersionNotFoundError,
    )
    from .format.codec import (
        PlanesZstdCodec as PlanesZstdCodec,
    )
    from .format.slices import (
        Region as Region,
        Slice as Slice,
    )
    from .publish.distributed import (
        DistributedPublisher as DistributedPublisher,
    )
    from .publish.publisher import (
        Publisher as Publisher,
        PublisherConfig as PublisherConfig,
        PublishResult as PublishResult,
    )
    from .pull.subscriber import (
        PulledState as PulledState,
        Subscriber as Subscriber,
    )
    from .repo.repository import (
        Repository as Repository,
    )

"""How an agent follows a repository (:class:`AgentConfig`), what it reports of each move
(:class:`Update`), and the errors no retry fixes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import (
    CheckpointError,
    EmptyRepositoryError,
    RefError,
    RepositoryFormatError,
    RepositoryIdentityError,
    RepositoryNotFoundError,
    SignatureError,
    UsageError,
)
from ..local import CopyInUseError

if TYPE_CHECKING:
    from ..engines.base import SwapRecord

#: Errors no retry can fix: a one-shot run fails at once (a following agent still waits them out).
PERMANENT = (UsageError, CopyInUseError, SignatureError, RefError, RepositoryFormatError, CheckpointError,
             RepositoryIdentityError)
FINAL = (*PERMANENT, EmptyRepositoryError, RepositoryNotFoundError)


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """How an agent follows a repository."""

    poll_interval: float = 0.5
    """Seconds between reads of the repository's ``refs/latest`` and ``refs/pin``."""
    relist_interval: float = 30.0
    """Seconds between listings of the committed versions (the latest ref is only a hint:
    a publisher may die between its manifest and the ref)."""
    retries: int = 5
    """Attempts of one update before a one-shot run gives up (a following agent keeps trying)."""
    backoff_initial: float = 0.5
    """First wait after a failure, in seconds; doubles per failure, with jitter."""
    backoff_max: float = 30.0
    """Longest wait between attempts, in seconds."""
    keep_versions: int = 8
    """Versions whose manifests and delta payloads the copy keeps: a rollback of up to this
    many versions, or a return to them, reads nothing from the repository (0: keep none)."""
    workers: int = 0
    """Decoding threads; 0 means one per CPU core."""
    progress: bool | None = False
    """Progress lines while pulling (None: on a terminal)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics at ``http://metrics_host:metrics_port/metrics`` (0: any free port)."""
    metrics_host: str = ""
    """Address to serve metrics on ("": every interface, as exporters do)."""
    move_aside: bool = False
    """Move files found in the directory that are not the repository's into
    ``DIR/.deltasync/aside/`` (default: refuse to update, naming them)."""
    fsync: bool = False
    """Flush each version's slot to disk before switching to it (default: check the copy
    after a power loss instead; see slots.py)."""
    ref_grace: float = 0.0
    """With trusted keys: seconds past a signed ref's expiry during which it is still
    followed, with a warning (a quiet publisher late with ``deltasync refresh-refs``);
    beyond that the agent refuses it and stays on its version, recording the error."""

    def __post_init__(self) -> None:
        if not 0.01 <= self.poll_interval <= 3600:
            raise UsageError(f"poll_interval must be in 0.01..3600 seconds, got {self.poll_interval}")
        if self.retries < 1:
            raise UsageError(f"retries must be at least 1, got {self.retries}")
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise UsageError("backoff_initial must be positive and at most backoff_max")
        if self.keep_versions < 0:
            raise UsageError(f"keep_versions must not be negative, got {self.keep_versions}")
        if not self.ref_grace >= 0:
            raise UsageError(f"ref_grace must not be negative, got {self.ref_grace}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise UsageError(f"metrics_port must be in 0..65535, got {self.metrics_port}")


@dataclass(frozen=True)
class Update:
    """One move of the copy, as reported to ``on_update`` and kept in the status."""

    version: int
    previous: int | None
    how: str  # "pull from version N", "pull from a snapshot", "local: N chunks walked, M fetched"
    fetched_bytes: int
    seconds: float
    swap: SwapRecord | None = None
    """The engine's record of its swap (agents with an engine; None: it already served the version)."""



__all__ = ["FINAL", "PERMANENT", "AgentConfig", "Update"]

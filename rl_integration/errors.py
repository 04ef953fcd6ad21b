"""The reference RL loop's errors; the library's own are in :mod:`deltasync.errors`, whose
hierarchy these join (a worker failure is a DeltasyncError, bad feedback a UsageError)."""

from __future__ import annotations

from ..errors import DeltasyncError, UsageError


class WorkerError(DeltasyncError):
    """A rollout worker failed; ``detail`` holds its traceback (None: it exited without one)."""

    def __init__(self, worker: int | None, detail: str | None) -> None:
        if worker is None:
            message = "a rollout worker exited without reporting an error (killed?)"
        else:
            last = detail.strip().splitlines()[-1] if detail and detail.strip() else "no detail"
            message = f"rollout worker {worker} failed: {last}"
        super().__init__(message)
        self.worker = worker
        self.detail = detail


class FeedbackError(UsageError):
    """Feedback that cannot be joined; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status

"""The one jittered exponential backoff every retry loop uses (agents, S3 requests)."""

from __future__ import annotations

import random
import time


class Backoff:
    """Waits of ``initial``, 2x, 4x, ... seconds, capped at ``cap``, each scaled by a random
    factor in ``[low, 1]`` so that many clients retrying together spread out (``low=0`` is
    "full jitter", ``low=0.5`` "equal jitter"). :meth:`reset` after a success."""

    def __init__(self, initial: float, cap: float, *, low: float = 0.5, rng: random.Random | None = None) -> None:
        if not 0 < initial <= cap:
            raise ValueError(f"backoff needs 0 < initial <= cap, got {initial} and {cap}")
        if not 0 <= low <= 1:
            raise ValueError(f"backoff jitter floor must be in [0, 1], got {low}")
        self.initial = initial
        self.cap = cap
        self.low = low
        self.failures = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        """The wait after one more failure."""
        delay = min(self.cap, self.initial * 2 ** min(self.failures, 62))
        self.failures += 1
        return float(delay * self._rng.uniform(self.low, 1.0))

    def sleep(self) -> None:
        time.sleep(self.next())

    def reset(self) -> None:
        self.failures = 0

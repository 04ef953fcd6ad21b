"""What a publish answers: :class:`PublishResult`, the version id with what it took."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .squash import SquashResult


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

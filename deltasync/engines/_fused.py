"""One scatter for all sparse writes of a swap on a GPU.

Writing each tensor's changes with its own ``scatter_`` costs a kernel launch per tensor:
for a model of a few hundred tensors that fixed cost (about 10 µs each) is most of the
pause, and the pause no longer grows with the bytes that changed. Staging therefore joins
every sparse write on a device (and every small rewritten run, as positions) into one
list of word positions relative to the lowest-addressed tensor of the group, and the
pause is a single ``scatter_`` into a *span*: a tensor that views the device memory from
that tensor to the end of the highest one. Positions only ever point inside the tensors
the engine holds; the span is never read, and bytes between the tensors are never
touched. The span holds no memory of its own; each fused scatter keeps the tensors it views alive.

The old values are kept on the host (as for per-tensor writes), so a failed write can be
undone with the same kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .torch_engine import TensorWrite

#: Rewritten runs up to this many words join the scatter (as positions) instead of a copy each.
SMALL_RUN = 1 << 16

_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


class _DeviceMemory:
    """Describes device memory to ``torch.as_tensor`` (CUDA array interface, version 3)."""

    def __init__(self, ptr: int, count: int, width: int) -> None:
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (count,), "typestr": _TYPESTR[width], "data": (ptr, False), "version": 3, "strides": None,
        }


def span_view(tensors: Sequence[torch.Tensor], width: int) -> tuple[torch.Tensor, int]:
    """A flat view of words of ``width`` bytes from the lowest-addressed of ``tensors`` (all on
    one CUDA device) to the end of the highest, and the base address."""
    import torch

    lo = min(t.data_ptr() for t in tensors)
    hi = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    device = tensors[0].device
    span = torch.as_tensor(_DeviceMemory(lo, (hi - lo) // width, width), device=device)
    if span.data_ptr() != lo or span.device != device:  # torch must view the memory, never copy it
        raise RuntimeError("torch copied device memory instead of viewing it")
    return span, lo


@dataclass
class FusedScatter:
    """The sparse writes of one device and word width, as one scatter into a span."""

    span: torch.Tensor
    positions: torch.Tensor  # int64 word positions in ``span``, on the device
    new: torch.Tensor
    old: torch.Tensor  # on the host, for an undo
    owners: list[torch.Tensor]  # the tensors the span views: kept alive as long as it is

    @property
    def nbytes(self) -> int:
        return self.new.numel() * self.new.element_size()

    def warm(self) -> None:
        """Run the kernel once before the pause (its first launch loads it, which can take
        milliseconds), into a scratch word: nothing served is touched."""
        scratch = self.new.new_zeros(1)
        scratch.scatter_(0, self.positions[:1] * 0, self.new[:1])

    def apply(self) -> None:
        self.span.scatter_(0, self.positions, self.new)

    def undo(self) -> None:
        self.span.scatter_(0, self.positions, self.old.to(self.span.device))


def fuse_writes(writes: list[TensorWrite]) -> list[FusedScatter]:
    """Move the sparse writes (and small rewritten runs) of ``writes`` on CUDA devices into
    one :class:`FusedScatter` per device and word width; what stays in ``writes`` is the
    copies of large rewritten runs. Groups of a single sparse tensor are left as they are."""
    import torch

    groups: dict[tuple[torch.device, int], list[TensorWrite]] = {}
    for w in writes:
        if w.words.device.type == "cuda":
            groups.setdefault((w.words.device, w.words.element_size()), []).append(w)
    fused: list[FusedScatter] = []
    for (device, width), group in groups.items():
        # Positions count whole words from the lowest address: every tensor must sit on a word boundary.
        base = min(w.words.data_ptr() for w in group)
        group = [w for w in group if (w.words.data_ptr() - base) % width == 0]
        pieces = sum((w.idx is not None) + sum(new.numel() <= SMALL_RUN for _, new, _ in w.dense) for w in group)
        if pieces < 2:
            continue
        try:
            span, base = span_view([w.words for w in group], width)
        except (RuntimeError, TypeError, ValueError):
            continue  # a build of torch that cannot view device memory this way: per-tensor writes
        positions: list[torch.Tensor] = []
        new: list[torch.Tensor] = []
        old: list[torch.Tensor] = []
        for w in group:
            first = (w.words.data_ptr() - base) // width
            if w.idx is not None and w.new is not None and w.old is not None:
                positions.append(w.idx + first)
                new.append(w.new)
                old.append(w.old)
                w.idx = w.new = w.old = None
            keep = []
            for start, values, before in w.dense:
                if values.numel() > SMALL_RUN or before is None:
                    keep.append((start, values, before))
                    continue
                positions.append(torch.arange(first + start, first + start + values.numel(), device=device))
                new.append(values)
                old.append(before)
            w.dense = keep
        scatter = FusedScatter(span, torch.cat(positions), torch.cat(new), torch.cat(old), [w.words for w in group])
        scatter.warm()
        fused.append(scatter)
    return fused

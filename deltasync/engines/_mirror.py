"""A host mirror of the bits of tensors held on a device, and writes to the device in O(changed).

Without it, staging for a tensor on a GPU reads every chunk it diffs from the device (a
device->host copy of each touched chunk: at 1% random changes, about the whole model per
version), and sends positions to the device as int64. With a mirror, the base bits are read
from host memory (pinned, on CUDA), the changes decoded against them there, and only what
changed crosses to the device, in the same pause's staging: values, and positions compacted
as runs of 65,536-word blocks (a block index and a count per run, then 16 bits per
position), expanded to int64 on the device. The mirror is brought to each version after its
swap, from the same host runs.

A mirror trusts that nothing wrote the device's copy behind the engine: the engine is the
only writer of served weights. The live check (``TorchEngine.verify``, ``deltasync check
--state``) hashes the device's bits, not the mirror's, against the manifest's digests; where
it finds drift it copies the drifted tensors back into the mirror (:meth:`HostMirror.refresh`),
so that the restage an agent then runs (``update(force=True)``) sees the drift and rewrites it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

BLOCK_BITS = 16


def compact_positions(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Word positions as ``(blocks, counts, low)``: runs of positions in one 65,536-word block
    (the block's index, int32, and how many, int32), and each position's low 16 bits (int16),
    in the order given."""
    idx = np.asarray(idx, dtype=np.int64)
    if not idx.size:
        empty = np.zeros(0, dtype=np.int32)
        return empty, empty, np.zeros(0, dtype=np.int16)
    hi = idx >> BLOCK_BITS
    starts = np.flatnonzero(np.concatenate(([True], hi[1:] != hi[:-1])))
    counts = np.diff(np.append(starts, idx.size)).astype(np.int32)
    blocks = hi[starts].astype(np.int32)
    low = (idx & ((1 << BLOCK_BITS) - 1)).astype(np.uint16).view(np.int16)
    return blocks, counts, low


def expand_positions(blocks: torch.Tensor, counts: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The int64 positions of :func:`compact_positions`' output, computed where the tensors are."""
    import torch

    base = torch.repeat_interleave(blocks.long() << BLOCK_BITS, counts.long(), output_size=low.numel())
    return base + (low.int() & ((1 << BLOCK_BITS) - 1)).long()


class HostMirror:
    """Host copies (pinned on CUDA) of the words of the named device tensors."""

    def __init__(self, words: Mapping[str, torch.Tensor]) -> None:
        import torch

        self.words: dict[str, torch.Tensor] = {}
        for name, w in words.items():
            host = torch.empty(w.shape, dtype=w.dtype, pin_memory=w.device.type == "cuda")
            host.copy_(w)
            self.words[name] = host
        self._arrays = {name: h.numpy() for name, h in self.words.items()}

    def __contains__(self, name: object) -> bool:
        return name in self.words

    def array(self, name: str) -> np.ndarray:
        """The words of ``name`` as a numpy array (shares memory)."""
        return self._arrays[name]

    def refresh(self, words: Mapping[str, torch.Tensor]) -> None:
        """Copy the device's bits again (after a check found them changed behind the engine)."""
        for name, w in words.items():
            if name in self.words:
                self.words[name].copy_(w)

    def apply(self, writes: Iterable[tuple[str, np.ndarray | None, np.ndarray | None, list[tuple[int, np.ndarray]]]]) -> None:
        """Bring the mirror to the version just swapped in: ``(name, positions, values, dense)``."""
        for name, idx, new, dense in writes:
            arr = self._arrays[name]
            if idx is not None and new is not None:
                arr[idx] = new
            for start, values in dense:
                arr[start : start + values.size] = values


__all__ = ["BLOCK_BITS", "HostMirror", "compact_positions", "expand_positions"]

"""Where torch tensors enter and leave: raw bit patterns as flat uint8 numpy arrays."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .._extras import require
from . import dtypes

if TYPE_CHECKING:
    import torch


def tensor_bits(t: torch.Tensor) -> npt.NDArray[np.uint8]:
    """The raw bytes of ``t`` (any dtype, any device, contiguous or not) as flat uint8.

    The result may share memory with ``t`` when it is a contiguous CPU tensor.
    """
    require("torch", "tensors")  # a missing torch is named as the extra to install
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.view(torch.uint8).numpy()


def bits_to_tensor(bits: npt.NDArray[np.uint8], dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor of ``dtype`` and ``shape`` whose bytes are ``bits`` (taken over, not copied)."""
    require("torch", "tensors")  # a missing torch is named as the extra to install
    import torch

    tdtype = dtypes.to_torch(dtype)
    if bits.size == 0:
        return torch.empty(shape, dtype=tdtype)
    flat = torch.from_numpy(np.ascontiguousarray(bits))
    return flat.view(tdtype).reshape(shape)

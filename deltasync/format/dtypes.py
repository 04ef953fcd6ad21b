"""Element types: safetensors dtype names, their widths, and the torch mapping.

The codec sees only bytes and an element width; the dtype decides the width (and so the
byte-plane split). Names follow safetensors where it has one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:
    import torch

#: dtype name -> bytes per element
ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C32": 4,
    "C64": 8,
    "F4_E2M1_X2": 1,
    "BITS8": 1,
    "BITS16": 2,
    "BITS1X8": 1,
    "BITS2X4": 1,
    "BITS4X2": 1,
    # 16-byte complex numbers are coded as pairs of 8-byte elements.
    "C128": 16,
}

def element_width(dtype: str) -> int:
    """Codec element width (1, 2, 4 or 8) for a dtype."""
    return min(itemsize(dtype), 8)


def itemsize(dtype: str) -> int:
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise UsageError(f"unsupported dtype {dtype!r}") from None


_TORCH_NAMES: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
    "complex32": "C32",
    "complex64": "C64",
    "float4_e2m1fn_x2": "F4_E2M1_X2",
    "bits8": "BITS8",
    "bits16": "BITS16",
    "bits1x8": "BITS1X8",
    "bits2x4": "BITS2X4",
    "bits4x2": "BITS4X2",
    "complex128": "C128",
}


def from_torch(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    try:
        return _TORCH_NAMES[name]
    except KeyError:
        raise UsageError(f"unsupported torch dtype {dtype}") from None


def to_torch(dtype: str) -> torch.dtype:
    from .._extras import require

    require("torch", "tensors")  # a missing torch is named as the extra to install
    import torch

    for tname, dname in _TORCH_NAMES.items():
        if dname == dtype:
            found = getattr(torch, tname, None)
            if found is not None:
                return found  # type: ignore[no-any-return]
    raise UsageError(f"dtype {dtype!r} has no torch equivalent in this torch build")

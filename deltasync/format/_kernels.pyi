"""Type stub of the C extension ``deltasync.format._kernels`` (source: ``_kernels.c``; pure-numpy twin:
``_kernels_py.py``, which documents the same functions)."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

_Data = bytes | memoryview | npt.NDArray[np.uint8]

def scan(
    target: _Data, base: _Data, width: int, limit: int, /
) -> tuple[int, bytes | None, bytes | None, bytes | None]: ...
def scan_sampled(
    target: _Data, base: _Data, width: int, limit: int, /
) -> tuple[int, bytes | None, bytes | None, bytes | None, bytes]: ...
def rice_encode(indices: _Data, /) -> tuple[int, bytes]: ...
def rice_decode(data: _Data, count: int, k: int, n: int, /) -> bytes: ...
def pack2(target_values: _Data, base_values: _Data, width: int, /) -> tuple[bytes, int, bytes, bytes]: ...
def unpack2(symbols: _Data, count: int, k: int, prefix: _Data, suffix: _Data, width: int, /) -> bytes: ...
def scatter(
    out: npt.NDArray[np.uint8], base: _Data | None, indices: _Data, values: _Data, width: int, transform: int, /
) -> None: ...
def apply2(
    out: npt.NDArray[np.uint8], base: _Data | None, indices: _Data, symbols: _Data, k: int, prefix: _Data,
    suffix: _Data, width: int, /,
) -> None: ...

simd: str
"""The compare instructions the scan uses: "avx512bw", "sse2" or "none" (chosen at import)."""
def class_thresholds(base: _Data, width: int, values: _Data, max_classes: int, overhead_bits: int, /) -> bytes: ...
def class_thresholds_sampled(
    sample: _Data, width: int, values: _Data, max_classes: int, overhead_bits: int, /
) -> bytes: ...
def class_encode(
    base: _Data, width: int, thresholds: _Data, indices: _Data, target_values: _Data, base_values: _Data, /
) -> tuple[bytes, bytes, bytes, bytes, tuple[tuple[int, bytes, bytes | None], ...]]: ...
def class_select(
    base: _Data, width: int, thresholds: _Data, counts: _Data, heads: _Data, streams: Sequence[_Data], values: _Data, /
) -> tuple[bytes, bytes]: ...

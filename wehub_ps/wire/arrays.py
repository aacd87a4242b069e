"""Tensors as wire bytes: flat little-endian arrays, their byte views, and chunking.

The wire carries every tensor as the little-endian bytes of a flat array,
cut into chunks of whole elements. These helpers make and read such views
without copying when the array already has that layout (the common case).
"""

from __future__ import annotations

import sys

import numpy as np

from wehub_ps.wire.dtypes import to_numpy_dtype
from wehub_ps.wire.protowire import CodecError

__all__ = ["as_wire_array", "chunk_view", "chunk_ranges", "byte_view"]

_LITTLE_ENDIAN_HOST = sys.byteorder == "little"


def as_wire_array(array: np.ndarray, wire_dtype: np.dtype | None = None) -> np.ndarray:
    """A flat, C-contiguous, little-endian array ready to be viewed as bytes.

    No copy when the input already is one (the common case); a converted copy
    otherwise (non-contiguous, big-endian, or a narrower ``wire_dtype``).
    """
    if wire_dtype is None and _LITTLE_ENDIAN_HOST and array.dtype.isnative and array.flags.c_contiguous:
        return array.reshape(-1)  # the common case, decided in a few attribute reads
    target = np.dtype(wire_dtype) if wire_dtype is not None else array.dtype
    if target.byteorder == ">" or (target.byteorder == "=" and target.itemsize > 1):
        target = target.newbyteorder("<")
    flat = array.reshape(-1) if array.flags.c_contiguous else np.ravel(array, order="C")
    if flat.dtype != target:
        flat = flat.astype(target)
    return np.ascontiguousarray(flat)


def chunk_view(data: memoryview, wire_dtype: int, count: int) -> np.ndarray:
    """View ``count`` elements of a wire dtype in ``data``; CodecError on size mismatch."""
    try:
        dtype = to_numpy_dtype(wire_dtype)
    except ValueError as exc:
        raise CodecError(str(exc)) from None
    if data.nbytes != count * dtype.itemsize:
        raise CodecError(
            f"chunk carries {data.nbytes} bytes, but {count} elements of "
            f"{dtype.name} need {count * dtype.itemsize}"
        )
    return np.frombuffer(data, dtype=dtype, count=count)


def chunk_ranges(total: int, chunk_elements: int) -> list[tuple[int, int]]:
    """(offset, count) covering ``total`` elements; one empty range when total is 0.

    A list, not a generator: most variables of a step are one chunk, and
    resuming a generator cost more than the list of one range.
    """
    if chunk_elements <= 0:
        raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
    if total <= chunk_elements:
        return [(0, total)]
    return [(offset, min(chunk_elements, total - offset)) for offset in range(0, total, chunk_elements)]


def byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array as a flat memoryview (no copy).

    Goes through a uint8 view because dtypes such as bfloat16 have no
    buffer-protocol format of their own.
    """
    return memoryview(array.reshape(-1).view(np.uint8))


"""Mapping between wire DataType values and numpy dtypes (every one little-endian)."""

from __future__ import annotations

import numpy as np

from wehub_ps.dtypes import BFLOAT16
from wehub_ps.v1 import ps_pb2

__all__ = ["WIRE_TO_NUMPY", "to_numpy_dtype", "to_wire_dtype"]

#: Wire DataType -> numpy dtype; every dtype is little-endian on the wire.
WIRE_TO_NUMPY: dict[int, np.dtype] = {
    ps_pb2.FLOAT32: np.dtype("<f4"),
    ps_pb2.FLOAT64: np.dtype("<f8"),
    ps_pb2.FLOAT16: np.dtype("<f2"),
    ps_pb2.BFLOAT16: BFLOAT16,
    ps_pb2.INT8: np.dtype("i1"),
    ps_pb2.INT16: np.dtype("<i2"),
    ps_pb2.INT32: np.dtype("<i4"),
    ps_pb2.INT64: np.dtype("<i8"),
    ps_pb2.UINT8: np.dtype("u1"),
    ps_pb2.UINT16: np.dtype("<u2"),
    ps_pb2.UINT32: np.dtype("<u4"),
    ps_pb2.UINT64: np.dtype("<u8"),
    ps_pb2.BOOL: np.dtype("?"),
}
_NUMPY_TO_WIRE: dict[np.dtype, int] = {dt: wire for wire, dt in WIRE_TO_NUMPY.items()}

def to_numpy_dtype(wire: int) -> np.dtype:
    """The little-endian numpy dtype of a wire DataType; ValueError if unknown."""
    try:
        return WIRE_TO_NUMPY[wire]
    except KeyError:
        raise ValueError(f"unknown wire dtype {wire!r}") from None


def to_wire_dtype(dtype: np.dtype | str) -> int:
    """The wire DataType of a numpy dtype (either byte order); ValueError if none."""
    if isinstance(dtype, np.dtype):
        wire = _NUMPY_TO_WIRE.get(dtype)  # the common case: a little-endian dtype, one lookup
        if wire is not None:
            return wire
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    elif dt.byteorder == "=" and dt.itemsize > 1:
        dt = dt.newbyteorder("<")
    try:
        return _NUMPY_TO_WIRE[dt]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} cannot travel on the wire") from None

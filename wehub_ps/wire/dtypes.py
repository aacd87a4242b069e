"""Mapping between wire DataType values and numpy dtypes (every one little-endian).

bfloat16's dtype is looked up on first use (:func:`wehub_ps.dtypes.bfloat16`),
so that importing the wire contract does not import ml_dtypes.
"""

from __future__ import annotations

import numpy as np

from wehub_ps.dtypes import bfloat16, is_bfloat16
from wehub_ps.v1 import ps_pb2

__all__ = ["numpy_dtype_or_code", "to_numpy_dtype", "to_wire_dtype"]

# Wire DataType -> numpy dtype; bfloat16's is added by _bfloat16_entry on first use.
_WIRE_TO_NUMPY: dict[int, np.dtype] = {
    ps_pb2.FLOAT32: np.dtype("<f4"),
    ps_pb2.FLOAT64: np.dtype("<f8"),
    ps_pb2.FLOAT16: np.dtype("<f2"),
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
_NUMPY_TO_WIRE: dict[np.dtype, int] = {dt: wire for wire, dt in _WIRE_TO_NUMPY.items()}


def _bfloat16_entry() -> np.dtype:
    dt = bfloat16()
    _WIRE_TO_NUMPY[ps_pb2.BFLOAT16] = dt  # (a dict's item assignment is atomic: no lock)
    _NUMPY_TO_WIRE[dt] = ps_pb2.BFLOAT16
    return dt


def numpy_dtype_or_code(wire: int) -> np.dtype | int:
    """The numpy dtype of a wire DataType, or ``wire`` itself when it names none (the caller refuses it)."""
    dt = _WIRE_TO_NUMPY.get(wire)
    if dt is not None:
        return dt
    return _bfloat16_entry() if wire == ps_pb2.BFLOAT16 else wire


def to_numpy_dtype(wire: int) -> np.dtype:
    """The little-endian numpy dtype of a wire DataType; ValueError if unknown."""
    dt = numpy_dtype_or_code(wire)
    if not isinstance(dt, np.dtype):
        raise ValueError(f"unknown wire dtype {wire!r}")
    return dt


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
        if is_bfloat16(dt):
            _bfloat16_entry()
            return ps_pb2.BFLOAT16
        raise ValueError(f"dtype {dtype!r} cannot travel on the wire") from None

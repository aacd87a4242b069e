"""Mapping between wire DataType values and numpy dtypes.

bfloat16 comes from ml_dtypes (the package JAX and TensorFlow use), so a
bfloat16 array is an ordinary numpy array with a 2-byte dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from wehub_ps.v1 import ps_pb2

__all__ = [
    "BFLOAT16",
    "VARIABLE_DTYPES",
    "WIRE_FLOAT_DTYPES",
    "to_numpy_dtype",
    "to_wire_dtype",
    "dtype_name",
    "parse_dtype",
]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# Every dtype is little-endian on the wire.
_WIRE_TO_NUMPY: dict[int, np.dtype] = {
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
_NUMPY_TO_WIRE: dict[np.dtype, int] = {dt: wire for wire, dt in _WIRE_TO_NUMPY.items()}

# dtypes a trainable variable may have: the optimizers need floating point.
VARIABLE_DTYPES: frozenset[np.dtype] = frozenset(
    np.dtype(d) for d in ("<f2", "<f4", "<f8")
)
# Lower-precision dtypes a float32/float64 tensor may travel as.
WIRE_FLOAT_DTYPES: frozenset[np.dtype] = frozenset({np.dtype("<f2"), BFLOAT16})


def to_numpy_dtype(wire: int) -> np.dtype:
    """The little-endian numpy dtype of a wire DataType; ValueError if unknown."""
    try:
        return _WIRE_TO_NUMPY[wire]
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


def dtype_name(dtype: np.dtype | str) -> str:
    """A stable, human-readable name: 'float32', 'bfloat16', ..."""
    dt = np.dtype(dtype)
    return "bfloat16" if dt == BFLOAT16 else dt.name


def parse_dtype(value: object) -> np.dtype:
    """Accept 'float32', np.float32, np.dtype, 'bfloat16'; ValueError otherwise."""
    if isinstance(value, str) and value == "bfloat16":
        return BFLOAT16
    try:
        dt = np.dtype(value)  # type: ignore[call-overload]
    except TypeError as exc:
        raise ValueError(f"dtype must name a numpy dtype, got {value!r}") from exc
    return dt.newbyteorder("<") if dt.itemsize > 1 else dt

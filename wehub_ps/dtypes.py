"""The dtypes variables and tensors may have, by name.

bfloat16 comes from ml_dtypes (the package JAX and TensorFlow use), so a
bfloat16 array is an ordinary numpy array with a 2-byte dtype. Wire codes for
these dtypes are in :mod:`wehub_ps.wire.dtypes`.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["BFLOAT16", "VARIABLE_DTYPES", "WIRE_FLOAT_DTYPES", "dtype_name", "parse_dtype"]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

# dtypes a trainable variable may have: the optimizers need floating point.
VARIABLE_DTYPES: frozenset[np.dtype] = frozenset(
    np.dtype(d) for d in ("<f2", "<f4", "<f8")
)
# Lower-precision dtypes a float32/float64 tensor may travel as.
WIRE_FLOAT_DTYPES: frozenset[np.dtype] = frozenset({np.dtype("<f2"), BFLOAT16})


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

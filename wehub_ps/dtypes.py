"""The dtypes variables and tensors may have, by name.

bfloat16 comes from ml_dtypes (the package JAX and TensorFlow use), so a
bfloat16 array is an ordinary numpy array with a 2-byte dtype. ml_dtypes is
imported on the first use of bfloat16, not with this module: its import
registers a dozen dtypes' loops with numpy and takes about 0.5 s of CPU
(more than numpy's own import), which a server or worker that never sees
bfloat16 need not pay at start. Until it is imported no array can have its
bfloat16, so :func:`is_bfloat16` answers without importing it. Wire codes
for these dtypes are in :mod:`wehub_ps.wire.dtypes`.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["BFLOAT16", "VARIABLE_DTYPES", "WIRE_FLOAT_DTYPES", "bfloat16", "dtype_name", "is_bfloat16",
           "is_wire_float", "parse_dtype"]

# dtypes a trainable variable may have: the optimizers need floating point.
VARIABLE_DTYPES: frozenset[np.dtype] = frozenset(
    np.dtype(d) for d in ("<f2", "<f4", "<f8")
)
_FLOAT16 = np.dtype("<f2")

_lock = threading.Lock()  # guards _bfloat16
_bfloat16: np.dtype | None = None


def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16 dtype, importing ml_dtypes on the first call; thread-safe."""
    global _bfloat16
    if _bfloat16 is None:
        with _lock:
            if _bfloat16 is None:
                import ml_dtypes

                _bfloat16 = np.dtype(ml_dtypes.bfloat16)
    return _bfloat16


def is_bfloat16(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is bfloat16; never imports ml_dtypes (without it no array is bfloat16)."""
    if _bfloat16 is not None:
        return dtype == _bfloat16
    module = sys.modules.get("ml_dtypes")
    return module is not None and hasattr(module, "bfloat16") and dtype == bfloat16()


def is_wire_float(dtype: np.dtype) -> bool:
    """Whether a float32/float64 tensor may travel as ``dtype`` (float16 or bfloat16)."""
    return dtype == _FLOAT16 or is_bfloat16(dtype)


def __getattr__(name: str) -> object:
    """``BFLOAT16`` and ``WIRE_FLOAT_DTYPES``, built (and ml_dtypes imported) when first asked for."""
    if name == "BFLOAT16":
        return bfloat16()
    if name == "WIRE_FLOAT_DTYPES":
        # Lower-precision dtypes a float32/float64 tensor may travel as.
        return frozenset({_FLOAT16, bfloat16()})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: np.dtype | str) -> str:
    """A stable, human-readable name: 'float32', 'bfloat16', ..."""
    dt = np.dtype(dtype)
    return "bfloat16" if is_bfloat16(dt) else dt.name


def parse_dtype(value: object) -> np.dtype:
    """Accept 'float32', np.float32, np.dtype, 'bfloat16'; ValueError otherwise."""
    if isinstance(value, str) and value == "bfloat16":
        return bfloat16()
    try:
        dt = np.dtype(value)  # type: ignore[call-overload]
    except TypeError as exc:
        raise ValueError(f"dtype must name a numpy dtype, got {value!r}") from exc
    return dt.newbyteorder("<") if dt.itemsize > 1 else dt

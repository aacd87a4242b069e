"""Moving arrays between the caller's device and host memory.

The client speaks numpy internally. Gradients may come as numpy arrays,
CuPy arrays, or anything that implements ``__dlpack__`` (PyTorch, JAX, ...);
pulled values go back as numpy, or as CuPy arrays on a requested GPU.
CuPy is optional (the ``gpu`` extra) and imported only when needed.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from wehub_ps.dtypes import dtype_name, parse_dtype
from worker_client.errors import DTypeMismatchError, InvalidArgumentError, ShapeMismatchError

__all__ = ["to_host", "to_device", "parse_device", "is_gpu_array", "is_host_dlpack", "as_cupy", "check_ids",
           "check_array"]

_DLPACK_CPU = 1
_DLPACK_CUDA = 2
_DLPACK_CUDA_HOST = 3


def _cupy():
    try:
        return importlib.import_module("cupy")
    except ImportError:
        raise RuntimeError(
            "this needs CuPy: install the gpu extra (pip install 'wehub-ps[gpu]')"
        ) from None


def _is_cupy(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "cupy"


def is_gpu_array(x: Any) -> bool:
    """A CuPy array, or a DLPack array that lives on a CUDA device."""
    if _is_cupy(x):
        return True
    if hasattr(x, "__dlpack_device__") and not isinstance(x, np.ndarray):
        return x.__dlpack_device__()[0] == _DLPACK_CUDA
    return False


def is_host_dlpack(x: Any) -> bool:
    """Whether ``x`` exports host memory through DLPack (CPU, or CUDA pinned host memory)."""
    device_type = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else _DLPACK_CPU
    return device_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST)


def as_cupy(x: Any) -> Any:
    """``x`` itself when it is a CuPy array, else a CuPy array sharing its CUDA memory (DLPack)."""
    return x if _is_cupy(x) else _cupy().from_dlpack(x)


def to_host(x: Any, argument: str) -> np.ndarray:
    """A numpy array with the same values; no copy for numpy or CPU DLPack input."""
    if isinstance(x, np.ndarray):
        return x
    if _is_cupy(x):
        return _cupy().asnumpy(x)
    if hasattr(x, "__dlpack__"):
        device_type = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else _DLPACK_CPU
        if device_type in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
            return _from_host_dlpack(x, argument)
        if device_type == _DLPACK_CUDA:
            return _cupy().asnumpy(_cupy().from_dlpack(x))
        raise TypeError(f"{argument}: arrays on DLPack device type {device_type} are not supported")
    if isinstance(x, (list, tuple, int, float, np.generic)):
        return np.asarray(x)
    raise TypeError(
        f"{argument} must be a numpy array, a CuPy array or support __dlpack__, got {type(x).__name__}"
    )


def _from_host_dlpack(x: Any, argument: str) -> np.ndarray:
    """A host DLPack array as numpy, without a copy.

    numpy's DLPack import knows no bfloat16 (DLPack's bfloat code): such an
    array (a JAX bfloat16 gradient) is read through ``__array__`` instead,
    as ml_dtypes' bfloat16, so that its dtype is checked like any other.
    """
    try:
        return np.from_dlpack(x)
    except (BufferError, RuntimeError, TypeError) as exc:
        dlpack_error = exc
    if hasattr(x, "__array__"):
        try:
            return np.asarray(x)
        except (TypeError, ValueError, RuntimeError):
            pass
    raise DTypeMismatchError(
        f"{argument}: numpy cannot read this {type(x).__name__} of dtype {getattr(x, 'dtype', '?')} "
        f"({dlpack_error}); cast it to the variable's dtype before passing it") from None


def parse_device(device: Any) -> int | None:
    """None/'cpu' -> None (host); 'cuda', 'cuda:N', N, or a cupy Device -> GPU index."""
    if device is None or device == "cpu":
        return None
    if isinstance(device, bool):
        raise ValueError(f"device must be None, 'cpu', 'cuda', 'cuda:N' or an int, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device must be a GPU index >= 0, got {device!r}")
        return device
    if isinstance(device, str) and device.startswith("cuda"):
        rest = device[4:]
        if rest == "":
            return 0
        if rest.startswith(":") and rest[1:].isdigit():
            return int(rest[1:])
    if hasattr(device, "id") and type(device).__module__.startswith("cupy"):
        return int(device.id)
    raise ValueError(f"device must be None, 'cpu', 'cuda', 'cuda:N' or an int, got {device!r}")


def to_device(array: np.ndarray, gpu: int | None) -> Any:
    """``array`` itself for the host, else a CuPy copy on GPU ``gpu``."""
    if gpu is None:
        return array
    cupy = _cupy()
    with cupy.cuda.Device(gpu):
        return cupy.asarray(array)


def check_ids(ids: Any, argument: str) -> np.ndarray:
    """Row ids as a 1-D int64 array (uint64 ids keep their bit patterns); InvalidArgumentError otherwise."""
    array = to_host(ids, argument)
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
        raise InvalidArgumentError(f"{argument} must be a 1-D array of integer ids, got dtype "
                                   f"{array.dtype} and shape {array.shape}")
    if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
        array = array.view(np.int64)  # ids are 64-bit patterns; keep them bit-exact
    return array.astype(np.int64, copy=False)


def check_array(array: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, what: str) -> None:
    """Raise ShapeMismatchError or DTypeMismatchError unless ``array`` has exactly this shape and dtype."""
    if array.shape != tuple(shape):
        raise ShapeMismatchError(f"{what} has shape {array.shape}, expected {tuple(shape)}")
    if array.dtype != dtype and parse_dtype(array.dtype) != dtype:
        raise DTypeMismatchError(f"{what} has dtype {dtype_name(array.dtype)}, expected {dtype_name(dtype)}; "
                                 f"cast it with .astype({dtype_name(dtype)!r})")

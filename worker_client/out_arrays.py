"""The caller's ``out=`` arrays of a pull: checked, and seen as the memory the values are written into.

A training loop pulls into arrays it owns (a model's parameters): numpy
arrays, or any array with ``__dlpack__`` (PyTorch, JAX, CuPy). A host array
is seen through a numpy view that shares its memory (DLPack, no copy), and
each received chunk is written straight into it. A CUDA array is received
into a pinned host buffer and then copied to its device
(:meth:`worker_client.gpu.GpuTransfers.upload_into`; needs CuPy). Every
array is checked before anything is pulled, so one that cannot take the
values leaves them all untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from worker_client.arrays import as_cupy, check_array, is_gpu_array, is_host_dlpack
from worker_client.errors import InvalidArgumentError

__all__ = ["OutArrays", "check_out_arrays"]


@dataclass
class OutArrays:
    """Checked ``out=`` arrays by variable name.

    ``host``: numpy views to receive into; ``device``: CuPy views of CUDA
    arrays, filled from pinned buffers after the pull; ``given``: the
    caller's own objects, which the pull returns.
    """

    given: dict[str, Any] = field(default_factory=dict)
    host: dict[str, np.ndarray] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)

    def returned(self, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` with the caller's own arrays in place of the views they were received through."""
        if not self.given:
            return values
        return {name: self.given.get(name, value) for name, value in values.items()}


Layouts = Mapping[str, tuple[tuple[int, ...], np.dtype]]


def check_out_arrays(out: Mapping[str, Any] | None, layouts: Layouts) -> OutArrays:
    """``out`` checked against each variable's ``(shape, dtype)`` in ``layouts`` (the variables pulled).

    Raises InvalidArgumentError (ShapeMismatchError, DTypeMismatchError)
    naming the first array that cannot take its variable's values whole:
    a name not pulled, a read-only or non-C-contiguous array, the wrong
    shape or dtype; TypeError for an object that is no array at all.
    """
    checked = OutArrays()
    if not out:
        return checked
    if not isinstance(out, Mapping):
        raise TypeError(f"out must be a mapping name -> array, got {type(out).__name__}")
    unknown = [name for name in out if name not in layouts]
    if unknown:
        raise InvalidArgumentError(f"out names {', '.join(map(repr, unknown))}, which this pull does not "
                                   f"read; it reads {', '.join(map(repr, layouts))}")
    for name, array in out.items():
        what = f"out[{name!r}]"
        shape, dtype = layouts[name]
        if is_gpu_array(array):
            view = _exported(as_cupy, array, what)
            checked.device[name] = view
        else:
            view = _host_view(array, what)
            if not view.flags.writeable:
                raise InvalidArgumentError(f"{what} is read-only; pass a writable array")
            checked.host[name] = view
        check_array(view, shape, dtype, what)
        if not view.flags.c_contiguous:
            raise InvalidArgumentError(f"{what} is not C-contiguous (strides {view.strides}); pass a "
                                       "contiguous array (.contiguous() in PyTorch, np.ascontiguousarray)")
        checked.given[name] = array
    return checked


def _host_view(array: Any, what: str) -> np.ndarray:
    """A numpy array sharing ``array``'s host memory."""
    if isinstance(array, np.ndarray):
        return array
    if not hasattr(array, "__dlpack__"):
        raise TypeError(f"{what} must be a numpy array or support __dlpack__, got {type(array).__name__}")
    if not is_host_dlpack(array):
        raise InvalidArgumentError(f"{what} lives on DLPack device {array.__dlpack_device__()}; pull(out=) "
                                   "writes into host (CPU) and CUDA arrays")
    return _exported(np.from_dlpack, array, what)


def _exported(export: Callable[[Any], Any], array: Any, what: str) -> Any:
    """``export(array)``; the exporter's refusal (a tensor needing grad, say) as InvalidArgumentError."""
    try:
        return export(array)
    except (BufferError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{what} cannot be written through DLPack: {exc}") from exc

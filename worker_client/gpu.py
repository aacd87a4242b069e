"""GPU transfers for workers: pinned host buffers reused across steps, CUDA streams.

Copies between a GPU and pageable host memory are staged by the driver
through a hidden pinned buffer (a second copy, and synchronous); copying
through page-locked buffers that we allocate once and reuse every step
avoids both. Each device gets its own stream so the copies of several
replicas' devices proceed at once.

CuPy is imported only when a GPU is used (the ``gpu`` extra). Where no GPU
is present nothing here runs, and the client stays on numpy.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["GpuTransfers", "gpu_available"]


def gpu_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


class GpuTransfers:
    """Pinned buffers (by name and size) and one stream per device; thread-safe."""

    def __init__(self) -> None:
        import cupy

        self._cupy = cupy
        # Guards _buffers and _streams.
        self._lock = threading.Lock()
        self._buffers: dict[tuple[str, int], Any] = {}  # (name, nbytes) -> pinned memory
        self._streams: dict[int, Any] = {}

    def pinned(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A host array in page-locked memory, the same one for the same name and size each step."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        key = (name, nbytes)
        with self._lock:
            memory = self._buffers.get(key)
            if memory is None:
                memory = self._buffers[key] = self._cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(memory, dtype=dtype, count=nbytes // dtype.itemsize).reshape(shape)

    def stream(self, device: int):
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                with self._cupy.cuda.Device(device):
                    stream = self._streams[device] = self._cupy.cuda.Stream(non_blocking=True)
            return stream

    def upload(self, host: np.ndarray, device: int) -> Any:
        """Start copying ``host`` (ideally pinned) to ``device``; call :meth:`synchronize` before use."""
        cupy = self._cupy
        with cupy.cuda.Device(device):
            out = cupy.empty(host.shape, dtype=host.dtype)
            out.set(host, stream=self.stream(device))
        return out

    def download(self, name: str, array: Any) -> np.ndarray:
        """Copy a GPU array into its pinned buffer and wait; valid until the next download of ``name``."""
        if type(array).__module__.split(".", 1)[0] != "cupy":
            array = self._cupy.from_dlpack(array)  # e.g. a PyTorch CUDA tensor, without a copy
        device = array.device.id
        out = self.pinned(name, array.shape, np.dtype(array.dtype))
        stream = self.stream(device)
        with self._cupy.cuda.Device(device):
            array.get(stream=stream, out=out, blocking=False)
            stream.synchronize()
        return out

    def synchronize(self, devices: set[int] | None = None) -> None:
        with self._lock:
            streams = dict(self._streams)
        for device, stream in streams.items():
            if devices is None or device in devices:
                stream.synchronize()

    def sum_on(self, device: int, arrays: list[Any]) -> Any:
        """Sum CuPy arrays that may live on different GPUs, on ``device`` (peer copies)."""
        cupy = self._cupy
        with cupy.cuda.Device(device):
            total = cupy.array(arrays[0], copy=True) if arrays[0].device.id == device else self._copy_to(arrays[0], device)
            for array in arrays[1:]:
                total += array if array.device.id == device else self._copy_to(array, device)
        return total

    def _copy_to(self, array: Any, device: int) -> Any:
        cupy = self._cupy
        with cupy.cuda.Device(device):
            out = cupy.empty(array.shape, dtype=array.dtype)
            out.data.copy_from_device(array.data, array.nbytes)
        return out

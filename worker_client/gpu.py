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
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["GpuTransfers", "LazyGpuTransfers", "gpu_available"]


def gpu_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


class GpuTransfers:
    """Pinned buffers (by name and size) and one stream per device; thread-safe.

    Our streams are non-blocking: they do not wait for the caller's stream
    by themselves. So each batch of copies first waits (an event, on the
    GPU, not the host) for the work the caller's current stream has queued:
    a gradient still being computed is copied only once it is complete, and
    device memory freshly taken from CuPy's pool is written only after the
    kernels that used it last.
    """

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

    def _stream_after_current(self, device: int):
        """Our stream for ``device``, made to wait for what the caller's current stream has queued there."""
        stream = self.stream(device)
        with self._cupy.cuda.Device(device):
            current = self._cupy.cuda.get_current_stream()
            if current.ptr != stream.ptr:
                stream.wait_event(current.record())
        return stream

    def upload_all(self, host: Mapping[str, np.ndarray], device: int, wait: bool = True) -> dict[str, Any]:
        """Copies of ``host`` (ideally pinned) on ``device``, complete on return; one wait for them all.

        ``wait=False`` returns at once, for uploads to several devices that
        run side by side: call :meth:`synchronize` before using any of them.
        """
        cupy = self._cupy
        stream = self._stream_after_current(device)
        out = {}
        with cupy.cuda.Device(device):
            for name, array in host.items():
                out[name] = on_device = cupy.empty(array.shape, dtype=array.dtype)
                on_device.set(array, stream=stream)
        if wait:
            stream.synchronize()
        return out

    def upload_into(self, host: Mapping[str, np.ndarray], targets: Mapping[str, Any]) -> None:
        """Copy each host array (ideally pinned) into the CuPy array of the same name in ``targets``.

        The targets may live on several devices: all copies are queued
        first, then one wait per device; complete on return.
        """
        by_device: dict[int, list[str]] = {}
        for name, target in targets.items():
            by_device.setdefault(target.device.id, []).append(name)
        for device, names in by_device.items():
            stream = self._stream_after_current(device)
            with self._cupy.cuda.Device(device):
                for name in names:
                    targets[name].set(host[name], stream=stream)
        self.synchronize(set(by_device))

    def synchronize(self, devices: set[int]) -> None:
        """Wait for the copies queued on our streams of ``devices``."""
        for device in devices:
            self.stream(device).synchronize()

    def download_all(self, arrays: Mapping[str, Any], tag: str) -> dict[str, np.ndarray]:
        """GPU arrays copied into the pinned buffers ``f"{tag}:{name}"``; one wait per device.

        A buffer is valid until the next download under the same tag and
        name. CuPy arrays, and CUDA arrays with ``__dlpack__`` (PyTorch,
        JAX: no copy) are accepted.
        """
        cupy = self._cupy
        by_device: dict[int, list[tuple[str, Any]]] = {}
        for name, array in arrays.items():
            if type(array).__module__.split(".", 1)[0] != "cupy":
                # DLPack makes CuPy's current stream wait for the producer's (e.g. PyTorch's).
                array = cupy.from_dlpack(array)
            by_device.setdefault(array.device.id, []).append((name, array))
        out = {}
        for device, named in by_device.items():
            stream = self._stream_after_current(device)
            with cupy.cuda.Device(device), stream:
                for name, array in named:
                    out[name] = host = self.pinned(f"{tag}:{name}", array.shape, np.dtype(array.dtype))
                    # A strided array is made contiguous by a kernel on our stream (current here).
                    array.get(stream=stream, out=host, blocking=False)
        self.synchronize(set(by_device))
        return out

    def sum_on(self, device: int, arrays: list[Any]) -> Any:
        """Sum CuPy arrays that may live on different GPUs, on ``device`` (peer copies)."""
        cupy = self._cupy
        with cupy.cuda.Device(device):
            total = cupy.array(arrays[0], copy=True) if arrays[0].device.id == device else self._copy_to(arrays[0], device)
            for array in arrays[1:]:
                total += array if array.device.id == device else self._copy_to(array, device)
        return total

    def _copy_to(self, array: Any, device: int) -> Any:
        """A copy on ``device``, after the work queued on ``array``'s own GPU (streams do not cross GPUs)."""
        cupy = self._cupy
        with cupy.cuda.Device(array.device.id):
            ready = cupy.cuda.get_current_stream().record()
        with cupy.cuda.Device(device):
            cupy.cuda.get_current_stream().wait_event(ready)
            out = cupy.empty(array.shape, dtype=array.dtype)
            out.data.copy_from_device(array.data, array.nbytes)
        return out


class LazyGpuTransfers:
    """One client's GpuTransfers, made on first use of a GPU (CuPy is imported only then); thread-safe."""

    def __init__(self) -> None:
        # Guards _transfers.
        self._lock = threading.Lock()
        self._transfers: GpuTransfers | None = None

    def get(self) -> GpuTransfers:
        with self._lock:
            if self._transfers is None:
                self._transfers = GpuTransfers()
            return self._transfers

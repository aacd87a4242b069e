"""A stand-in for CuPy that logs stream operations, for the GPU path's tests on machines with no GPU.

CI has no GPU, so these tests cannot see a real copy race. What they can
check exactly is the order in which the client asks for things: that our
stream waits for the caller's current stream before any copy, that a batch
of copies ends in one synchronize per device, and that the values arrive.
Copies run at once on the host (numpy), so the values are checked too.
The real race is checked by the tests marked for a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from dataclasses import dataclass, field

import numpy as np


@dataclass
class FakeCuda:
    """Device, stream and event bookkeeping; ``log`` holds every operation in order."""

    log: list[tuple] = field(default_factory=list)
    device: int = 0
    current: dict[int, "FakeStream"] = field(default_factory=dict)
    pinned_allocations: int = 0

    def null(self, device: int) -> "FakeStream":
        return self.current.setdefault(device, FakeStream(self, f"null:{device}", device))


_ids = itertools.count(1)


class FakeEvent:
    def __init__(self, source: str) -> None:
        self.source = source


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str, device: int) -> None:
        self.cuda, self.name, self.device, self.ptr = cuda, name, device, next(_ids)
        self._outer: list[FakeStream] = []

    def record(self, event: FakeEvent | None = None) -> FakeEvent:
        self.cuda.log.append(("record", self.name))
        return FakeEvent(self.name)

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(("wait", self.name, event.source))

    def synchronize(self) -> None:
        self.cuda.log.append(("sync", self.name))

    def __enter__(self) -> "FakeStream":
        self._outer.append(self.cuda.current.get(self.device) or self.cuda.null(self.device))
        self.cuda.current[self.device] = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.cuda.current[self.device] = self._outer.pop()


class _Device:
    def __init__(self, index: int) -> None:
        self.id = index


class FakeArray:
    """A device array: a numpy array and the device it is said to live on."""

    def __init__(self, cuda: FakeCuda, values: np.ndarray, device: int) -> None:
        self._cuda, self._values, self.device = cuda, values, _Device(device)

    shape = property(lambda self: self._values.shape)
    dtype = property(lambda self: self._values.dtype)
    nbytes = property(lambda self: self._values.nbytes)
    flags = property(lambda self: self._values.flags)
    strides = property(lambda self: self._values.strides)

    def set(self, host: np.ndarray, stream: FakeStream | None = None) -> None:
        self._cuda.log.append(("h2d", (stream or self._cuda.null(self.device.id)).name))
        self._values[...] = host

    def get(self, stream: FakeStream | None = None, out: np.ndarray | None = None, blocking: bool = True):
        self._cuda.log.append(("d2h", (stream or self._cuda.null(self.device.id)).name))
        if out is None:
            return self._values.copy()
        out[...] = self._values
        return out

    def values(self) -> np.ndarray:
        return self._values


FakeArray.__module__ = "cupy._core.core"  # what the client looks at to recognise a CuPy array


def fake_cupy_module(cuda: FakeCuda) -> types.ModuleType:
    """A module to put in ``sys.modules["cupy"]``."""

    @contextlib.contextmanager
    def device(index: int):
        outer, cuda.device = cuda.device, index
        try:
            yield
        finally:
            cuda.device = outer

    def alloc_pinned_memory(nbytes: int) -> bytearray:
        cuda.pinned_allocations += 1
        return bytearray(nbytes)

    def array_on(values: np.ndarray, device_index: int | None = None) -> FakeArray:
        return FakeArray(cuda, values, cuda.device if device_index is None else device_index)

    module = types.ModuleType("cupy")
    module.cuda = types.SimpleNamespace(
        Device=device,
        Stream=lambda non_blocking=False: FakeStream(cuda, f"ours:{cuda.device}", cuda.device),
        get_current_stream=lambda: cuda.current.get(cuda.device) or cuda.null(cuda.device),
        alloc_pinned_memory=alloc_pinned_memory,
    )
    module.ndarray = FakeArray
    module.empty = lambda shape, dtype=np.float32: array_on(np.empty(shape, dtype))
    module.asarray = lambda values: array_on(np.array(values))
    module.asnumpy = lambda array: array.values().copy()
    module.array_on = array_on  # for tests: a device array on a given device
    return module

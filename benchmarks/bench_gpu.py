"""Host <-> device figures of the client's GPU path, against a plain pinned-memory copy of the same run.

Needs CuPy and a CUDA GPU; ``run.py --only gpu`` calls these and prints
the rows (and skips the section where there is no GPU). Each function
returns seconds per call, best first is up to the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def _timed(call: Callable[[], object], repeats: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        call()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return seconds


def plain_copy_seconds(nbytes: int, repeats: int, pinned: bool) -> tuple[list[float], list[float]]:
    """One ``nbytes`` buffer up to the GPU and back, (host->device, device->host), each waited for.

    ``pinned``: from and into page-locked memory on a stream of our own
    (the baseline); otherwise pageable numpy memory through CuPy's plain
    ``asarray`` / ``asnumpy`` (what a client without pinned buffers does).
    """
    import cupy

    device = cupy.empty(nbytes, dtype=cupy.uint8)
    if pinned:
        host = np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), dtype=np.uint8, count=nbytes)
        host[:] = 1
        stream = cupy.cuda.Stream(non_blocking=True)

        def up() -> None:
            device.set(host, stream=stream)
            stream.synchronize()

        def down() -> None:
            device.get(stream=stream, out=host, blocking=False)
            stream.synchronize()
    else:
        host = np.ones(nbytes, dtype=np.uint8)

        def up() -> None:
            cupy.asarray(host)
            cupy.cuda.get_current_stream().synchronize()

        def down() -> None:
            cupy.asnumpy(device)
    return _timed(up, repeats), _timed(down, repeats)


def transfer_stage_seconds(shapes: dict[str, tuple[int, ...]], repeats: int) -> tuple[list[float], list[float]]:
    """The client's own device stage for float32 variables of ``shapes``: (pull's upload, push's download).

    The pull path receives into pinned buffers and uploads them all
    (``GpuTransfers.upload_all``, as ``PSClient.pull(device=...)`` does);
    the push path downloads every GPU gradient into pinned buffers
    (``download_all``, as ``PSClient.push`` does).
    """
    import cupy

    from worker_client.gpu import GpuTransfers

    transfers = GpuTransfers()
    received = {name: transfers.pinned(f"pull:{name}", shape, np.float32) for name, shape in shapes.items()}
    for array in received.values():
        array.fill(1.0)
    grads = {name: cupy.ones(shape, dtype=cupy.float32) for name, shape in shapes.items()}
    return (_timed(lambda: transfers.upload_all(received, 0), repeats),
            _timed(lambda: transfers.download_all(grads, "push"), repeats))


def client_seconds(client, names: list[str], shapes: dict[str, tuple[int, ...]], repeats: int
                   ) -> dict[str, list[float]]:
    """Whole pulls and pushes through ``client``: to and from the GPU, and on the host for comparison."""
    import cupy

    host_dest = client.pull(names)
    host_grads = {name: np.zeros(shapes[name], np.float32) for name in names}
    gpu_grads = {name: cupy.zeros(shapes[name], dtype=cupy.float32) for name in names}
    return {
        "pull_host": _timed(lambda: client.pull(names, out=host_dest), repeats),
        "pull_gpu": _timed(lambda: client.pull(names, device="cuda:0"), repeats),
        "push_host": _timed(lambda: client.push(host_grads), repeats),
        "push_gpu": _timed(lambda: client.push(gpu_grads), repeats),
    }


def device_name() -> str:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()

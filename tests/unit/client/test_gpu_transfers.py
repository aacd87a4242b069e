"""GpuTransfers: copies ordered after the caller's stream, one wait per batch, values intact.

The first tests run everywhere on a logging stand-in for CuPy
(tests/fake_cupy.py: there is no GPU in CI); the last ones need a real GPU
and check the race itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from worker_client.gpu import GpuTransfers, gpu_available


def test_a_download_waits_for_the_callers_stream_then_syncs_once(fake_cupy):
    cuda, cupy = fake_cupy
    transfers = GpuTransfers()
    grads = {"a": cupy.array_on(np.arange(6, dtype=np.float32)),
             "b": cupy.array_on(np.ones((2, 3), np.float64))}
    cuda.log.clear()
    host = transfers.download_all(grads, "push:1")
    assert cuda.log == [("record", "null:0"), ("wait", "ours:0", "null:0"),
                        ("d2h", "ours:0"), ("d2h", "ours:0"), ("sync", "ours:0")]
    np.testing.assert_array_equal(host["a"], np.arange(6, dtype=np.float32))
    assert host["b"].shape == (2, 3) and host["b"].dtype == np.float64
    # The same pinned buffers next step: no allocation per step.
    allocated = cuda.pinned_allocations
    again = transfers.download_all(grads, "push:1")
    assert cuda.pinned_allocations == allocated
    assert np.shares_memory(again["a"], host["a"])


def test_an_upload_waits_for_the_callers_stream_then_syncs_once(fake_cupy):
    cuda, _ = fake_cupy
    transfers = GpuTransfers()
    host = {"w": np.full((3, 4), 2.5, np.float32), "b": np.arange(4, dtype=np.float32)}
    cuda.log.clear()
    on_device = transfers.upload_all(host, 0)
    assert cuda.log == [("record", "null:0"), ("wait", "ours:0", "null:0"),
                        ("h2d", "ours:0"), ("h2d", "ours:0"), ("sync", "ours:0")]
    for name, values in host.items():
        assert on_device[name].device.id == 0
        np.testing.assert_array_equal(on_device[name].values(), values)
    cuda.log.clear()
    transfers.upload_all(host, 0, wait=False)
    assert ("sync", "ours:0") not in cuda.log


def test_no_wait_is_queued_when_the_caller_already_runs_on_our_stream(fake_cupy):
    cuda, cupy = fake_cupy
    transfers = GpuTransfers()
    with transfers.stream(0):
        cuda.log.clear()
        transfers.download_all({"a": cupy.array_on(np.zeros(3, np.float32))}, "t")
    assert [entry[0] for entry in cuda.log] == ["d2h", "sync"]


def test_arrays_on_two_devices_are_all_queued_before_either_is_waited_for(fake_cupy):
    cuda, cupy = fake_cupy
    transfers = GpuTransfers()
    grads = {"x": cupy.array_on(np.ones(4, np.float32), 0), "y": cupy.array_on(np.full(4, 3, np.float32), 1)}
    cuda.log.clear()
    host = transfers.download_all(grads, "t")
    copies = [i for i, entry in enumerate(cuda.log) if entry[0] == "d2h"]
    syncs = [i for i, entry in enumerate(cuda.log) if entry[0] == "sync"]
    assert sorted(entry[1] for entry in cuda.log if entry[0] == "wait") == ["ours:0", "ours:1"]
    assert len(syncs) == 2 and max(copies) < min(syncs)
    np.testing.assert_array_equal(host["y"], np.full(4, 3, np.float32))


# ---- on a real GPU ----

needs_gpu = pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")


def _slow_plus_one(x):
    """``x + 1``, computed by a kernel that takes milliseconds, on CuPy's current stream."""
    import cupy

    kernel = cupy.ElementwiseKernel(
        "float32 x", "float32 y",
        # The loop keeps each thread busy; its result cannot be dropped, since y depends on it.
        "float s = x; for (int i = 0; i < 20000; ++i) { s = s * 1.0000001f; }"
        " y = x + 1.0f + (s > 1e30f ? 1.0f : 0.0f)",
        "wehub_slow_plus_one")
    return kernel(x)


@needs_gpu
def test_a_gradient_still_being_computed_is_downloaded_complete():
    import cupy

    transfers = GpuTransfers()
    n = 1 << 24
    base = cupy.arange(n, dtype=cupy.float32)
    expected = np.arange(n, dtype=np.float32) + 1
    for attempt in range(3):  # the kernel is still running when the copy is queued
        host = transfers.download_all({"g": _slow_plus_one(base)}, "test")
        np.testing.assert_array_equal(host["g"], expected, err_msg=f"attempt {attempt}")


@needs_gpu
def test_uploads_and_downloads_round_trip_on_a_real_gpu():
    import cupy

    transfers = GpuTransfers()
    host = {"w": np.random.default_rng(0).standard_normal((256, 300)).astype(np.float32),
            "b": np.arange(7, dtype=np.float64)}
    pinned = {name: transfers.pinned(f"in:{name}", v.shape, v.dtype) for name, v in host.items()}
    for name, values in host.items():
        pinned[name][...] = values
    on_device = transfers.upload_all(pinned, 0)
    assert all(isinstance(v, cupy.ndarray) for v in on_device.values())
    strided = {"w_t": on_device["w"].T, "b": on_device["b"]}  # a transposed view is made contiguous first
    back = transfers.download_all(strided, "out")
    np.testing.assert_array_equal(back["w_t"], host["w"].T)
    np.testing.assert_array_equal(back["b"], host["b"])

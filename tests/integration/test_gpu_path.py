"""The client's GPU path against real servers: gradients pushed from the device, values pulled onto it.

The first tests run everywhere on a logging stand-in for CuPy
(tests/fake_cupy.py; CI has no GPU): they check that a push downloads all
its GPU gradients with one wait and a pull uploads with one, and that the
servers end with the exact values. The last test needs a real GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from worker_client import SGD, PSClient
from worker_client.gpu import gpu_available


def test_gpu_gradients_go_out_in_one_batch_and_pulls_come_back_on_the_device(cluster_factory, fake_cupy):
    cuda, cupy = fake_cupy
    cluster = cluster_factory(2)
    with PSClient(cluster.addresses, worker_id="gpu") as client:
        shapes = {"w": (64, 33), "b": (33,), "h": (5, 7)}
        for name, shape in shapes.items():
            client.create_variable(name, shape=shape, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        grads = {name: cupy.array_on(np.full(shape, i + 1.5, np.float32)) for i, (name, shape) in
                 enumerate(shapes.items())}
        for step in range(2):
            cuda.log.clear()
            with client.step(list(shapes), device="cuda:0") as s:
                if step == 1:
                    assert all(type(p).__name__ == "FakeArray" for p in s.params.values())
                    for i, (name, shape) in enumerate(shapes.items()):
                        np.testing.assert_array_equal(s.params[name].values(), np.full(shape, -(i + 1.5)))
                s.push(grads)
            kinds = [entry[0] for entry in cuda.log]
            assert kinds.count("sync") == 2  # one for the pull's uploads, one for the push's downloads
            assert kinds.count("wait") == 2 and kinds.count("d2h") == 3
        pulled = client.pull(list(shapes))
        for i, (name, shape) in enumerate(shapes.items()):
            np.testing.assert_array_equal(pulled[name], np.full(shape, -2 * (i + 1.5), np.float32))


def test_a_gpu_gradient_of_the_wrong_shape_changes_nothing(cluster_factory, fake_cupy):
    _, cupy = fake_cupy
    cluster = cluster_factory(1)
    with PSClient(cluster.addresses) as client:
        client.create_variable("w", shape=(4, 4), initializer=np.ones((4, 4), np.float32),
                               optimizer=SGD(learning_rate=1.0))
        with pytest.raises(ValueError, match="shape"):
            client.push({"w": cupy.array_on(np.ones((4, 5), np.float32))})
        np.testing.assert_array_equal(client.pull(["w"])["w"], np.ones((4, 4), np.float32))


@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_a_gradient_still_being_computed_on_the_gpu_is_pushed_complete(cluster_factory):
    import cupy

    cluster = cluster_factory(2)
    n = 1 << 22
    kernel = cupy.ElementwiseKernel(
        "float32 x", "float32 y",
        # Milliseconds of work per launch: the push is queued while it runs.
        "float s = x; for (int i = 0; i < 20000; ++i) { s = s * 1.0000001f; }"
        " y = x + 1.0f + (s > 1e30f ? 1.0f : 0.0f)",
        "wehub_slow_gradient")
    with PSClient(cluster.addresses, worker_id="gpu") as client:
        client.create_variable("w", shape=(n,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        base = cupy.arange(n, dtype=cupy.float32)
        for _ in range(3):
            client.push({"w": kernel(base)})
        expected = -3 * (np.arange(n, dtype=np.float32) + 1)
        np.testing.assert_array_equal(cupy.asnumpy(client.pull(["w"], device="cuda:0")["w"]), expected)

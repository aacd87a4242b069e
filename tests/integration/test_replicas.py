"""Multi-replica workers: one pull, R replicas, gradients aggregated, one push."""

from __future__ import annotations

import numpy as np
import pytest

from worker_client import SGD, PSClient, ReplicaGroup
from worker_client.gpu import gpu_available


def _grads(replica: int, step: int) -> dict[str, np.ndarray]:
    return {"w": np.full((300, 300), 3.0 * (replica + 1) + step, np.float32),
            "b": np.full(7, float(replica), np.float32)}


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_cpu_replicas_push_the_aggregate_once_per_step(cluster_factory, reduce):
    cluster = cluster_factory(2)
    with PSClient(cluster.addresses, worker_id="multi") as client:
        client.create_variable("w", shape=(300, 300), optimizer=SGD(learning_rate=1.0))
        client.create_variable("b", shape=(7,), optimizer=SGD(learning_rate=1.0))
        client.create_embedding("emb", 4, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        group = ReplicaGroup(client, devices=["cpu", "cpu", "cpu"], reduce=reduce)
        expected = client.pull(["w", "b"])
        for step in range(3):
            with group.step(["w", "b"]) as s:
                assert len(s.params) == 3
                for params in s.params:
                    np.testing.assert_array_equal(params["w"], expected["w"])
                assert s.params[0]["w"] is not s.params[1]["w"]  # each replica has its own copy
                per_replica = [_grads(r, step) for r in range(3)]
                rows = [{"emb": (np.array([r, 100]), np.ones((2, 4), np.float32))} for r in range(3)]
                s.push(per_replica, rows=rows)
            scale = 1 / 3 if reduce == "mean" else 1.0
            for name in expected:
                total = sum(g[name] for g in per_replica)
                expected[name] = expected[name] - (total * np.float32(scale)).astype(np.float32)
        pulled = client.pull(["w", "b"])
        for name in expected:
            np.testing.assert_allclose(pulled[name], expected[name], rtol=1e-6)
        info = client.describe()
        versions = {p.shard: info[p.shard].variables["w"]["version"] for p in client.variables()["w"].placement.parts}
        assert set(versions.values()) == {3}  # one push per step, not one per replica
        emb = client.pull_rows("emb", [0, 1, 2, 100])
        per_step = 1 / 3 if reduce == "mean" else 1.0
        np.testing.assert_allclose(emb[:, 0], [-3 * per_step, -3 * per_step, -3 * per_step, -9 * per_step],
                                   rtol=1e-6)


def test_replica_arguments_are_checked(cluster_factory):
    cluster = cluster_factory(1)
    with PSClient(cluster.addresses) as client:
        with pytest.raises(ValueError, match="reduce"):
            ReplicaGroup(client, ["cpu"], reduce="max")
        with pytest.raises(ValueError, match="at least one"):
            ReplicaGroup(client, [])
        client.create_variable("v", shape=(3,))
        group = ReplicaGroup(client, ["cpu", "cpu"])
        with pytest.raises(ValueError, match="2 replicas"):
            with group.step(["v"]) as s:
                s.push([{"v": np.zeros(3, np.float32)}])


@pytest.mark.skipif(not gpu_available(), reason="needs CuPy and a CUDA GPU")
def test_gpu_replicas_aggregate_on_device(cluster_factory):
    import cupy

    devices = list(range(min(2, cupy.cuda.runtime.getDeviceCount())))
    cluster = cluster_factory(1)
    with PSClient(cluster.addresses) as client:
        client.create_variable("w", shape=(512, 512), initializer="normal", optimizer=SGD(learning_rate=1.0))
        before = client.pull(["w"])["w"]
        group = ReplicaGroup(client, devices=[f"cuda:{d}" for d in devices])
        with group.step(["w"]) as s:
            assert all(isinstance(p["w"], cupy.ndarray) for p in s.params)
            grads = []
            for r, params in enumerate(s.params):
                with cupy.cuda.Device(devices[r]):
                    grads.append({"w": cupy.full((512, 512), r + 1, dtype=cupy.float32)})
            s.push(grads)
        expected = before - np.float32(sum(range(1, len(devices) + 1)) / len(devices))
        np.testing.assert_allclose(client.pull(["w"])["w"], expected, rtol=1e-6)
        on_gpu = client.pull(["w"], device=f"cuda:{devices[-1]}")["w"]
        assert on_gpu.device.id == devices[-1]
        np.testing.assert_allclose(cupy.asnumpy(on_gpu), expected, rtol=1e-6)

"""Top-k rows with error feedback, through real servers: what the servers applied plus what the
worker still owes is exactly the sum of the gradients, also when a shard fails mid-push."""

from __future__ import annotations

import numpy as np
import pytest

from worker_client import SGD, FixedShardsPartitioner, PSClient, PSUnavailableError


def _grad(step: int, shape: tuple[int, ...]) -> np.ndarray:
    # Integers: every sum is exact in float32, so the checks below are exact.
    rng = np.random.default_rng(step)
    return rng.integers(-9, 10, size=shape).astype(np.float32)


def test_servers_apply_the_top_rows_and_the_worker_owes_the_rest(cluster_factory):
    cluster = cluster_factory(2)
    shapes = {"w": (10, 4), "b": (6,), "s": ()}
    with PSClient(cluster.addresses, worker_id="topk", topk_ratio=0.3) as client:
        for name, shape in shapes.items():
            client.create_variable(name, shape=shape, initializer="zeros", optimizer=SGD(learning_rate=1.0),
                                   partitioner=FixedShardsPartitioner(2) if name == "w" else None)
        total = {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}
        for step in range(5):
            grads = {name: _grad(10 * step + i, shape) for i, (name, shape) in enumerate(shapes.items())}
            client.push(grads)
            for name in shapes:
                total[name] += grads[name]
        pulled = client.pull(list(shapes))
        owed = client.gradient_residuals()
    assert set(owed) == {"w", "b"}  # a scalar has no rows: it goes dense
    np.testing.assert_array_equal(-pulled["s"], total["s"])
    for name in ("w", "b"):
        np.testing.assert_array_equal(-pulled[name] + owed[name].reshape(shapes[name]), total[name])
        # Each push sent 3 of 10 rows (2 of 6 elements): some were applied, some are still owed.
        assert np.any(owed[name] != 0) and np.any(pulled[name] != 0)


def test_a_push_that_fails_on_one_shard_takes_in_only_the_rows_the_other_applied(cluster_factory):
    cluster = cluster_factory(2)
    with PSClient(cluster.addresses, worker_id="topk", topk_ratio=0.5, retry_timeout=1.0) as client:
        client.create_variable("w", shape=(8, 3), initializer="zeros", optimizer=SGD(learning_rate=1.0),
                               partitioner=FixedShardsPartitioner(2))
        parts = client.variables()["w"].placement.parts
        on_0 = np.arange(parts[0].row_start, parts[0].row_end) if parts[0].shard == 0 else \
            np.arange(parts[1].row_start, parts[1].row_end)
        client.push({"w": _grad(1, (8, 3))})
        applied_before = client.pull(["w"])["w"]
        owed_before = client.gradient_residuals()["w"]
        # Distinct row sizes; the largest half is rows 0, 2 (shard 0) and 4, 6 (shard 1).
        g2 = _grad(2, (8, 3)) + np.array([8, 1, 7, 2, 6, 3, 5, 4], np.float32)[:, None] * 100
        candidate = owed_before + g2
        chosen = np.sort(np.argsort(-np.einsum("ij,ij->i", candidate, candidate))[:4])
        np.testing.assert_array_equal(chosen, [0, 2, 4, 6])
        cluster.servers[1].stop()
        with pytest.raises(PSUnavailableError):
            client.push({"w": g2})
        owed = client.gradient_residuals()["w"]
        applied_by_0 = np.intersect1d(chosen, on_0)
        # Shard 0 applied its chosen rows whole (owed + gradient): they are owed nothing now.
        np.testing.assert_array_equal(client.pull_rows("w", on_0),
                                      applied_before[on_0] - np.where(np.isin(on_0, applied_by_0)[:, None],
                                                                      candidate[on_0], 0))
        np.testing.assert_array_equal(owed[applied_by_0], 0)
        # Every other row is owed what it was before: the failed push's gradient was not taken in.
        others = np.setdiff1d(np.arange(8), applied_by_0)
        np.testing.assert_array_equal(owed[others], owed_before[others])


def test_a_bad_gradient_changes_neither_the_residual_nor_the_servers(cluster_factory):
    cluster = cluster_factory(1)
    with PSClient(cluster.addresses, topk_ratio=0.5) as client:
        client.create_variable("w", shape=(4, 2), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.push({"w": np.ones((4, 2), np.float32)})
        owed, value = client.gradient_residuals()["w"], client.pull(["w"])["w"]
        client.create_variable("v", shape=(4, 2), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        with pytest.raises(ValueError, match="shape"):
            client.push({"w": np.ones((4, 3), np.float32)})
        with pytest.raises(ValueError, match="shape"):  # w's rows were chosen before v was found wrong
            client.push({"w": np.ones((4, 2), np.float32), "v": np.ones(3, np.float32)})
        with pytest.raises(ValueError, match="both gradients and rows"):
            client.push({"w": np.ones((4, 2), np.float32)},
                        rows={"w": (np.array([0]), np.ones((1, 2), np.float32))})
        np.testing.assert_array_equal(client.gradient_residuals()["w"], owed)
        np.testing.assert_array_equal(client.pull(["w"])["w"], value)


def test_topk_ratio_is_checked_before_connecting():
    with pytest.raises(ValueError, match="topk_ratio"):
        PSClient(["127.0.0.1:1"], topk_ratio=2.0)

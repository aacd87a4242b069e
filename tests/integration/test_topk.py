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


def test_a_push_a_shard_did_not_confirm_is_completed_by_the_next_push(cluster_factory, tmp_path):
    cluster = cluster_factory(2, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "3600")
    # retry_timeout: long enough for the channel to reconnect to the restarted shard (backoff up to 2 s).
    with PSClient(cluster.addresses, worker_id="topk", topk_ratio=0.5, retry_timeout=5.0) as client:
        client.create_variable("w", shape=(8, 3), initializer="zeros", optimizer=SGD(learning_rate=1.0),
                               partitioner=FixedShardsPartitioner(2))
        g1, g3 = _grad(1, (8, 3)), _grad(3, (8, 3))
        client.push({"w": g1})
        owed_before = client.gradient_residuals()["w"]
        # Distinct row sizes; the largest half is rows 0, 2 (shard 0) and 4, 6 (shard 1).
        g2 = _grad(2, (8, 3)) + np.array([8, 1, 7, 2, 6, 3, 5, 4], np.float32)[:, None] * 100
        candidate = owed_before + g2
        chosen = np.sort(np.argsort(-np.einsum("ij,ij->i", candidate, candidate))[:4])
        np.testing.assert_array_equal(chosen, [0, 2, 4, 6])
        stopped = cluster.servers[1]
        stopped.stop()
        with pytest.raises(PSUnavailableError):
            client.push({"w": g2})
        # The gradient was taken in: the chosen rows count as sent (shard 1's are still on their way).
        owed = client.gradient_residuals()["w"]
        np.testing.assert_array_equal(owed[chosen], 0)
        others = np.setdiff1d(np.arange(8), chosen)
        np.testing.assert_array_equal(owed[others], candidate[others])
        # While shard 1 is down, the next push only adds its gradient to the residual.
        with pytest.raises(PSUnavailableError):
            client.push({"w": g3})
        np.testing.assert_array_equal(client.gradient_residuals()["w"], owed + g3)
        stopped.start(stopped.port)
        # The next push first completes the one shard 1 missed, then sends its own rows.
        g4 = _grad(4, (8, 3))
        client.push({"w": g4})
        pulled = client.pull(["w"])["w"]
        np.testing.assert_array_equal(-pulled + client.gradient_residuals()["w"], g1 + g2 + g3 + g4)


def test_exact_under_connection_cuts(cluster_factory):
    """Pushes through proxies that cut connections at random points, some failing after retry_timeout:
    what the servers applied plus what the worker owes is exactly every gradient pushed."""
    from fault_proxy import FaultProxy

    cluster = cluster_factory(2)
    shape = (512, 32)  # a quarter of the rows is 16 KB: several chunks of 4 KB per shard
    with PSClient(cluster.addresses, register=False) as direct:
        direct.create_variable("w", shape=shape, initializer="zeros", optimizer=SGD(learning_rate=1.0),
                               partitioner=FixedShardsPartitioner(2))
    proxies = [FaultProxy(server.port, seed=700 + i, mean_bytes_up=12_000, mean_bytes_down=1_000,
                          cut_at_start=0.1)
               for i, server in enumerate(cluster.servers)]
    total = np.zeros(shape, np.float32)
    failed = 0
    try:
        with PSClient([p.address for p in proxies], worker_id="topk-cuts", register=False, topk_ratio=0.25,
                      chunk_bytes=4096, retry_timeout=0.1, connect_timeout=60) as client:
            for step in range(40):
                gradient = _grad(100 + step, shape)
                total += gradient  # every gradient given to push() is taken in, also by one that raises
                try:
                    client.push({"w": gradient})
                except PSUnavailableError:
                    failed += 1
            for proxy in proxies:
                proxy.cutting = False
            for attempt in range(20):  # a push that returns has completed every unfinished one before it
                try:
                    client.push({"w": np.zeros(shape, np.float32)})
                    break
                except PSUnavailableError:
                    continue
            else:
                pytest.fail("no push got through after the proxies stopped cutting")
            owed = client.gradient_residuals()["w"]
            cuts = sum(p.stats.cuts for p in proxies)
    finally:
        for proxy in proxies:
            proxy.stop()
    with PSClient(cluster.addresses, register=False) as direct:
        pulled = direct.pull(["w"])["w"]
    print(f"{failed} of 40 pushes failed, {cuts} connections cut")
    assert failed > 0 and cuts > 0, (failed, cuts)
    np.testing.assert_array_equal(-pulled + owed, total)


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

"""Row requests larger than one message: split to fit --max-message-bytes, pushed exactly once.

pull_rows and push_rows carry their row ids in the request. With
``--max-message-bytes 256 KiB`` (chunk_bytes at most 128 KiB), 100,000 ids
are 800 KB: a pull goes as several requests per shard, a push as one push
whose begin spans several messages (PushBegin.continued), so its chunks share
one sequence. SGD(lr=1) on integer gradients makes every value exact.
"""

from __future__ import annotations

import threading

import numpy as np
from fault_proxy import FaultProxy

from worker_client import SGD, PSClient

LIMITS = ("--max-message-bytes", str(256 << 10), "--chunk-bytes", str(64 << 10))


def test_many_row_ids_fit_small_messages_with_exact_values(cluster_factory):
    cluster = cluster_factory(2, *LIMITS)
    rng = np.random.default_rng(5)
    with PSClient(cluster.addresses) as client:
        assert client.chunk_bytes == 128 << 10  # the servers' bound: half their message limit
        client.create_embedding("e", dim=4, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.create_variable("d", shape=(300_000, 2), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        ids = rng.choice(1 << 40, size=100_000, replace=False)
        grads = rng.integers(-8, 9, size=(len(ids), 4)).astype(np.float32)
        client.push_rows("e", ids, grads)
        # Repeated ids (summed before sending) and a dense variable's rows.
        rows = rng.permutation(300_000)[:150_000]
        twice = np.concatenate([rows, rows[:50_000]])
        dense_grads = rng.integers(-8, 9, size=(len(twice), 2)).astype(np.float32)
        client.push_rows("d", twice, dense_grads)

        order = rng.permutation(len(ids))
        np.testing.assert_array_equal(client.pull_rows("e", ids[order]), -grads[order])
        repeated = np.concatenate([ids, ids[:30_000]])  # the path that fetches each id once
        np.testing.assert_array_equal(client.pull_rows("e", repeated),
                                      -np.concatenate([grads, grads[:30_000]]))
        expected = np.zeros((300_000, 2), np.float32)
        np.subtract.at(expected, twice, dense_grads)
        np.testing.assert_array_equal(client.pull_rows("d", np.arange(300_000)), expected)
        np.testing.assert_array_equal(client.pull(["d"])["d"], expected)
        # Each shard applied one push: the rows of one push_rows are one push per shard, not several.
        assert client.versions("e") == {0: 1, 1: 1}
        assert client.versions("d") == {0: 1, 1: 1}


def test_pushes_of_many_rows_through_cut_connections_count_once(cluster_factory):
    cluster = cluster_factory(2, *LIMITS)
    proxies = [FaultProxy(server.port, seed=300 + i, mean_bytes_up=1_500_000, mean_bytes_down=4_000,
                          cut_at_start=0.05) for i, server in enumerate(cluster.servers)]
    pushes, width = 12, 2
    rng = np.random.default_rng(11)
    ids = [rng.choice(1 << 40, size=60_000, replace=False) for _ in range(pushes)]
    grads = [rng.integers(-4, 5, size=(len(i), width)).astype(np.float32) for i in ids]
    errors: list[BaseException] = []
    stats: list[dict] = []
    try:
        with PSClient(cluster.addresses, worker_id="setup") as direct:
            direct.create_embedding("e", dim=width, initializer="zeros", optimizer=SGD(learning_rate=1.0))

        def worker() -> None:
            try:
                with PSClient([p.address for p in proxies], worker_id="rows", retry_timeout=120,
                              heartbeat=False) as client:
                    for i in range(pushes):
                        client.push_rows("e", ids[i], grads[i])
                    stats.append(client.stats())
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=worker, name="rows-worker")
        thread.start()
        thread.join(300)
        assert not thread.is_alive()
        assert not errors, errors
        expected: dict[int, np.ndarray] = {}
        for push_ids, push_grads in zip(ids, grads):
            for i, g in zip(push_ids.tolist(), push_grads):
                expected[i] = expected.get(i, 0) - g
        with PSClient(cluster.addresses, worker_id="check") as direct:
            unique = np.unique(np.concatenate(ids))
            pulled = direct.pull_rows("e", unique)
        want = np.stack([expected[i] for i in unique.tolist()]).astype(np.float32)
        assert pulled.tobytes() == want.tobytes()
        cut = sum(p.stats.cut_client_to_server + p.stats.cut_server_to_client for p in proxies)
        print(f"\nrow pushes {pushes}, retries {stats[0]['retries']}, duplicate acks "
              f"{stats[0]['duplicate_acks']}, connections cut {cut}")
        assert cut > 0 and stats[0]["retries"] > 0  # the faults really happened
    finally:
        for proxy in proxies:
            proxy.stop()

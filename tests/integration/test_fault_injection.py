"""Exactly-once pushes through connections cut at random points.

Several workers push known integer gradients through fault-injecting
proxies in front of both shards. Connections are cut before requests, in
the middle of chunked pushes, and after a server applied a push but before
its acknowledgement arrived; the clients retry with the same (worker,
incarnation, sequence) and the servers deduplicate. With SGD(lr=1) on
integer gradients the result is exact arithmetic, so the final values must
equal initial minus the sum of all gradients, bit for bit: nothing lost,
nothing applied twice.
"""

from __future__ import annotations


import numpy as np
import pytest
from fault_proxy import FaultProxy
from ps_testing import run_in_threads

from worker_client import SGD, FixedShardsPartitioner, PSClient

WORKERS = 4
PUSHES = 500  # per worker: 2,000 pushes in all
BIG = (100, 200)  # 80 KB, split over both shards, 8 KB chunks: 5 chunks per shard per push
SMALL = (5,)


def gradients(worker: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([worker, step, 7])
    return {"big": rng.integers(-3, 4, size=BIG).astype(np.float32),
            "small": rng.integers(-3, 4, size=SMALL).astype(np.float32)}


@pytest.mark.parametrize("chunk_bytes,pushes", [
    (8192, PUSHES),  # 40 KB per shard in 8 KB chunks: streamed Push calls, cut mid-push
    (1 << 20, PUSHES // 2),  # one message per shard: the long-lived Exchange stream
])
def test_random_connection_cuts_lose_nothing_and_duplicate_nothing(cluster_factory, chunk_bytes, pushes):
    cluster = cluster_factory(2)
    proxies = [FaultProxy(server.port, seed=100 + i, mean_bytes_up=250_000, mean_bytes_down=3_000,
                          cut_at_start=0.05) for i, server in enumerate(cluster.servers)]
    try:
        with PSClient(cluster.addresses, worker_id="setup") as direct:
            direct.create_variable("big", shape=BIG, optimizer=SGD(learning_rate=1.0),
                                   partitioner=FixedShardsPartitioner(2))
            direct.create_variable("small", shape=SMALL, initializer="constant", optimizer=SGD(learning_rate=1.0))
            initial = direct.pull()

        def worker(index: int) -> dict:
            with PSClient([p.address for p in proxies], worker_id=f"worker-{index}", chunk_bytes=chunk_bytes,
                          retry_timeout=120, heartbeat=False) as client:
                for step in range(pushes):
                    client.push(gradients(index, step))
                return client.stats()

        stats = run_in_threads(worker, WORKERS)

        with PSClient(cluster.addresses, worker_id="check") as direct:
            final = direct.pull()
        expected = {name: value.astype(np.float64) for name, value in initial.items()}
        for w in range(WORKERS):
            for step in range(pushes):
                for name, grad in gradients(w, step).items():
                    expected[name] -= grad
        for name in expected:
            assert final[name].tobytes() == expected[name].astype(np.float32).tobytes(), name

        cut = [p.stats for p in proxies]
        totals = {key: sum(getattr(s, key) for s in cut)
                  for key in ("connections", "cut_at_start", "cut_client_to_server", "cut_server_to_client")}
        duplicates = sum(s["duplicate_acks"] for s in stats)
        retries = sum(s["retries"] for s in stats)
        print(f"\npushes {WORKERS * pushes}, retries {retries}, duplicate acks {duplicates}, proxy {totals}")
        # The faults really happened, in every phase.
        assert totals["cut_at_start"] > 0
        assert totals["cut_client_to_server"] > 0
        assert totals["cut_server_to_client"] > 0
        assert duplicates > 0, "no acknowledgement was lost after an applied push"
    finally:
        for proxy in proxies:
            proxy.stop()

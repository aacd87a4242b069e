"""A worker given every replica of a shard keeps training through a SIGKILL of the primary.

Real ps-server replicas (--replicas 2) on a real etcd (tests/etcd_server.py
skips where etcd is not installed). The client is given the replicated
address form, backup first; it finds the primary, and when the primary dies
it follows the survivor on its own: no push raises, and every acknowledged
push is in the value exactly once.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest
from replica_testing import ReplicatedCluster

from worker_client import SGD, PSClient, Zeros


@pytest.fixture
def replicated(tmp_path, etcd_server):
    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 2).start()
    yield cluster
    cluster.stop()


def test_pushes_go_on_through_a_failover_and_none_is_lost_or_repeated(replicated):
    primary = replicated.primary(0)
    backup = next(r for r in replicated.shards[0] if r is not primary)
    addresses = f"{backup.address}|{primary.address}"
    acknowledged: list[float] = []  # the time each push was acknowledged
    stop = threading.Event()
    failures: list[BaseException] = []
    with PSClient(addresses, worker_id="w0", retry_timeout=60) as client:
        assert client.primaries == (primary.address,)
        client.create_variable("small", (16,), initializer=Zeros(), optimizer=SGD(1.0))
        client.create_variable("large", (300_000,), initializer=Zeros(), optimizer=SGD(1.0))

        def push() -> None:
            try:
                while not stop.is_set():
                    # Small over the Exchange lane, large as a Push stream.
                    client.push({"small": -np.ones(16, np.float32), "large": -np.ones(300_000, np.float32)})
                    acknowledged.append(time.monotonic())
            except BaseException as exc:  # noqa: BLE001 - reported by the test below
                failures.append(exc)

        pusher = threading.Thread(target=push)
        pusher.start()
        while len(acknowledged) < 20:
            assert pusher.is_alive(), failures
            time.sleep(0.01)
        primary.process.signal(signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 30
        while not any(t > killed for t in acknowledged[-5:]) and time.monotonic() < deadline:
            time.sleep(0.01)
        count_after_kill = len(acknowledged)
        while len(acknowledged) < count_after_kill + 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        pusher.join(60)
        assert not failures, failures
        first_after = min(t for t in acknowledged if t > killed)
        assert client.primaries == (backup.address,)
        values = client.pull()
        np.testing.assert_array_equal(values["small"], np.full(16, len(acknowledged), np.float32))
        np.testing.assert_array_equal(values["large"], np.full(300_000, len(acknowledged), np.float32))
    assert first_after - killed < 10, f"the first push after the kill took {first_after - killed:.2f}s"

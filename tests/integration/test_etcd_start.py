"""A replica starts when etcd answers late: a slow first connection, or etcd starting after it.

Real etcd (tests/etcd_server.py) behind a loopback proxy that holds the first
connection (tests/delaying_proxy.py), real ps-server processes. Without etcd
at all, the replica gives up after --etcd-start-timeout with a message that
names the endpoints, and exits non-zero.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from delaying_proxy import DelayingProxy
from ps_testing import free_port
from replica_testing import ReplicatedCluster

from ps_server.coordination import EtcdClient
from worker_client import SGD, PSClient

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def proxies():
    made: list[DelayingProxy] = []

    def make(**kwargs) -> DelayingProxy:
        made.append(DelayingProxy(**kwargs))
        return made[-1]

    yield make
    for proxy in made:
        proxy.stop()


@pytest.fixture
def clusters(tmp_path):
    made: list[ReplicatedCluster] = []

    def make(etcd_endpoint: str, *extra_args: str) -> ReplicatedCluster:
        made.append(ReplicatedCluster(tmp_path / f"replicated-{len(made)}", etcd_endpoint, 1, 2,
                                      tuple(extra_args)))
        return made[-1]

    yield make
    for cluster in made:
        cluster.stop()


def test_a_first_connection_slower_than_the_reconnect_backoff_is_waited_for(etcd_server, proxies):
    """One call, no retry: the connection attempt outlasts a 1 s hold (a lost SYN is resent after 1 s)."""
    proxy = proxies(delay=1.0, upstream=etcd_server.endpoint)
    client = EtcdClient([proxy.endpoint])
    try:
        started = time.monotonic()
        assert client.get("/absent") is None
        assert time.monotonic() - started >= 0.9  # it did go through the held connection
    finally:
        client.close()


@pytest.mark.parametrize("etcd", ["slow-first-connection", "starts-2s-later"])
def test_a_replica_joins_when_etcd_answers_late_and_serves(etcd, etcd_server, proxies, clusters):
    if etcd == "slow-first-connection":
        proxy = proxies(delay=1.0, upstream=etcd_server.endpoint)
    else:
        proxy = proxies(delay=0.0, hold_first=0)  # refuses until it has an upstream
    cluster = clusters(proxy.endpoint)
    replica = cluster.shards[0][0]
    replica.launch()
    if etcd == "starts-2s-later":
        time.sleep(2.0)
        assert replica.running(), replica.process.log_text()
        proxy.upstream = etcd_server.endpoint
    replica.wait_ready()
    assert cluster.primary(0, timeout=30) is replica
    with PSClient(replica.address, worker_id="w", retry_timeout=30) as client:
        client.create_variable("v", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.push({"v": -np.ones(4, np.float32)})
        np.testing.assert_array_equal(client.pull(["v"])["v"], np.ones(4, np.float32))
    assert replica.running()
    if etcd == "starts-2s-later":
        assert "waiting for etcd" in replica.process.log_text()


def test_without_etcd_a_replica_exits_within_the_bound_naming_the_endpoints(clusters):
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    cluster = clusters(endpoint, "--etcd-start-timeout", "3")
    replica = cluster.shards[0][0]
    started = time.monotonic()
    replica.launch()
    code = replica.process.wait(timeout=30)
    took = time.monotonic() - started
    log = replica.process.log_text()
    assert code != 0, log
    assert 3.0 <= took < 15.0, log  # the bound, plus the interpreter's start
    assert "waiting for etcd" in log
    cannot = [line for line in log.splitlines() if "cannot start" in line]
    assert cannot and endpoint in cannot[-1] and "--etcd-start-timeout" in cannot[-1], log

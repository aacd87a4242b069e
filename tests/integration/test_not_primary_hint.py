"""A backup's NOT_PRIMARY names the primary on every path, and the client goes there at once.

Real replicated ps-servers (--replicas 2, a TCP lane each) on a real etcd.
The paths: an ordinary call (the primary in the trailing metadata), the
Exchange stream and the TCP lane (the primary in the ExchangeError). Each
test sends the client's shard to the backup first, as after a failover and
back, and checks that the refusal it followed named the primary, and that
what a user reads says so once. A replica that knows no primary (one
waiting for etcd at start) says that, and nothing else, on every path.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from delaying_proxy import DelayingProxy
from replica_testing import Replica, ReplicatedCluster

from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import EXCHANGE_PULL
from wehub_ps.wire.frames import connect
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, PSClient
from worker_client.errors import NotPrimaryError, PSError, PSUnavailableError
from worker_client.transport.lane import ExchangeLane, GrpcStream
from worker_client.transport.tcp_lane import SocketStream

pytestmark = pytest.mark.timeout(180)

LANE = ("--lane-port", "0")


@pytest.fixture
def replicated(tmp_path, etcd_server):
    cluster = ReplicatedCluster(tmp_path / "replicated", etcd_server.endpoint, 1, 2, LANE).start()
    yield cluster
    cluster.stop()


def _lane_port(replica: Replica) -> int:
    with grpc.insecure_channel(replica.address) as channel:
        raw = channel.unary_unary(method_path("Describe"))(
            ps_pb2.DescribeRequest(any_replica=True).SerializeToString(), timeout=10)
    return ps_pb2.DescribeResponse.FromString(raw).lane_port


def _open(client: PSClient, primary: Replica, backup: Replica) -> tuple[object, list[PSError]]:
    """The client's shard, sent from the primary to the backup; the errors it follows from then on."""
    shard = client._session.shards[0]
    shard._watching.set()  # no health watch: only the calls under test move the shard
    shard._watch.join()
    followed: list[PSError] = []
    follow = shard.follow

    def spy(error: PSError) -> bool:
        followed.append(error)
        return follow(error)

    assert shard.follow(PSUnavailableError("gone", address=primary.address, code="UNAVAILABLE"))
    assert client.primaries == (backup.address,)
    shard.follow = spy
    return shard, followed


def _check_followed_the_hint(client: PSClient, followed: list[PSError], primary: Replica,
                             backup: Replica, what: str) -> None:
    assert client.primaries == (primary.address,)
    refusal = followed[0]
    assert isinstance(refusal, NotPrimaryError), refusal
    assert refusal.address == backup.address and refusal.primary == primary.address, refusal
    text = str(refusal)
    assert text.startswith(f"{what}: ps-server {backup.address} is not the primary of its shard"), text
    assert text.count(primary.address) == 1 and "no primary" not in text, text


def _setup(client: PSClient) -> None:
    client.create_variable("small", shape=(8,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
    client.create_variable("large", shape=(600_000,), initializer="zeros", optimizer=SGD(learning_rate=1.0))


def test_an_ordinary_call_follows_the_primary_named_in_the_metadata(replicated):
    primary = replicated.primary(0)
    backup = next(r for r in replicated.shards[0] if r is not primary)
    with PSClient(f"{primary.address}|{backup.address}", worker_id="w", retry_timeout=30) as client:
        _setup(client)
        _, followed = _open(client, primary, backup)
        client.push({"large": -np.ones(600_000, np.float32)})  # a Push stream: too large for the lane
        _check_followed_the_hint(client, followed, primary, backup, "push")
        np.testing.assert_array_equal(client.pull(["large"])["large"], np.ones(600_000, np.float32))


def test_an_exchange_stream_follows_the_primary_named_in_the_error(replicated):
    primary = replicated.primary(0)
    backup = next(r for r in replicated.shards[0] if r is not primary)
    with PSClient(f"{primary.address}|{backup.address}", worker_id="w", retry_timeout=30,
                  tcp_lane=False) as client:
        _setup(client)
        _, followed = _open(client, primary, backup)
        client.push({"small": -np.ones(8, np.float32)})  # one message: over the Exchange stream
        _check_followed_the_hint(client, followed, primary, backup, "push")
        np.testing.assert_array_equal(client.pull(["small"])["small"], np.ones(8, np.float32))


def test_a_tcp_lane_follows_the_primary_named_in_the_error(replicated):
    primary = replicated.primary(0)
    backup = next(r for r in replicated.shards[0] if r is not primary)
    with PSClient(f"{primary.address}|{backup.address}", worker_id="w", retry_timeout=30) as client:
        _setup(client)
        shard, followed = _open(client, primary, backup)
        # A lane opened while the backup was the primary: its port is known, no Describe asks it again
        # (which the backup would refuse through the ordinary call's metadata).
        port = _lane_port(backup)
        opener = shard._conn.tcp_lane
        opener._lane_port = lambda: port
        client.push({"small": -np.ones(8, np.float32)})
        assert opener.on_tcp  # the refusal came over the TCP lane
        _check_followed_the_hint(client, followed, primary, backup, "push")
        np.testing.assert_array_equal(client.pull(["small"])["small"], np.ones(8, np.float32))


@pytest.fixture
def waiting_replica(tmp_path):
    """A replica answering on its ports while it waits for etcd (which never answers): no primary known."""
    proxy = DelayingProxy(delay=0.0, hold_first=0)  # refuses every connection
    cluster = ReplicatedCluster(tmp_path / "waiting", proxy.endpoint, 1, 2, LANE)
    replica = cluster.shards[0][0].start()
    yield replica
    cluster.stop()
    proxy.stop()


def test_a_replica_that_knows_no_primary_says_so_on_every_path(waiting_replica):
    replica = waiting_replica
    pull = ps_pb2.PullRequest(worker_id="w").SerializeToString()
    errors: dict[str, PSError] = {}
    with pytest.raises(NotPrimaryError) as ordinary:
        PSClient(replica.address, worker_id="w", retry_timeout=1, connect_timeout=1)
    errors["ordinary"] = ordinary.value
    with grpc.insecure_channel(replica.address) as channel:
        exchange = channel.stream_stream(method_path("Exchange"))
        lane = ExchangeLane(lambda: GrpcStream(lambda requests, timeout: exchange(requests, timeout=timeout),
                                               replica.address), replica.address, 10)
        assert lane.try_acquire()
        with pytest.raises(NotPrimaryError) as over_stream:
            lane.request(EXCHANGE_PULL, pull, "pull")
        errors["exchange stream"] = over_stream.value
        lane.close()
        lane.release()
        lane.shutdown()

    def open_tcp() -> SocketStream:
        connection = connect(f"127.0.0.1:{_lane_port(replica)}", None, 5)
        connection.send([ps_pb2.LaneHello(incarnation="w").SerializeToString()])
        return SocketStream(connection, replica.address)

    lane = ExchangeLane(open_tcp, replica.address, 10)
    assert lane.try_acquire()
    with pytest.raises(NotPrimaryError) as over_tcp:
        lane.request(EXCHANGE_PULL, pull, "pull")
    errors["tcp lane"] = over_tcp.value
    lane.close()
    lane.release()
    lane.shutdown()
    for path, error in errors.items():
        text = str(error)
        assert error.primary is None, (path, text)
        assert f"ps-server {replica.address} is not the primary of its shard: " in text, (path, text)
        assert "no primary is known yet" in text and "the primary is" not in text, (path, text)
    # The replica kept waiting for etcd all along.
    time.sleep(0.1)
    assert replica.running()

"""Idle Exchange streams have a bound of their own and never lock out other calls.

Each PSClient keeps one Exchange stream per server open for its whole life.
The server counts them apart from ordinary calls (--max-exchange-streams,
at most 2 per worker incarnation): more idle clients than either bound
leave every client's pulls, pushes, heartbeats, creates and checkpoints
working; a refused stream gets RESOURCE_EXHAUSTED with reason
EXCHANGE_STREAMS, and the client sends the request as an ordinary call.
"""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest

from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import EXCHANGE_PULL, decode_envelope, encode_envelope
from wehub_ps.wire.rpc import INCARNATION_METADATA_KEY, method_path
from worker_client import SGD, PSClient

MAX_RPCS = 4
MAX_STREAMS = 3


def _open_stream(channel: grpc.Channel, incarnation: str | None):
    """A stream that has answered one pull (so the server holds it), and the queue that ends it."""
    requests: queue.SimpleQueue = queue.SimpleQueue()
    metadata = ((INCARNATION_METADATA_KEY, incarnation),) if incarnation else None
    stream = channel.stream_stream(method_path("Exchange"))(iter(requests.get, None), timeout=60,
                                                              metadata=metadata)
    pull = ps_pb2.PullRequest(items=[ps_pb2.PullItem(variable="w")], shard_index=0, num_shards=1)
    requests.put(encode_envelope(1, EXCHANGE_PULL, pull.SerializeToString()))
    answer_id, field, _ = decode_envelope(next(stream))
    assert (answer_id, field) == (1, EXCHANGE_PULL)
    return stream, requests


def _expect_refused(channel: grpc.Channel, incarnation: str | None, fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _open_stream(channel, incarnation)
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert dict(error.trailing_metadata())[REASON_METADATA_KEY] == "EXCHANGE_STREAMS"
    assert fragment in error.details(), error.details()


def test_idle_clients_beyond_both_bounds_lock_out_nobody(cluster_factory, tmp_path):
    cluster = cluster_factory(1, "--max-concurrent-rpcs", str(MAX_RPCS),
                              "--max-exchange-streams", str(MAX_STREAMS),
                              "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "3600")
    clients: list[PSClient] = []
    try:
        first = PSClient(cluster.addresses, worker_id="worker-0")
        clients.append(first)
        first.create_variable("w", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        # Twice as many clients as either bound, each holding (or trying to hold) its stream idle.
        for i in range(1, 2 * max(MAX_RPCS, MAX_STREAMS)):
            clients.append(PSClient(cluster.addresses, worker_id=f"worker-{i}"))
        for client in clients:
            client.pull(["w"])  # small: over the lane when the server takes the stream
        assert [c._session.shards[0].lane.refused for c in clients] == [False] * MAX_STREAMS + [True] * (
            len(clients) - MAX_STREAMS)
        with grpc.insecure_channel(cluster.addresses[0]) as channel:
            _expect_refused(channel, "someone-else", f"--max-exchange-streams {MAX_STREAMS}")
        # A newcomer's control calls and every client's data path work: refused lanes fall back.
        with PSClient(cluster.addresses, worker_id="late") as late:
            assert late.create_variable("w", shape=(4,), initializer="zeros",
                                        optimizer=SGD(learning_rate=1.0)).created is False
            assert len(late.checkpoint()) == 1
            late.push({"w": np.ones(4, np.float32)})
            for client in clients:
                client.push({"w": np.ones(4, np.float32)})
            for client in clients:
                np.testing.assert_array_equal(client.pull(["w"])["w"], np.full(4, -(len(clients) + 1.0)))
            workers = late.describe()[0].workers
        live = {w for w, record in workers.items() if record["live"]}
        assert live == {c.worker_id for c in clients} | {"late"}
    finally:
        for client in clients:
            client.close()


def test_one_worker_incarnation_holds_at_most_two_streams(cluster_factory):
    cluster = cluster_factory(1, "--max-exchange-streams", "8")
    with PSClient(cluster.addresses, register=False) as client:
        client.create_variable("w", shape=(4,), initializer="zeros")
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        held = [_open_stream(channel, "inc-a") for _ in range(2)]
        _expect_refused(channel, "inc-a", "worker incarnation inc-a already holds 2 exchange streams")
        held.append(_open_stream(channel, "inc-b"))  # other workers keep their share
        held.append(_open_stream(channel, None))  # a client that does not say is bounded by the total only
        # A stream that ends gives its slot back.
        stream, requests = held.pop(0)
        requests.put(None)
        assert list(stream) == []
        held.append(_open_stream(channel, "inc-a"))
        for stream, requests in held:
            requests.put(None)
            assert list(stream) == []

"""Health, draining and SIGTERM: no push that has started is ever lost."""

from __future__ import annotations

import platform
import signal
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_server import ServerConfig, create_server
from wehub_ps.codec import OutgoingChunk, byte_view, encode_push_request
from wehub_ps.rpc import method_path
from wehub_ps.v1 import ps_pb2
from worker_client import SGD, PSClient, PSUnavailableError

SERVICE = "wehub_ps.v1.ParameterServer"


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status


@pytest.fixture
def in_process_server():
    server = create_server(ServerConfig(host="127.0.0.1", port=0, drain_timeout=20))
    yield server
    server.grpc_server.stop(0)


def test_health_is_not_serving_until_started(in_process_server):
    server = in_process_server
    # Bound but not serving yet: the servicer already answers NOT_SERVING.
    server.start_transport()
    assert _health(f"127.0.0.1:{server.port}") == health_pb2.HealthCheckResponse.NOT_SERVING
    server.mark_serving()
    assert _health(f"127.0.0.1:{server.port}") == health_pb2.HealthCheckResponse.SERVING


def test_stop_drains_a_push_in_flight_and_refuses_new_work(in_process_server):
    server = in_process_server
    server.start()
    address = f"127.0.0.1:{server.port}"
    with PSClient([address]) as client:
        client.create_variable("w", shape=(1000,), initializer="zeros", optimizer=SGD(learning_rate=1.0))

    # A push whose second half waits until the server has started draining.
    release = threading.Event()
    ones = np.ones(1000, np.float32)

    def messages():
        begin = ps_pb2.PushBegin(worker_id="slow", incarnation="i", sequence=1, shard_index=0, num_shards=1,
                                 kind=ps_pb2.GRADIENT,
                                 items=[ps_pb2.PushItem(variable="w", elements=1000, wire_dtype=ps_pb2.FLOAT32)])
        header = ps_pb2.ChunkHeader(variable="w", offset=0, count=500, dtype=ps_pb2.FLOAT32)
        yield encode_push_request(begin, [OutgoingChunk(header, byte_view(ones[:500]))])
        release.wait(10)
        header = ps_pb2.ChunkHeader(variable="w", offset=500, count=500, dtype=ps_pb2.FLOAT32)
        yield encode_push_request(None, [OutgoingChunk(header, byte_view(ones[500:]))])

    channel = grpc.insecure_channel(address)
    future = channel.stream_unary(method_path("Push")).future(messages(), timeout=30)
    while server.lifecycle.in_flight == 0:
        time.sleep(0.01)
    stopper = threading.Thread(target=server.stop, kwargs={"grace": 5})
    stopper.start()
    while server.lifecycle.accepting:
        time.sleep(0.01)
    assert _health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(PSUnavailableError, match="shutting down"):
        with PSClient([address], connect_timeout=5, retry_timeout=0.5) as late:
            late.push({"w": ones})
    release.set()
    response = ps_pb2.PushResponse.FromString(future.result())
    assert response.elements_applied == 1000
    stopper.join(30)
    assert not stopper.is_alive()
    np.testing.assert_array_equal(server.store.get("w").value, -ones)
    channel.close()


def test_sigterm_during_pushes_finishes_them_and_exits_zero(cluster_factory):
    cluster = cluster_factory(1)
    server = cluster.servers[0]
    applied = []
    failures = []
    with PSClient(cluster.addresses, retry_timeout=2) as client:
        client.create_variable("w", shape=(2000, 1000), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        grad = np.ones((2000, 1000), np.float32)
        stop = threading.Event()

        def pusher():
            while not stop.is_set():
                try:
                    client.push({"w": grad})
                    applied.append(1)
                except PSUnavailableError as exc:
                    failures.append(exc)
                    return

        thread = threading.Thread(target=pusher)
        thread.start()
        while len(applied) < 3:
            time.sleep(0.01)
        server.signal(signal.SIGTERM)
        assert server.wait(30) == 0
        stop.set()
        thread.join(30)
    log = server.log_text()
    assert '"event": "stopped", "drained": true' in log
    # Every push that was acknowledged was applied; none was cut in half:
    # the server answered each one in full or refused it before it began.
    assert failures, "the pusher should have been refused once the server stopped"


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="malloc settings exist in glibc only")
@pytest.mark.parametrize("flags, arena_max", [((), "2"), (("--malloc-arenas", "0"), "null"),
                                              (("--malloc-arenas", "6"), "6")])
def test_the_server_caps_malloc_arenas_as_configured(cluster_factory, flags, arena_max):
    server = cluster_factory(1, "--log-level", "debug", *flags).servers[0]
    with PSClient(server.address) as client:
        client.create_variable("w", shape=(4,))  # the server is up and serving
    assert f'"arena_max": {arena_max}' in server.log_text()

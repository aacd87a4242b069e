"""TLS, mutual TLS, bearer tokens and server limits: refusals change nothing."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_material import make_tls_material

from wehub_ps.codec import OutgoingChunk, byte_view, encode_push_request
from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.rpc import method_path
from wehub_ps.v1 import ps_pb2
from worker_client import SGD, AuthenticationError, PSClient, PSUnavailableError, ResourceExhaustedError

QUICK = {"connect_timeout": 3, "retry_timeout": 1, "control_timeout": 3}


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls_material(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    return path


def _state(address: str, **client_args) -> dict:
    with PSClient([address], register=False, **client_args) as client:
        return {name: value.tobytes() for name, value in client.pull().items()}


def test_tls_server_with_token(cluster_factory, tls, token_file):
    cluster = cluster_factory(1, "--tls-cert", str(tls.server.cert), "--tls-key", str(tls.server.key),
                              "--auth-token-file", str(token_file))
    address = cluster.addresses[0]
    good = dict(tls_ca=str(tls.ca.cert), auth_token_file=str(token_file))
    with PSClient([address], **good) as client:
        client.create_variable("w", shape=(100,), initializer="uniform", optimizer=SGD(learning_rate=1.0))
        client.push({"w": np.ones(100, np.float32)})
    before = _state(address, **good)

    with pytest.raises(PSUnavailableError):  # plaintext against TLS: the handshake never completes
        PSClient([address], **QUICK)
    with pytest.raises(PSUnavailableError):  # a CA that did not sign the server's certificate
        PSClient([address], tls_ca=str(tls.other_ca.cert), auth_token="s3cret-token", **QUICK)
    with pytest.raises(AuthenticationError, match="bearer token"):
        PSClient([address], tls_ca=str(tls.ca.cert), **QUICK)
    with pytest.raises(AuthenticationError, match="not valid"):
        PSClient([address], tls_ca=str(tls.ca.cert), auth_token="wrong", **QUICK)
    # Raw pushes without a token are refused before they touch anything.
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca.cert.read_bytes())
    with grpc.secure_channel(address, creds) as channel:
        begin = ps_pb2.PushBegin(worker_id="x", incarnation="i", sequence=1, shard_index=0, num_shards=1,
                                 kind=ps_pb2.GRADIENT,
                                 items=[ps_pb2.PushItem(variable="w", elements=100, wire_dtype=ps_pb2.FLOAT32)])
        header = ps_pb2.ChunkHeader(variable="w", offset=0, count=100, dtype=ps_pb2.FLOAT32)
        message = encode_push_request(begin, [OutgoingChunk(header, byte_view(np.ones(100, np.float32)))])
        with pytest.raises(grpc.RpcError) as info:
            channel.stream_unary(method_path("Push"))(iter([message]), timeout=5,
                                                     metadata=(("authorization", "Bearer nope"),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert dict(info.value.trailing_metadata())[REASON_METADATA_KEY] == "UNAUTHENTICATED"
        # Health needs no token (kubelet and load balancers call it).
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="wehub_ps.v1.ParameterServer"), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    assert _state(address, **good) == before


def test_mutual_tls(cluster_factory, tls):
    cluster = cluster_factory(1, "--tls-cert", str(tls.server.cert), "--tls-key", str(tls.server.key),
                              "--tls-client-ca", str(tls.ca.cert))
    address = cluster.addresses[0]
    with PSClient([address], tls_ca=str(tls.ca.cert), tls_cert=str(tls.client.cert),
                  tls_key=str(tls.client.key)) as client:
        client.create_variable("v", shape=(4,))
        assert client.pull(["v"])["v"].shape == (4,)
    with pytest.raises(PSUnavailableError):  # no client certificate
        PSClient([address], tls_ca=str(tls.ca.cert), **QUICK)
    with pytest.raises(PSUnavailableError):  # a client certificate from another CA
        PSClient([address], tls_ca=str(tls.ca.cert), tls_cert=str(tls.other_client.cert),
                 tls_key=str(tls.other_client.key), **QUICK)


def test_the_token_file_is_reread_when_it_changes(cluster_factory, token_file):
    cluster = cluster_factory(1, "--auth-token-file", str(token_file))
    address = cluster.addresses[0]
    with PSClient([address], auth_token="s3cret-token", register=False) as client:
        client.create_variable("v", shape=(3,))
    token_file.write_text("rotated-token\n")
    deadline = time.monotonic() + 15
    while True:
        try:
            PSClient([address], auth_token="s3cret-token", register=False, **QUICK).close()
        except AuthenticationError:
            break
        assert time.monotonic() < deadline, "the server kept accepting the old token"
        time.sleep(0.5)
    with PSClient([address], auth_token="rotated-token", register=False) as client:
        assert set(client.pull()) == {"v"}


def test_limits_answer_resource_exhausted_and_change_nothing(cluster_factory):
    cluster = cluster_factory(1, "--max-variables", "2", "--max-message-bytes", str(2 << 20),
                              "--max-concurrent-rpcs", "4")
    address = cluster.addresses[0]
    with PSClient([address], register=False) as client:
        client.create_variable("a", shape=(10,))
        client.create_variable("b", shape=(10,))
        before = client.pull()
        with pytest.raises(ResourceExhaustedError, match="--max-variables"):
            client.create_variable("c", shape=(10,))
        assert set(client.pull()) == {"a", "b"}
    with grpc.insecure_channel(address) as channel:
        # A message over --max-message-bytes is refused by the transport itself.
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(method_path("Describe"))(b"\x00" * (3 << 20), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # More concurrent calls than --max-concurrent-rpcs: the extra one is refused.
        release = threading.Event()

        def hanging():
            release.wait(20)
            yield b""

        held = [channel.stream_unary(method_path("Push")).future(hanging(), timeout=30) for _ in range(4)]
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(method_path("Describe"))(ps_pb2.DescribeRequest().SerializeToString(), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        for future in held:
            with pytest.raises(grpc.RpcError):
                future.result()  # empty pushes: INVALID_ARGUMENT, after the slot was held
    with PSClient([address], register=False) as client:
        after = client.pull()
    assert {k: v.tobytes() for k, v in after.items()} == {k: v.tobytes() for k, v in before.items()}

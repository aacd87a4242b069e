"""TLS, mutual TLS, bearer tokens and server limits: refusals change nothing."""

from __future__ import annotations

import ssl
import threading
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ps_testing import free_port

from wehub_ps.errors import REASON_METADATA_KEY
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import OutgoingChunk, encode_push_request
from wehub_ps.wire.rpc import method_path
from worker_client import (
    SGD,
    AuthenticationError,
    PSClient,
    PSTLSError,
    PSUnavailableError,
    ResourceExhaustedError,
    TLSProblem,
)

QUICK = {"connect_timeout": 3, "retry_timeout": 1, "control_timeout": 3}
# A TLS mismatch must be named at once, not after connect_timeout of retries.
PATIENT = {"connect_timeout": 60, "retry_timeout": 60, "control_timeout": 5}
NAMED_WITHIN_SECONDS = 20.0


def _state(address: str, **client_args) -> dict:
    with PSClient([address], register=False, **client_args) as client:
        return {name: value.tobytes() for name, value in client.pull().items()}


def _tls_refusal(address: str, problem: TLSProblem, **client_args) -> PSTLSError:
    """Connecting fails with PSTLSError naming ``problem``, well before connect_timeout."""
    started = time.monotonic()
    with pytest.raises(PSTLSError) as info:
        PSClient([address], register=False, **PATIENT, **client_args)
    elapsed = time.monotonic() - started
    assert info.value.problem == problem, info.value
    assert elapsed < NAMED_WITHIN_SECONDS, f"named after {elapsed:.1f}s: {info.value}"
    assert info.value.address == address
    return info.value


def _wait_until_refused(address: str, token: str) -> None:
    """Until the server refuses ``token`` on new calls (it re-reads its token file every 2 s)."""
    deadline = time.monotonic() + 15
    while True:
        try:
            PSClient([address], auth_token=token, register=False, **QUICK).close()
        except AuthenticationError:
            return
        assert time.monotonic() < deadline, "the server kept accepting the old token"
        time.sleep(0.5)


def test_tls_server_with_token(cluster_factory, tls, token_file):
    cluster = cluster_factory(1, "--tls-cert", str(tls.server.cert), "--tls-key", str(tls.server.key),
                              "--auth-token-file", str(token_file))
    address = cluster.addresses[0]
    good = dict(tls_ca=str(tls.ca.cert), auth_token_file=str(token_file))
    with PSClient([address], **good) as client:
        client.create_variable("w", shape=(100,), initializer="uniform", optimizer=SGD(learning_rate=1.0))
        client.push({"w": np.ones(100, np.float32)})
    before = _state(address, **good)

    _tls_refusal(address, TLSProblem.SERVER_USES_TLS, auth_token="s3cret-token")
    _tls_refusal(address, TLSProblem.SERVER_CERTIFICATE_UNTRUSTED, tls_ca=str(tls.other_ca.cert),
                 auth_token="s3cret-token")
    _tls_refusal(address, TLSProblem.SERVER_NAME_MISMATCH, tls_ca=str(tls.ca.cert),
                 server_name="not-ps.example", auth_token="s3cret-token")
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
        # Nor can a table be read out (ExportRows) without one.
        export = ps_pb2.ExportRowsRequest(variable="w", shard_index=0, num_shards=1).SerializeToString()
        with pytest.raises(grpc.RpcError) as info:
            list(channel.unary_stream(method_path("ExportRows"))(export, timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
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
    _tls_refusal(address, TLSProblem.CLIENT_CERTIFICATE_REQUIRED, tls_ca=str(tls.ca.cert))
    _tls_refusal(address, TLSProblem.CLIENT_CERTIFICATE_REFUSED, tls_ca=str(tls.ca.cert),
                 tls_cert=str(tls.other_client.cert), tls_key=str(tls.other_client.key))
    # Given as bytes instead of paths: the same check.
    _tls_refusal(address, TLSProblem.CLIENT_CERTIFICATE_REFUSED, tls_ca=tls.ca.cert.read_bytes(),
                 tls_cert=tls.other_client.cert.read_bytes(), tls_key=tls.other_client.key.read_bytes())
    _tls_refusal(address, TLSProblem.SERVER_USES_TLS)


def test_a_tls_client_against_a_plaintext_server_is_told_so(cluster_factory, tls):
    address = cluster_factory(1).addresses[0]
    _tls_refusal(address, TLSProblem.SERVER_PLAINTEXT, tls_ca=str(tls.ca.cert))


def test_a_down_server_is_not_a_tls_problem(tls):
    """Nothing listening: the client retries until connect_timeout, as for any unavailable server."""
    with pytest.raises(PSUnavailableError):
        PSClient([f"127.0.0.1:{free_port()}"], register=False, tls_ca=str(tls.ca.cert), **QUICK)


def test_client_tls_files_are_checked_when_the_client_is_built(tls):
    with pytest.raises(ValueError, match="tls_cert and tls_key"):  # a key of another certificate
        PSClient(["127.0.0.1:1"], tls_ca=str(tls.ca.cert), tls_cert=str(tls.client.cert),
                 tls_key=str(tls.other_client.key))
    with pytest.raises(ValueError, match="tls_ca holds no PEM certificate"):
        PSClient(["127.0.0.1:1"], tls_ca=str(tls.client.key))


def test_a_certificate_and_key_that_do_not_match_stop_the_server(cluster_factory, tls):
    popen = cluster_factory.process("-m", "ps_server", "--host", "127.0.0.1", "--port", "0",
                                    "--tls-cert", str(tls.server.cert), "--tls-key", str(tls.client.key))
    _, stderr = popen.communicate(timeout=60)
    assert popen.returncode == 2, stderr
    assert "--tls-key" in stderr and "do not match" in stderr, stderr


def test_metrics_under_mutual_tls_need_a_client_certificate_and_the_token(cluster_factory, tls, token_file):
    port = free_port()
    cluster_factory(1, "--tls-cert", str(tls.server.cert), "--tls-key", str(tls.server.key),
                    "--tls-client-ca", str(tls.ca.cert), "--auth-token-file", str(token_file),
                    "--metrics-port", str(port))

    def scrape(pair, token: str | None) -> tuple[int, bytes]:
        context = ssl.create_default_context(cafile=str(tls.ca.cert))
        if pair is not None:
            context.load_cert_chain(str(pair.cert), str(pair.key))
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(f"https://127.0.0.1:{port}/metrics", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    for pair in (None, tls.other_client):  # no certificate, or one from another CA: no TLS session at all
        with pytest.raises(OSError) as info:
            scrape(pair, "s3cret-token")
        assert not isinstance(info.value, urllib.error.HTTPError), info.value
    assert scrape(tls.client, None)[0] == 401
    assert scrape(tls.client, "wrong")[0] == 401
    status, body = scrape(tls.client, "s3cret-token")
    assert status == 200 and b"wehub_ps_live_workers" in body


def test_a_rotated_token_cuts_open_streams_and_mounted_clients_follow(cluster_factory, tmp_path):
    server_token = tmp_path / "server-token"
    server_token.write_text("old-token\n")
    address = cluster_factory(1, "--auth-token-file", str(server_token)).addresses[0]
    mounted = tmp_path / "mounted-token"  # a worker's mount of the same Secret, updated with the server's
    lagging = tmp_path / "lagging-token"  # one the kubelet updates later
    for path in (mounted, lagging):
        path.write_text("old-token\n")
    with PSClient([address], auth_token="old-token", register=False) as fixed, \
            PSClient([address], auth_token_file=str(mounted), register=False, retry_timeout=60) as follower, \
            PSClient([address], auth_token_file=str(lagging), register=False, retry_timeout=60) as late:
        fixed.create_variable("w", shape=(4,), optimizer=SGD(learning_rate=1.0))
        for client in (fixed, follower, late):  # each opens its Exchange stream with the old token
            client.push({"w": np.ones(4, np.float32)})
        server_token.write_text("new-token\n")
        mounted.write_text("new-token\n")
        _wait_until_refused(address, "old-token")
        # The stream opened with the old token is still open; its next push is cut, not applied.
        with pytest.raises(AuthenticationError, match="rotated") as info:
            fixed.push({"w": np.full(4, 100.0, np.float32)})
        assert info.value.reason == "UNAUTHENTICATED"
        follower.push({"w": np.ones(4, np.float32)})  # refused, re-reads its file, pushed again
        updater = threading.Timer(1.0, lambda: lagging.write_text("new-token\n"))
        updater.start()
        try:
            late.push({"w": np.ones(4, np.float32)})  # waits for its file to change, then pushed
        finally:
            updater.join()
    with PSClient([address], auth_token="new-token", register=False) as reader:
        assert reader.pull(["w"])["w"].tolist() == [-5.0] * 4


def test_the_token_file_is_reread_when_it_changes(cluster_factory, token_file):
    cluster = cluster_factory(1, "--auth-token-file", str(token_file))
    address = cluster.addresses[0]
    with PSClient([address], auth_token="s3cret-token", register=False) as client:
        client.create_variable("v", shape=(3,))
    token_file.write_text("rotated-token\n")
    _wait_until_refused(address, "s3cret-token")
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

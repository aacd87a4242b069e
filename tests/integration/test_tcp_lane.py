"""The TCP lane (``--lane-port``): small pulls and pushes as socket frames, with the Exchange stream's rules.

Real ps-server processes; raw sockets stand in for hostile clients. Which
lane a client uses is read from its connection (``tcp_lane.on_tcp``), the
one place that knows.
"""

from __future__ import annotations

import signal
import socket
import ssl
import struct
import time

import grpc
import numpy as np
import pytest
from ps_testing import ROOT, Cluster, ServerProcess, memory_status, run_in_threads

from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.arrays import byte_view
from wehub_ps.wire.codec import (
    EXCHANGE_ERROR,
    EXCHANGE_PULL,
    EXCHANGE_PUSH,
    OutgoingChunk,
    decode_envelope,
    encode_envelope,
    encode_push_request,
)
from wehub_ps.wire.rpc import method_path
from worker_client import SGD, PSClient, PSError

LANE = ("--lane-port", "0")
QUICK = dict(connect_timeout=10, retry_timeout=10)
_LENGTH = struct.Struct("<I")


def _on_tcp(client: PSClient) -> list[bool]:
    """Whether each shard's lane is open, on the server's TCP lane."""
    return [shard._conn.tcp_lane is not None and shard._conn.tcp_lane.on_tcp
            and shard._conn.lane._stream is not None for shard in client._session.shards]


def _lane_port(address: str, token: str | None = None) -> int:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(address) as channel:
        raw = channel.unary_unary(method_path("Describe"))(ps_pb2.DescribeRequest().SerializeToString(),
                                                          timeout=10, metadata=metadata)
    return ps_pb2.DescribeResponse.FromString(raw).lane_port



class RawLane:
    """A hand-made lane connection: frames in, frames out, nothing checked."""

    def __init__(self, port: int, tls_context: ssl.SSLContext | None = None) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock = tls_context.wrap_socket(sock, server_hostname="localhost") if tls_context else sock

    def send_frame(self, payload: bytes) -> None:
        self.sock.sendall(_LENGTH.pack(len(payload)) + payload)

    def hello(self, token: str = "", incarnation: str = "raw") -> None:
        self.send_frame(ps_pb2.LaneHello(token=token, incarnation=incarnation).SerializeToString())

    def read_frame(self) -> bytes | None:
        """The next frame, or None when the server closed the connection."""
        header = self._read(_LENGTH.size)
        if header is None:
            return None
        body = self._read(_LENGTH.unpack(header)[0])
        assert body is not None, "the connection closed mid-frame"
        return body

    def answer(self) -> tuple[int, int, bytes]:
        frame = self.read_frame()
        assert frame is not None, "the server closed the lane instead of answering"
        answer_id, field, payload = decode_envelope(frame)
        return answer_id, field, bytes(payload)

    def expect_error(self, request_id: int, reason: str) -> ps_pb2.ExchangeError:
        answer_id, field, payload = self.answer()
        assert (answer_id, field) == (request_id, EXCHANGE_ERROR)
        error = ps_pb2.ExchangeError.FromString(payload)
        assert error.reason == reason, error
        return error

    def pull(self, request_id: int, variable: str) -> None:
        request = ps_pb2.PullRequest(items=[ps_pb2.PullItem(variable=variable)], shard_index=0, num_shards=1)
        self.send_frame(encode_envelope(request_id, EXCHANGE_PULL, request.SerializeToString()))

    def _read(self, size: int) -> bytes | None:
        data = b""
        while len(data) < size:
            try:
                chunk = self.sock.recv(size - len(data))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            data += chunk
        return data

    def close(self) -> None:
        self.sock.close()


def test_known_gradients_from_many_workers_are_exact_over_tcp_lanes(cluster_factory):
    cluster = cluster_factory(2, *LANE)
    workers, pushes = 4, 120
    names = [f"v{i}" for i in range(6)]  # spread over both shards
    with PSClient(cluster.addresses, worker_id="setup", register=False) as setup:
        for name in names:
            setup.create_variable(name, shape=(64,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        setup.pull()
        assert _on_tcp(setup) == [True, True]

    def worker(index: int) -> None:
        with PSClient(cluster.addresses, worker_id=f"worker-{index}") as client:
            for _ in range(pushes):
                client.pull(names)
                client.push({name: np.full(64, (index + 1) * (k + 1), np.float32)
                             for k, name in enumerate(names)})
            assert _on_tcp(client) == [True, True]

    run_in_threads(worker, workers, timeout=240)
    total = pushes * sum(range(1, workers + 1))
    with PSClient(cluster.addresses, register=False) as reader:
        values = reader.pull()
    for k, name in enumerate(names):
        np.testing.assert_array_equal(values[name], np.full(64, -total * (k + 1), np.float32))


def test_row_pushes_and_pulls_are_exact_over_tcp_lanes(cluster_factory):
    cluster = cluster_factory(2, *LANE)
    ids = np.arange(40, dtype=np.int64) * 7919 + 10**12  # spread over both shards
    with PSClient(cluster.addresses, worker_id="rows") as client:
        client.create_embedding("emb", dim=4, initializer="zeros", optimizer=SGD(learning_rate=1.0))
        for step in range(20):
            client.push_rows("emb", ids, np.full((len(ids), 4), step + 1, np.float32))
        assert _on_tcp(client) == [True, True]
        rows = client.pull_rows("emb", ids)
        # A dense variable's rows are gathered into the server's answer as it is sent.
        client.create_variable("table", shape=(300, 4), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        dense_ids = np.arange(0, 300, 7, dtype=np.int64)  # both shards' rows
        for step in range(20):
            client.push_rows("table", dense_ids, np.full((len(dense_ids), 4), step + 1, np.float32))
        dense_rows = client.pull_rows("table", dense_ids)
        assert _on_tcp(client) == [True, True]
        whole = client.pull("table")["table"]
    np.testing.assert_array_equal(rows, np.full((len(ids), 4), -sum(range(1, 21)), np.float32))
    np.testing.assert_array_equal(dense_rows, np.full((len(dense_ids), 4), -sum(range(1, 21)), np.float32))
    expected = np.zeros((300, 4), np.float32)
    expected[dense_ids] = -sum(range(1, 21))
    np.testing.assert_array_equal(whole, expected)


def test_bad_hellos_and_frames_get_precise_errors_and_change_nothing(cluster_factory, token_file):
    cluster = cluster_factory(1, *LANE, "--auth-token-file", str(token_file))
    address = cluster.addresses[0]
    with PSClient([address], auth_token="s3cret-token") as client:
        client.create_variable("w", shape=(8,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.push({"w": np.ones(8, np.float32)})
        assert _on_tcp(client) == [True]
        before = client.pull(["w"])["w"].copy()
    port = _lane_port(address, "s3cret-token")

    refusals = [("", "UNAUTHENTICATED", "requires a bearer token"), ("wrong", "UNAUTHENTICATED", "not valid")]
    for token, reason, fragment in refusals:
        lane = RawLane(port)
        lane.hello(token)
        lane.pull(1, "w")  # never read: the hello was refused
        error = lane.expect_error(0, reason)
        assert fragment in error.message and error.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert lane.read_frame() is None
        lane.close()

    lane = RawLane(port)  # a hello announcing 1 MiB: refused on its length, before a byte of it is read
    lane.sock.sendall(_LENGTH.pack(1 << 20) + bytes(1000))
    error = lane.expect_error(0, "")
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "LaneHello" in error.message
    assert lane.read_frame() is None
    lane.close()

    lane = RawLane(port)
    lane.send_frame(b"\xff\xff\xff")  # not a LaneHello
    assert "LaneHello" in lane.expect_error(0, "MALFORMED_MESSAGE").message
    assert lane.read_frame() is None
    lane.close()

    lane = RawLane(port)
    lane.hello("s3cret-token")
    lane.send_frame(b"\x08")  # a truncated envelope: answered, and the lane carries on
    lane.expect_error(0, "MALFORMED_MESSAGE")
    lane.pull(7, "nope")
    lane.expect_error(7, "UNKNOWN_VARIABLE")
    lane.pull(8, "w")
    answer_id, field, _ = lane.answer()
    assert (answer_id, field) == (8, EXCHANGE_PULL)
    lane.sock.sendall(_LENGTH.pack(0xFFFFFFF0))  # a frame over --max-message-bytes: refused unread
    error = lane.expect_error(0, "")
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "--max-message-bytes" in error.message
    assert lane.read_frame() is None
    lane.close()

    lane = RawLane(port)  # a connection that never says hello is closed by the server in time; others go on
    with PSClient([address], auth_token="s3cret-token", register=False) as reader:
        np.testing.assert_array_equal(reader.pull(["w"])["w"], before)
        assert _on_tcp(reader) == [True]
    lane.close()


def test_stalled_large_frames_hold_no_memory_and_the_bound_on_lanes_holds(cluster_factory):
    cluster = cluster_factory(1, *LANE, "--max-exchange-streams", "48")
    server = cluster.servers[0]
    address = cluster.addresses[0]
    with PSClient([address], worker_id="setup", register=False) as client:
        client.create_variable("w", shape=(16,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        before = client.pull(["w"])["w"].copy()
    port = _lane_port(address)
    rss_before = memory_status(server.popen.pid)["VmRSS"]
    lanes = []
    try:
        for i in range(40):  # each announces a 60 MB push and sends 1 KiB of it, then stalls
            lane = RawLane(port)
            lane.hello(incarnation=f"stall-{i}")
            lane.sock.sendall(_LENGTH.pack(60 << 20) + bytes(1024))
            lanes.append(lane)
        extra = [RawLane(port) for _ in range(12)]  # 40 + 12 > 48: the last ones are refused
        for i, lane in enumerate(extra):
            lane.hello(incarnation=f"more-{i}")
            lane.pull(1, "w")
        answers = [lane.answer() for lane in extra]
        lanes += extra
        refused = [decode for decode in answers if decode[1] == EXCHANGE_ERROR]
        assert len(refused) == 4, answers
        for _, _, payload in refused:
            assert ps_pb2.ExchangeError.FromString(payload).reason == "EXCHANGE_STREAMS"
        time.sleep(0.5)
        grown = memory_status(server.popen.pid)["VmRSS"] - rss_before
        assert grown < 64 << 20, f"the server's RSS grew {grown >> 20} MiB for 40 stalled 60 MB frames"
        # Connections that never say hello: past 48 + 64 open ones, each is closed as it is accepted.
        silent = [RawLane(port) for _ in range(80)]
        lanes += silent
        closed = sum(1 for lane in silent[-10:] if lane.read_frame() is None)
        assert closed == 10, f"{10 - closed} of the last 10 connections over the bound were kept open"
        # Every lane is taken, yet a client's pulls and pushes go on over ordinary calls.
        with PSClient([address], worker_id="late", **QUICK) as client:
            client.push({"w": np.ones(16, np.float32)})
            np.testing.assert_array_equal(client.pull(["w"])["w"], before - 1)
            assert _on_tcp(client) == [False]
    finally:
        for lane in lanes:
            lane.close()


def test_tcp_lane_under_mutual_tls(cluster_factory, tls):
    cluster = cluster_factory(1, *LANE, "--tls-cert", str(tls.server.cert), "--tls-key", str(tls.server.key),
                              "--tls-client-ca", str(tls.ca.cert))
    address = cluster.addresses[0]
    material = dict(tls_ca=str(tls.ca.cert), tls_cert=str(tls.client.cert), tls_key=str(tls.client.key))
    with PSClient([address], **material) as client:
        client.create_variable("w", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        for _ in range(5):
            client.push({"w": np.ones(4, np.float32)})
        np.testing.assert_array_equal(client.pull(["w"])["w"], np.full(4, -5, np.float32))
        assert _on_tcp(client) == [True]
        port = client._session.shards[0]._conn.tcp_lane and _lane_port_over_tls(address, tls)
    # Plaintext, and TLS without a client certificate: the handshake fails, nothing is read.
    plain = RawLane(port)
    plain.hello()
    assert plain.read_frame() is None
    plain.close()
    context = ssl.create_default_context(cafile=str(tls.ca.cert))
    with pytest.raises((ssl.SSLError, ConnectionError, AssertionError)):
        anonymous = RawLane(port, context)
        anonymous.hello()
        anonymous.pull(1, "w")
        assert anonymous.read_frame() is not None
    with PSClient([address], register=False, **material) as reader:
        np.testing.assert_array_equal(reader.pull(["w"])["w"], np.full(4, -5, np.float32))


def _lane_port_over_tls(address: str, tls) -> int:
    credentials = grpc.ssl_channel_credentials(root_certificates=tls.ca.cert.read_bytes(),
                                               private_key=tls.client.key.read_bytes(),
                                               certificate_chain=tls.client.cert.read_bytes())
    with grpc.secure_channel(address, credentials) as channel:
        raw = channel.unary_unary(method_path("Describe"))(ps_pb2.DescribeRequest().SerializeToString(),
                                                          timeout=10)
    return ps_pb2.DescribeResponse.FromString(raw).lane_port


def test_a_restarted_server_gets_each_push_once_over_a_new_lane(cluster_factory, tmp_path):
    cluster = cluster_factory(1, *LANE, "--checkpoint-dir", str(tmp_path / "ckpt"),
                              "--checkpoint-interval", "3600")
    server = cluster.servers[0]
    with PSClient(cluster.addresses, worker_id="w0", retry_timeout=60) as client:
        client.create_variable("w", shape=(32,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        for _ in range(50):
            client.push({"w": np.ones(32, np.float32)})
        assert _on_tcp(client) == [True]
        first_port = client._session.shards[0]._conn.tcp_lane and _lane_port(server.address)
        server.stop()  # SIGTERM: pushes in flight finish, the final checkpoint holds every one acknowledged
        server.start(port=server.port)
        assert _lane_port(server.address) != 0
        for _ in range(50):
            client.push({"w": np.ones(32, np.float32)})
        assert _on_tcp(client) == [True]
        np.testing.assert_array_equal(client.pull(["w"])["w"], np.full(32, -100, np.float32))
    assert first_port != 0


def test_a_frozen_server_fails_a_lane_request_at_its_deadline(cluster_factory):
    cluster = cluster_factory(1, *LANE)
    server = cluster.servers[0]
    with PSClient(cluster.addresses, worker_id="w0", data_timeout=1.0, retry_timeout=3.0) as client:
        client.create_variable("w", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.push({"w": np.ones(4, np.float32)})
        assert _on_tcp(client) == [True]
        server.freeze()
        started = time.monotonic()
        try:
            with pytest.raises(PSError):
                client.push({"w": np.ones(4, np.float32)})
            waited = time.monotonic() - started
        finally:
            server.signal(signal.SIGCONT)
        assert waited < 15, f"the push waited {waited:.1f}s for a frozen server"
        client.push({"w": np.ones(4, np.float32)})
        value = client.pull(["w"])["w"]
    # The push that raised may have been applied once the server thawed (docs/failure-semantics.md).
    assert float(value[0]) in (-2.0, -3.0) and np.all(value == value[0]), value


def test_a_rotated_token_cuts_an_open_lane_before_its_next_push_is_applied(cluster_factory, token_file):
    cluster = cluster_factory(1, *LANE, "--auth-token-file", str(token_file))
    address = cluster.addresses[0]
    with PSClient([address], auth_token="s3cret-token", register=False) as client:
        client.create_variable("w", shape=(4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
    port = _lane_port(address, "s3cret-token")
    lane = RawLane(port)
    lane.hello("s3cret-token")
    lane.pull(1, "w")
    assert lane.answer()[:2] == (1, EXCHANGE_PULL)
    token_file.write_text("new-token\n")
    deadline = time.monotonic() + 15
    while True:  # the server re-reads its token file every 2 s
        try:
            _lane_port(address, "s3cret-token")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            break
        assert time.monotonic() < deadline, "the server kept accepting the old token"
        time.sleep(0.2)
    begin = ps_pb2.PushBegin(worker_id="raw", incarnation="raw", sequence=1, shard_index=0, num_shards=1,
                             kind=ps_pb2.GRADIENT,
                             items=[ps_pb2.PushItem(variable="w", elements=4, wire_dtype=ps_pb2.FLOAT32)])
    header = ps_pb2.ChunkHeader(variable="w", offset=0, count=4, dtype=ps_pb2.FLOAT32)
    push = encode_push_request(begin, [OutgoingChunk(header, byte_view(np.ones(4, np.float32)))])
    lane.send_frame(encode_envelope(2, EXCHANGE_PUSH, push))
    error = lane.expect_error(0, "UNAUTHENTICATED")
    assert "rotated" in error.message
    assert lane.read_frame() is None
    lane.close()
    with PSClient([address], auth_token="new-token", register=False) as reader:
        np.testing.assert_array_equal(reader.pull(["w"])["w"], np.zeros(4, np.float32))
        assert _on_tcp(reader) == [True]


@pytest.mark.parametrize("tcp_lane", [True, False], ids=["tcp-lane", "exchange-stream"])
def test_a_server_bug_fails_its_request_at_once_and_the_lane_carries_on(cluster_factory, tmp_path, tcp_lane):
    # A ps-server whose pulls of "boom" raise an exception it does not expect (tests/buggy_ps_server.py).
    server = ServerProcess(0, 1, tmp_path, LANE, program=(str(ROOT / "tests" / "buggy_ps_server.py"),))
    cluster_factory.clusters.append(Cluster([server]))  # stopped at teardown
    server.start()
    with PSClient([server.address], worker_id="bug", tcp_lane=tcp_lane, retry_timeout=120) as client:
        client.create_variable("fine", (4,), initializer="zeros", optimizer=SGD(learning_rate=1.0))
        client.create_variable("boom", (4,), initializer="zeros")
        client.pull("fine")
        assert _on_tcp(client) == [tcp_lane]
        started = time.monotonic()
        with pytest.raises(PSError, match="planted bug") as raised:
            client.pull("boom")
        # Not retried as if the server were unavailable: a bug answers UNKNOWN, as gRPC answers a
        # handler's exception, and the caller hears of it at once.
        assert raised.value.code == "UNKNOWN"
        assert time.monotonic() - started < 30
        client.push({"fine": np.full(4, 3, np.float32)})
        np.testing.assert_array_equal(client.pull("fine")["fine"], np.full(4, -3, np.float32))
        assert _on_tcp(client) == [tcp_lane]
    assert server.popen.poll() is None
    assert "planted bug" in server.log_text()

"""Opening a shard's lane: the server's TCP lane when it has one and can be reached, else the Exchange stream.

A listening socket in the test plays the lane port; a sentinel plays the
gRPC stream (no server needed to tell which one was opened).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
from ps_testing import free_port

from wehub_ps.kernels.rowops import RowGather
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import join_pieces
from wehub_ps.wire.frames import FramedConnection
from worker_client.transport.credentials import BearerToken
from worker_client.transport.tcp_lane import SocketStream, TcpLaneOpener, TcpLaneSettings

GRPC_STREAM = object()


def _opener(port_of, address="127.0.0.1:1") -> tuple[TcpLaneOpener, list[int]]:
    asked: list[int] = []

    def lane_port() -> int:
        asked.append(1)
        return port_of()
    settings = TcpLaneSettings(None, None, BearerToken("tok", None), "inc-1")
    opener = TcpLaneOpener(address, settings, lane_port, lambda: GRPC_STREAM, 2.0)
    return opener, asked


def test_a_server_without_a_lane_port_gets_the_exchange_stream():
    opener, asked = _opener(lambda: 0)
    assert opener() is GRPC_STREAM and not opener.on_tcp and asked == [1]


def test_an_unreachable_lane_port_warns_once_and_uses_the_stream_for_a_while(caplog):
    closed = free_port()
    opener, asked = _opener(lambda: closed)
    with caplog.at_level(logging.WARNING, logger="worker_client"):
        assert opener() is GRPC_STREAM
        assert opener() is GRPC_STREAM  # not asked again, not warned again
    assert asked == [1] and not opener.on_tcp
    warnings = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert len(warnings) == 1 and "--lane-port" in warnings[0].getMessage()


def test_the_lane_says_hello_with_the_token_and_incarnation_then_carries_frames():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    seen: dict[str, object] = {}

    def serve() -> None:
        sock, peer = listener.accept()
        connection = FramedConnection(sock, str(peer))
        seen["hello"] = ps_pb2.LaneHello.FromString(bytes(connection.receive()))
        request = connection.receive()
        connection.send([b"answer to ", bytes(request)])
        connection.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        opener, _ = _opener(lambda: listener.getsockname()[1])
        stream = opener()
        assert isinstance(stream, SocketStream) and opener.on_tcp
        rows = RowGather(np.arange(12, dtype=np.float32).reshape(4, 3), np.array([2, 0]))
        pieces = [b"pi", memoryview(b"ng"), rows]  # written as one frame, the rows gathered
        stream.send(pieces)
        assert bytes(stream.receive("pull")) == b"answer to " + join_pieces(pieces)
        server.join(5)
        hello = seen["hello"]
        assert (hello.token, hello.incarnation) == ("tok", "inc-1")
        try:  # the server closed: the next wait fails as an unavailable server, naming the lane
            stream.receive("pull")
        except Exception as error:  # noqa: BLE001 - the type is checked below
            assert type(error).__name__ == "PSUnavailableError" and "TCP lane" in str(error)
        else:
            raise AssertionError("a closed lane answered")
        stream.close()
    finally:
        listener.close()


def test_leaving_a_connection_ends_a_request_waiting_on_its_tcp_lane():
    """A request waits on a lane whose server never answers (a host cut off); leaving the replica ends it."""
    from wehub_ps.wire.codec import EXCHANGE_PULL
    from worker_client.errors import PSUnavailableError
    from worker_client.transport.channels import _Connection
    from worker_client.transport.lane import ExchangeLane

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    try:
        opener, _ = _opener(lambda: listener.getsockname()[1])
        # A connection (its gRPC channel never used) whose lane opens on the listener above.
        connection = _Connection(f"127.0.0.1:{free_port()}", [], None, lambda: None, 300.0)
        connection.lane = lane = ExchangeLane(opener, "127.0.0.1:1", request_timeout=300.0)
        outcome: dict[str, object] = {}

        def request() -> None:
            assert lane.try_acquire()
            try:
                lane.request(EXCHANGE_PULL, b"", "pull")
            except PSUnavailableError as error:
                outcome["error"] = error
            finally:
                lane.release()

        waiting = threading.Thread(target=request, daemon=True)
        waiting.start()
        accepted, _ = listener.accept()  # the server takes the connection and never answers
        deadline = threading.Event()
        deadline.wait(0.2)
        assert waiting.is_alive(), "the request did not wait"
        connection.close()  # as ShardChannel.follow does when it leaves a replica
        waiting.join(2)
        assert not waiting.is_alive(), "closing the connection did not end the request waiting on its lane"
        assert "TCP lane" in str(outcome["error"])
        accepted.close()
    finally:
        listener.close()


def test_a_lane_that_keeps_breaking_before_answering_falls_back_to_the_stream(caplog, monkeypatch):
    """A lane port that accepts and at once closes (the server's bound on connections reached): two
    breaks before an answer, and the Exchange stream is used (warned once) until the lane port is
    tried again; a lane that answers resets the count."""
    from worker_client.errors import PSUnavailableError
    from worker_client.transport import tcp_lane

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    answer_next = threading.Event()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                sock, peer = listener.accept()
            except OSError:
                return
            if answer_next.is_set():
                connection = FramedConnection(sock, str(peer))
                connection.receive()  # the hello
                connection.send([connection.receive()])
            sock.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    def break_once(opener: TcpLaneOpener) -> None:
        stream = opener()
        assert isinstance(stream, SocketStream) and opener.on_tcp
        try:
            stream.send([b"request"])
            stream.receive("push")
        except PSUnavailableError:
            pass
        else:
            raise AssertionError("a lane closed at its accept answered")
        stream.close()

    try:
        opener, asked = _opener(lambda: listener.getsockname()[1])
        with caplog.at_level(logging.WARNING, logger="worker_client"):
            break_once(opener)
            break_once(opener)
            assert opener() is GRPC_STREAM and not opener.on_tcp
            assert opener() is GRPC_STREAM  # for a while: the lane port is not asked for meanwhile
        assert len(asked) == 2
        warnings = [r for r in caplog.records if "broke 2 times in a row" in r.getMessage()]
        assert len(warnings) == 1
        # The time is up: the lane port is tried again; an answer there resets the count of breaks.
        monkeypatch.setattr(opener, "_unreachable_until", 0.0)
        break_once(opener)
        answer_next.set()
        stream = opener()
        stream.send([b"ping"])
        assert bytes(stream.receive("pull")) == b"ping"
        stream.close()
        answer_next.clear()
        break_once(opener)
        last = opener()
        assert isinstance(last, SocketStream), "one break after an answer fell back"
        last.close()
        assert tcp_lane._BREAKS_BEFORE_FALLBACK == 2
    finally:
        stop.set()
        listener.close()


def test_the_stream_used_instead_of_a_broken_lane_is_replaced_when_the_lane_is_to_be_tried_again():
    from worker_client.transport.lane import LIFETIME_SECONDS, ExchangeLane, GrpcStream

    class _Call:  # what gRPC's stream_stream call returns, as far as the lane uses it
        def cancel(self) -> None:
            pass

    settings = TcpLaneSettings(None, None, BearerToken("tok", None), "inc-1")
    opener = TcpLaneOpener("127.0.0.1:1", settings, lambda: 1,
                           lambda: GrpcStream(lambda requests, timeout: _Call(), "127.0.0.1:1"), 2.0)
    opener._unreachable_until = time.monotonic() + 60.0  # as after the lane broke twice
    lane = ExchangeLane(opener, "127.0.0.1:1")
    lane._reopen()
    assert isinstance(lane._stream, GrpcStream)
    assert 50.0 < lane._lifetime <= 60.0 < LIFETIME_SECONDS * 0.9
    lane.close()

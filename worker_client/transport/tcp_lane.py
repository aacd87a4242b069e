"""A shard connection's TCP lane: Exchange requests as frames on a socket, when the server has a lane port.

A server started with ``--lane-port`` reports that port in Describe
(ps_server.service.tcp_lane). The lane then connects to it on the host the
client reaches the server at, with the client's TLS settings, and sends a
``LaneHello`` (the bearer token and the worker incarnation) before its
first request. A round trip there costs about a sixth of one on the gRPC
Exchange stream, and the caller's thread sends and receives itself, with
no hand-off to gRPC's threads.

A lane port that cannot be reached while the gRPC port can (a firewall, a
Kubernetes Service without the port) must not stop training: the lane
warns once and uses the Exchange stream, trying the port again after
:data:`_UNREACHABLE_SECONDS`.

A lane port that can be reached but keeps breaking is treated the same
way: a TCP lane that connects and then breaks before its first answer
(the server closed it at once because its bound on connections is
reached, a proxy that accepts and drops, a late answer cancelled by the
request's deadline) counts one break; :data:`_BREAKS_BEFORE_FALLBACK`
breaks in a row, and the lane warns and uses the Exchange stream for
:data:`_UNREACHABLE_SECONDS`. The request that met the break fails as
UNAVAILABLE and is retried like any other attempt, so the retry after the
last break goes over the Exchange stream (or an ordinary call, when the
server refuses that stream too). An answer on a TCP lane resets the count.
The Exchange stream opened meanwhile is replaced when that time is up, and
the next request tries the lane port again: once more on the lane, and
back to the stream for as long again if it still breaks.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

from wehub_ps.cluster import ClusterConfigError, split_host_port
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import buffer_pieces
from wehub_ps.wire.frames import ConnectionClosed, FramedConnection, connect
from worker_client.errors import PSUnavailableError
from worker_client.transport.credentials import BearerToken
from worker_client.transport.lane import GrpcStream, LaneStream

__all__ = ["SocketStream", "TcpLaneOpener", "TcpLaneSettings"]

log = logging.getLogger("worker_client")

# After the lane port could not be reached, or its lanes kept breaking: the Exchange stream, for this long.
_UNREACHABLE_SECONDS = 60.0
# TCP lanes in a row that broke before their first answer, before the Exchange stream is used instead.
# Two: one break may be a server restarting; the request that meets it costs one retry.
_BREAKS_BEFORE_FALLBACK = 2


@dataclass(frozen=True)
class TcpLaneSettings:
    """What a connection needs to open a server's TCP lane, besides the server's address."""

    tls: ssl.SSLContext | None
    server_name: str | None
    token: BearerToken
    incarnation: str | None


def _broken(address: str, what: str, error: ConnectionClosed) -> PSUnavailableError:
    return PSUnavailableError(f"{what}: the TCP lane to ps-server {address} broke: {error}", address=address,
                              code="UNAVAILABLE")


class SocketStream:
    """A :class:`LaneStream` on a framed connection to the server's lane port.

    ``on_outcome`` (when given) hears once whether the lane answered:
    True at its first answer, False when it broke before one. It is called
    on the thread using the lane, which holds it.
    """

    def __init__(self, connection: FramedConnection, address: str,
                 on_outcome: Callable[[bool], None] | None = None) -> None:
        self._connection = connection
        self._address = address
        self._on_outcome = on_outcome

    def send(self, pieces: list) -> None:
        # Written with one sendmsg, never joined: the tensor bytes are copied once, by the kernel.
        try:
            self._connection.send(buffer_pieces(pieces))
        except ConnectionClosed as error:
            self._outcome(False)
            raise _broken(self._address, "exchange", error) from None

    def receive(self, what: str) -> bytearray:
        try:
            frame = self._connection.receive()
        except ConnectionClosed as error:
            self._outcome(False)
            raise _broken(self._address, what, error) from None
        self._outcome(True)
        return frame

    def _outcome(self, answered: bool) -> None:
        on_outcome, self._on_outcome = self._on_outcome, None
        if on_outcome is not None:
            on_outcome(answered)

    def cancel(self) -> None:
        self._connection.close()

    def close(self) -> None:
        self._connection.close()


class TcpLaneOpener:
    """Opens a connection's lane: on the server's lane port when it has one, else the Exchange stream.

    ``lane_port`` asks the server for its port (a Describe, once per
    opening: a restarted server may have another); ``open_grpc`` opens the
    Exchange stream.
    """

    def __init__(self, address: str, settings: TcpLaneSettings, lane_port: Callable[[], int],
                 open_grpc: Callable[[], LaneStream], connect_timeout: float) -> None:
        self._address = address
        self._settings = settings
        self._lane_port = lane_port
        self._open_grpc = open_grpc
        self._connect_timeout = connect_timeout
        # Until then (monotonic) the Exchange stream is used. The fields below are used by the thread
        # holding the lane (ExchangeLane's busy lock): no lock of their own.
        self._unreachable_until = 0.0
        # TCP lanes in a row that broke before answering.
        self._breaks = 0
        #: Whether the lane in use is the TCP lane (tests and logs).
        self.on_tcp = False

    def __call__(self) -> LaneStream:
        self.on_tcp = False
        remaining = self._unreachable_until - time.monotonic()
        if remaining > 0:
            stream = self._open_grpc()
            if isinstance(stream, GrpcStream):  # replaced when the lane port is to be tried again
                stream.lifetime = min(stream.lifetime, remaining)
            return stream
        port = self._lane_port()  # PSError when the server cannot answer: the request fails and is retried
        if not port:
            return self._open_grpc()
        try:
            host, _ = split_host_port(self._address)
        except ClusterConfigError:
            return self._open_grpc()
        lane_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            connection = connect(lane_address, self._settings.tls, self._connect_timeout,
                                 self._settings.server_name)
        except ConnectionClosed as error:
            self._unreachable_until = time.monotonic() + _UNREACHABLE_SECONDS
            log.warning("ps-server %s: its TCP lane %s cannot be reached (%s); small pulls and pushes use "
                        "the gRPC Exchange stream, a slower round trip. Open the lane port (--lane-port) to "
                        "workers, or start the server without it.", self._address, lane_address, error,
                        extra={"fields": {"address": self._address, "lane": lane_address,
                                          "error": str(error)}})
            return self._open_grpc()
        settings = self._settings
        hello = ps_pb2.LaneHello(token=settings.token.value(), incarnation=settings.incarnation or "")
        try:
            connection.send([hello.SerializeToString()])
        except ConnectionClosed as error:
            connection.close()
            self._outcome(lane_address, False)
            raise _broken(self._address, "exchange", error) from None
        self.on_tcp = True
        return SocketStream(connection, self._address, lambda answered: self._outcome(lane_address, answered))

    def _outcome(self, lane_address: str, answered: bool) -> None:
        """A TCP lane answered, or broke before it did: enough breaks in a row, and the stream for a while."""
        if answered:
            self._breaks = 0
            return
        self._breaks += 1
        if self._breaks < _BREAKS_BEFORE_FALLBACK:
            return
        self._breaks = 0
        self._unreachable_until = time.monotonic() + _UNREACHABLE_SECONDS
        log.warning("ps-server %s: its TCP lane %s broke %d times in a row before answering (the server's "
                    "bound on connections, or something between that drops them); small pulls and pushes "
                    "use the gRPC Exchange stream for %gs, then try the lane again.", self._address,
                    lane_address, _BREAKS_BEFORE_FALLBACK, _UNREACHABLE_SECONDS,
                    extra={"fields": {"address": self._address, "lane": lane_address,
                                      "breaks": _BREAKS_BEFORE_FALLBACK}})

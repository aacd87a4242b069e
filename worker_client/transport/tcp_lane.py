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
from worker_client.transport.lane import LaneStream

__all__ = ["SocketStream", "TcpLaneOpener", "TcpLaneSettings"]

log = logging.getLogger("worker_client")

# After the lane port could not be reached: the Exchange stream, for this long.
_UNREACHABLE_SECONDS = 60.0


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
    """A :class:`LaneStream` on a framed connection to the server's lane port."""

    def __init__(self, connection: FramedConnection, address: str) -> None:
        self._connection = connection
        self._address = address

    def send(self, pieces: list) -> None:
        # Written with one sendmsg, never joined: the tensor bytes are copied once, by the kernel.
        try:
            self._connection.send(buffer_pieces(pieces))
        except ConnectionClosed as error:
            raise _broken(self._address, "exchange", error) from None

    def receive(self, what: str) -> bytearray:
        try:
            return self._connection.receive()
        except ConnectionClosed as error:
            raise _broken(self._address, what, error) from None

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
        self._unreachable_until = 0.0
        #: Whether the lane in use is the TCP lane (tests and logs).
        self.on_tcp = False

    def __call__(self) -> LaneStream:
        self.on_tcp = False
        if time.monotonic() < self._unreachable_until:
            return self._open_grpc()
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
            raise _broken(self._address, "exchange", error) from None
        self.on_tcp = True
        return SocketStream(connection, self._address)

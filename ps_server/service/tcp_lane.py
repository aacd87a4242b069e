"""The TCP lane (``--lane-port``): an Exchange stream's requests and answers as frames on a socket.

A worker's steps on a small model are made of round trips, and a round
trip on an open gRPC stream costs about 0.4 ms of gRPC Python's threads
against 0.06 ms on a socket (docs/benchmarks.md). So a server started with
``--lane-port`` also accepts the Exchange stream's messages as frames
(wehub_ps.wire.frames) on that port, and reports the port in Describe;
clients then send their small pulls and pushes there.

What stays the Exchange stream's: each answer
(``ParameterServerService.answer_exchange``: the same checks, the same
core, the same ExchangeError for a failed request), the bound on streams
per server and per worker incarnation (``--max-exchange-streams``, one
count for both kinds), the bearer token checked when the lane opens and
again before each request (a rotated token cuts an open lane off before
its next push is applied), and TLS with the gRPC port's certificate and
client CA.

A connection opens with a ``LaneHello`` frame, whole within
``HANDSHAKE_SECONDS`` of the accept and at most ``HANDSHAKE_FRAME_BYTES``
long (wehub_ps.wire.frames: a stranger's frame is never buffered to the
message bound before its token is checked). At most
``--max-exchange-streams`` + ``_HANDSHAKING_CONNECTIONS`` connections are
open at once, at most ``_HANDSHAKING_CONNECTIONS`` of them before their
hello; one more is closed as it is accepted (its client then uses the
Exchange stream, worker_client.transport.tcp_lane). A refused hello, a
hello or a frame over its bound, or a token that is no longer valid is
answered with an ExchangeResponse of id 0 (the whole lane) carrying the
error, and the connection is closed. A frame that is not an
ExchangeRequest is answered with MALFORMED_MESSAGE and the lane carries
on, as on the stream.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable

import grpc

from ps_server.core.admission import Admission
from ps_server.core.errors import RequestError
from ps_server.core.pushes import MAX_WORKER_ID_LENGTH
from ps_server.ops.config import ServerConfig
from ps_server.service.auth import STALE_TOKEN, TokenFile, token_refusal
from ps_server.service.calls import STATUS_BY_REASON
from ps_server.service.servicer import exchange_error
from wehub_ps.errors import Reason
from wehub_ps.process.logs import event
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import buffer_pieces
from wehub_ps.wire.frames import ConnectionClosed, FramedConnection, FrameListener, FrameTooLarge, Handshake

__all__ = ["TcpLanes", "lane_tls"]

log = logging.getLogger("ps_server.service.tcp_lane")

# A request may wait (ssp/sync) at most this long, as on an Exchange stream, whose client opens it for 600 s.
_WAIT_SECONDS = 600.0
# Room in a frame for the envelope around the largest message the gRPC port accepts.
_ENVELOPE_BYTES = 64
# Connections open at once beyond --max-exchange-streams, and at most this many before their hello: room
# for the workers of a job (re)connecting together, at most 64 x 16 KiB of hellos held for strangers.
_HANDSHAKING_CONNECTIONS = 64


def lane_tls(config: ServerConfig) -> ssl.SSLContext | None:
    """The gRPC port's TLS for the lane port: its certificate; client certificates as --tls-client-ca says."""
    if not config.tls_cert:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.tls_cert, config.tls_key, password=lambda: b"")
    if config.tls_client_ca:
        context.load_verify_locations(cafile=config.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class TcpLanes:
    """The lane port: accepts connections and answers their requests, each connection on its own thread."""

    def __init__(self, config: ServerConfig, answer: Callable[[bytearray, float | None], list],
                 admission: Admission, tokens: TokenFile | None, name: str) -> None:
        self._answer = answer
        self._admission = admission
        self._tokens = tokens
        self._listener = FrameListener(config.host, config.lane_port, self._serve,
                                       Handshake(max_pending=_HANDSHAKING_CONNECTIONS),
                                       config.max_exchange_streams + _HANDSHAKING_CONNECTIONS,
                                       lane_tls(config), name=name,
                                       max_frame_bytes=config.max_message_bytes + _ENVELOPE_BYTES,
                                       on_first_too_large=self._hello_too_large)
        #: The port bound (the one asked for, or a free one for 0).
        self.port = self._listener.port

    def start(self) -> None:
        self._listener.start()

    def stop(self) -> int:
        """Close the port and every lane (clients retry their requests); how many lanes were open.

        A request being answered finishes; its answer is lost.
        """
        return self._listener.stop()

    def _serve(self, connection: FramedConnection, hello: bytearray) -> None:
        try:
            presented, incarnation = self._check_hello(hello)
            self._admission.enter_stream(incarnation)
        except RequestError as error:
            status = (grpc.StatusCode.UNAUTHENTICATED if error.reason is Reason.UNAUTHENTICATED
                      else STATUS_BY_REASON[error.reason])  # as the gRPC port's auth interceptor answers
            self._refuse(connection, status, error.reason.value, error.message)
            return
        try:
            self._answer_requests(connection, presented)
        finally:
            self._admission.exit_stream(incarnation)

    def _check_hello(self, raw: bytearray) -> tuple[bytes, str]:
        """The token presented and the worker incarnation of a hello; RequestError when it is refused."""
        try:
            hello = ps_pb2.LaneHello.FromString(bytes(raw))
        except Exception as exc:  # protobuf's DecodeError and friends
            raise RequestError(Reason.MALFORMED_MESSAGE,
                               f"the first frame on a lane is a wehub_ps.v1.LaneHello: {exc}") from None
        presented = hello.token.encode()
        refusal = token_refusal(self._tokens, presented) if self._tokens is not None else None
        if refusal is not None:
            raise RequestError(Reason.UNAUTHENTICATED, refusal)
        if len(hello.incarnation) > MAX_WORKER_ID_LENGTH:
            raise RequestError(Reason.INVALID_REQUEST,
                               f"a lane's incarnation must be at most {MAX_WORKER_ID_LENGTH} characters")
        return presented, hello.incarnation

    def _answer_requests(self, connection: FramedConnection, presented: bytes) -> None:
        opened = time.monotonic()
        while True:
            try:
                raw = connection.receive()
            except FrameTooLarge as error:
                self._refuse(connection, grpc.StatusCode.RESOURCE_EXHAUSTED, "",
                             f"a lane frame of {error.size} bytes is over this ps-server's bound of "
                             f"{error.limit} (--max-message-bytes)")
                return
            except ConnectionClosed:
                return
            if self._tokens is not None and not self._tokens.matches(presented):
                self._refuse(connection, grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED.value,
                             STALE_TOKEN)
                return
            reply = self._answer(raw, max(0.0, _WAIT_SECONDS - (time.monotonic() - opened)))
            try:
                connection.send(buffer_pieces(reply))
            except ConnectionClosed:
                return

    def _hello_too_large(self, connection: FramedConnection, error: FrameTooLarge) -> None:
        self._refuse(connection, grpc.StatusCode.RESOURCE_EXHAUSTED, "",
                     f"a LaneHello of {error.size} bytes is over the bound of {error.limit} (is the bearer "
                     f"token over 8 KiB?)")

    @staticmethod
    def _refuse(connection: FramedConnection, status: grpc.StatusCode, reason: str, message: str) -> None:
        """Answer the whole lane with an error (id 0) and let the connection close."""
        event(log, logging.DEBUG, "lane refused", peer=connection.peer, reason=reason or status.name,
              detail=message)
        try:
            connection.set_timeout(5.0)
            connection.send([exchange_error(0, status, reason, message)])
        except ConnectionClosed:
            pass

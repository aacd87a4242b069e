"""Length-prefixed frames on one TCP connection (TLS with TLS servers): replication and the TCP lane.

Why not gRPC: every byte gRPC Python moves costs a pass through its
threads. A backup receives every byte every worker pushes, and moving them
through gRPC once more cost the primary about 0.9 and the backup about 1.0
CPU-seconds per GB on a 2-core machine (the benchmarks' replication
section). A small model's step is made of round trips, and a round trip on
an open gRPC stream costs about 0.4 ms against 0.06 ms on a socket
(docs/benchmarks.md). On a socket the sender writes a message's pieces
with one scatter-gather ``sendmsg`` (tensor bytes never joined) and the
receiver reads each frame into one buffer, whose views it decodes.

A frame is a 4-byte little-endian length and that many bytes: the protobuf
encoding of a ``ReplicationMessage``/``FollowRequest`` on the replication
port, of an ``ExchangeRequest``/``ExchangeResponse`` (after a ``LaneHello``)
on the lane port, as ps.proto defines them. Plain sockets use ``sendmsg``;
TLS sockets join the pieces first (``ssl`` has no scatter-gather write).

A frame's buffer grows with the bytes that arrive, never to the length a
peer announces before sending it: a peer that announces a large frame and
stalls holds no more memory than it sent.

A server's port (:class:`FrameListener`) is open to anyone who can reach
it, so nothing a peer sends is trusted until its first frame (the lane's
``LaneHello``, the backup's ``FollowStart``, both carrying the bearer
token) has been checked. Until then a connection is held to a
:class:`Handshake`: that first frame must arrive whole within
``seconds`` of the accept (TLS handshake included; one deadline for the
whole handshake, not one per read, so a peer dripping a byte at a time is
cut off on time) and be at most ``max_bytes`` long; and at most
``max_pending`` connections may be in their handshake at once, of at most
``max_connections`` open. A connection past either bound is closed as it
is accepted. So peers that never authenticate hold at most
``max_pending`` threads and ``max_pending`` x ``max_bytes`` of frame
buffers, for at most ``seconds`` each.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from wehub_ps.process.logs import event

__all__ = [
    "HANDSHAKE_FRAME_BYTES",
    "HANDSHAKE_SECONDS",
    "MAX_FRAME_BYTES",
    "ConnectionClosed",
    "FrameListener",
    "FrameTooLarge",
    "FramedConnection",
    "Handshake",
    "RefusalLog",
    "connect",
]

log = logging.getLogger("wehub_ps.wire.frames")

#: The largest frame accepted by default: a push message (64 MiB at most) and a record's headers.
MAX_FRAME_BYTES = (64 << 20) + (1 << 20)
_LENGTH = struct.Struct("<I")
_SOCKET_BUFFER_BYTES = 4 << 20
# A frame's buffer starts at most this large and doubles as its bytes arrive.
_FIRST_READ_BYTES = 1 << 20
#: The largest first frame (LaneHello, FollowStart) a port reads before it is authenticated. Both hold
#: the bearer token, and a token must fit gRPC's default 8 KiB of request headers to work on the gRPC
#: port at all; the rest (an incarnation of at most 256 characters, an address, a few integers) is
#: under 1 KiB. So 16 KiB holds any first frame that could be accepted, and no more.
HANDSHAKE_FRAME_BYTES = 16 << 10
#: A connection's first frame must arrive whole (TLS handshake included) within this long of its accept:
#: a real client sends it as soon as it is connected, in one write.
HANDSHAKE_SECONDS = 10.0


class ConnectionClosed(Exception):
    """The peer closed the connection, or it broke."""


class FrameTooLarge(ConnectionClosed):
    """The peer announced a frame over the connection's bound; nothing of it was read."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class FramedConnection:
    """One framed connection; ``send`` may be called from one thread and ``receive`` from another."""

    def __init__(self, sock: socket.socket, peer: str, max_frame_bytes: int = MAX_FRAME_BYTES,
                 buffer_bytes: int | None = _SOCKET_BUFFER_BYTES) -> None:
        self._sock = sock
        self.peer = peer
        #: The largest frame ``receive`` reads (a larger one raises FrameTooLarge, unread).
        self.max_frame_bytes = max_frame_bytes
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._send_lock = threading.Lock()
        self._closed = False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if buffer_bytes is not None:
            self.set_buffers(buffer_bytes)

    def set_buffers(self, buffer_bytes: int) -> None:
        """The kernel's send and receive buffers: a whole 1 MiB record and more in flight."""
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            self._sock.setsockopt(socket.SOL_SOCKET, option, buffer_bytes)

    def send(self, pieces: list) -> None:
        """One frame made of ``pieces`` (bytes and memoryviews), written whole."""
        size = sum(len(p) if isinstance(p, bytes) else memoryview(p).nbytes for p in pieces)
        buffers = [_LENGTH.pack(size), *pieces]
        try:
            with self._send_lock:
                if self._tls:
                    self._sock.sendall(b"".join(buffers))
                else:
                    _send_all(self._sock, buffers)
        except OSError as error:
            raise ConnectionClosed(f"sending to {self.peer}: {error}") from error

    def receive(self, deadline: float | None = None) -> bytearray:
        """The next frame's bytes; ConnectionClosed at the end (a timeout counts as broken).

        ``deadline`` (``time.monotonic()``): the whole frame must have
        arrived by then, however its bytes are spread over reads; it
        replaces the socket's timeout for this frame.
        """
        header = self._read(_LENGTH.size, deadline)
        (size,) = _LENGTH.unpack(header)
        if size > self.max_frame_bytes:
            raise FrameTooLarge(f"{self.peer} sent a frame of {size} bytes (at most {self.max_frame_bytes})",
                                size, self.max_frame_bytes)
        return self._read(size, deadline)

    def _read(self, size: int, deadline: float | None = None) -> bytearray:
        buffer = bytearray(min(size, _FIRST_READ_BYTES))
        got = 0
        try:
            while got < size:
                if got == len(buffer):  # full: grow (no view of it is held here)
                    buffer.extend(bytes(min(size, 2 * len(buffer)) - len(buffer)))
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise ConnectionClosed(f"{self.peer} sent {got} of {size} bytes by the deadline")
                    self._sock.settimeout(remaining)
                with memoryview(buffer) as view:
                    n = self._sock.recv_into(view[got:], len(buffer) - got)
                if n == 0:
                    raise ConnectionClosed(f"{self.peer} closed the connection")
                got += n
        except OSError as error:  # timeouts included
            raise ConnectionClosed(f"receiving from {self.peer}: {error or type(error).__name__}") from error
        return buffer

    def peer_acknowledged_within(self, seconds: float) -> bool | None:
        """Whether the peer's TCP stack acknowledged everything sent, or something within ``seconds``:
        its host and link are up, however slow its process (None where TCP_INFO is not available).

        Read from Linux's ``struct tcp_info``: ``tcpi_unacked`` (offset 24) and ``tcpi_last_ack_recv``
        (milliseconds since the last acknowledgement, offset 56)."""
        try:
            info = self._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        except (OSError, AttributeError):
            return None
        if len(info) < 60:
            return None
        unacked, = struct.unpack_from("<I", info, 24)
        last_ack_ms, = struct.unpack_from("<I", info, 56)
        return unacked == 0 or last_ack_ms < seconds * 1000

    def set_timeout(self, seconds: float | None) -> None:
        """ConnectionClosed when the connection was closed meanwhile (by another thread)."""
        try:
            self._sock.settimeout(seconds)
        except OSError as error:
            raise ConnectionClosed(f"{self.peer}: {error}") from error

    def close(self) -> None:
        """Close the connection; a ``receive`` blocked in another thread returns ConnectionClosed."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _send_all(sock: socket.socket, buffers: list) -> None:
    """sendmsg until every byte of ``buffers`` is written (a partial write resumes mid-buffer)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent:
            first = views[0]
            if sent >= first.nbytes:
                sent -= first.nbytes
                views.pop(0)
            else:
                views[0] = first[sent:]
                sent = 0


@dataclass(frozen=True)
class Handshake:
    """How a listener's connections open, before anything they send is trusted (the module's docstring).

    ``max_pending``: connections in their handshake at once (one accepted
    past it is closed at once); ``max_bytes``: the bound on the first
    frame; ``seconds``: the deadline for the TLS handshake and the whole
    first frame, from the accept.
    """

    max_pending: int
    max_bytes: int = HANDSHAKE_FRAME_BYTES
    seconds: float = HANDSHAKE_SECONDS

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, got {self.max_pending}")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, got {self.max_bytes}")
        if not self.seconds > 0:
            raise ValueError(f"seconds must be positive, got {self.seconds}")


class RefusalLog:
    """Refused connections, logged so that hostile peers cannot flood the log.

    Every refusal is logged at DEBUG. At WARNING: the first one, then at
    most one line per ``interval`` seconds, which counts the refusals by
    reason since the line before. ``reason`` is one of a few fixed phrases
    (it keys the counts); details go in ``fields``. Thread-safe.
    """

    def __init__(self, logger: logging.Logger, message: str, interval: float = 60.0,
                 **fields: object) -> None:
        self._logger = logger
        self._message = message
        self._interval = interval
        self._fields = fields
        # Guards _counts (refusals by reason not yet reported at WARNING) and _quiet_until (monotonic).
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._quiet_until = 0.0
        #: Refusals so far, by reason (tests and metrics read it).
        self.totals: dict[str, int] = {}

    def refused(self, reason: str, **fields: object) -> None:
        event(self._logger, logging.DEBUG, self._message, reason=reason, **self._fields, **fields)
        now = time.monotonic()
        with self._lock:
            self.totals[reason] = self.totals.get(reason, 0) + 1
            self._counts[reason] = self._counts.get(reason, 0) + 1
            if now < self._quiet_until:
                return
            counts, self._counts = self._counts, {}
            self._quiet_until = now + self._interval
        event(self._logger, logging.WARNING, self._message, reason=reason, refused_by_reason=counts,
              next_report_after_seconds=self._interval, **self._fields, **fields)


class FrameListener:
    """A server's side of a framed port: accepts connections, each handled on its own thread.

    Each connection first goes through the ``handshake`` (TLS if any, then
    its first frame, whole, on time and within ``handshake.max_bytes``);
    ``handle(connection, first_frame)`` then gets it, with frames up to
    ``max_frame_bytes``, and it is closed when ``handle`` returns. At most
    ``max_connections`` are open at once, ``handshake.max_pending`` of them
    in their handshake; a connection accepted past either bound is closed
    at once, so peers that never authenticate cannot pile up threads or
    buffers. ``on_first_too_large`` may answer a first frame over its
    bound before the connection is closed. ``stop`` closes the port and
    every connection still open.
    """

    def __init__(self, host: str, port: int, handle: Callable[[FramedConnection, bytearray], None],
                 handshake: Handshake, max_connections: int, tls: ssl.SSLContext | None = None,
                 name: str = "ps-replication", max_frame_bytes: int = MAX_FRAME_BYTES,
                 on_first_too_large: Callable[[FramedConnection, FrameTooLarge], None] | None = None) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._handle = handle
        self._handshake = handshake
        self._max_connections = max_connections
        self._on_first_too_large = on_first_too_large
        self._tls = tls
        self._name = name
        self._max_frame_bytes = max_frame_bytes
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host.strip("[]"), port))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        #: Connections refused, logged at a bounded rate.
        self.refusals = RefusalLog(log, "connection refused", listener=name, port=self.port)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        # Guards _open (connections accepted and not yet ended), _pending (those of them still in their
        # handshake) and _connections (those past TLS, closed by stop()).
        self._lock = threading.Lock()
        self._open = 0
        self._pending = 0
        self._connections: set[FramedConnection] = set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept, name=f"{self._name}-accept", daemon=True)
        self._thread.start()

    @property
    def open_connections(self) -> tuple[int, int]:
        """(connections open, those of them still in their handshake)."""
        with self._lock:
            return self._open, self._pending

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, address = self._sock.accept()
            except OSError:
                return  # closed by stop()
            deadline = time.monotonic() + self._handshake.seconds
            peer = f"{address[0]}:{address[1]}"
            with self._lock:
                if self._open >= self._max_connections:
                    full = f"{self._max_connections} connections open"
                elif self._pending >= self._handshake.max_pending:
                    full = f"{self._handshake.max_pending} connections in their handshake"
                else:
                    full = ""
                    self._open += 1
                    self._pending += 1
            if full:
                # Counted before the close, so whoever sees the close also sees the count.
                self.refusals.refused("too many connections", peer=peer, limit=full)
                sock.close()
                continue
            threading.Thread(target=self._serve_accepted, args=(sock, peer, deadline),
                             name=f"{self._name}-connection", daemon=True).start()

    def _serve_accepted(self, sock: socket.socket, peer: str, deadline: float) -> None:
        opened: tuple[FramedConnection, bytearray] | None = None
        try:
            try:
                opened = self._open_connection(sock, peer, deadline)
            finally:
                with self._lock:
                    self._pending -= 1
            if opened is not None:
                connection, first = opened
                try:
                    self._handle(connection, first)
                finally:
                    self._drop(connection)
        finally:
            with self._lock:
                self._open -= 1

    def _open_connection(self, sock: socket.socket, peer: str,
                         deadline: float) -> tuple[FramedConnection, bytearray] | None:
        """The handshake: TLS, then the first frame; None (the socket closed) when it failed."""
        if self._tls is not None:
            try:
                sock.settimeout(max(0.001, deadline - time.monotonic()))  # CPython: the whole TLS handshake
                sock = self._tls.wrap_socket(sock, server_side=True)
            except (OSError, ssl.SSLError) as error:
                self.refusals.refused("TLS handshake failed", peer=peer, error=str(error))
                sock.close()
                return None
        # The kernel's default buffers until the peer is known: no 4 MiB of socket memory per stranger.
        connection = FramedConnection(sock, peer, self._handshake.max_bytes, buffer_bytes=None)
        with self._lock:
            if self._stopped.is_set():
                connection.close()
                return None
            self._connections.add(connection)
        try:
            first = connection.receive(deadline)
        except FrameTooLarge as error:
            self.refusals.refused("first frame too large", peer=peer, size=error.size, limit=error.limit)
            if self._on_first_too_large is not None:
                self._on_first_too_large(connection, error)
            self._drop(connection)
            return None
        except ConnectionClosed as error:
            if time.monotonic() >= deadline:
                self.refusals.refused("no whole first frame in time", peer=peer,
                                      seconds=self._handshake.seconds, error=str(error))
            else:  # a port check (a TCP probe), or a peer that gave up
                event(log, logging.DEBUG, "connection closed before its first frame", listener=self._name,
                      peer=peer, error=str(error))
            self._drop(connection)
            return None
        try:
            connection.set_timeout(None)
        except ConnectionClosed:  # closed meanwhile (the listener stopping)
            self._drop(connection)
            return None
        connection.max_frame_bytes = self._max_frame_bytes
        connection.set_buffers(_SOCKET_BUFFER_BYTES)
        return connection, first

    def _drop(self, connection: FramedConnection) -> None:
        connection.close()
        with self._lock:
            self._connections.discard(connection)

    def close_connections(self) -> int:
        """Close every connection open now (their handlers see ConnectionClosed); returns how many."""
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.close()
        return len(connections)

    def stop(self) -> int:
        """Close the port and every connection; how many connections were open."""
        self._stopped.set()
        self._sock.close()
        return self.close_connections()


def connect(address: str, tls: ssl.SSLContext | None, timeout: float, server_name: str | None = None,
            max_frame_bytes: int = MAX_FRAME_BYTES) -> FramedConnection:
    """A client's connection to a framed port at ``address`` ('host:port'); ``timeout`` bounds the connect.

    The socket blocks without a timeout once connected (the caller sets one if it wants one).
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=server_name or host)
        sock.settimeout(None)
    except (OSError, ssl.SSLError) as error:
        raise ConnectionClosed(f"connecting to {address}: {error}") from error
    return FramedConnection(sock, address, max_frame_bytes)

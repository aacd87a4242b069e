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
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable

from wehub_ps.process.logs import event

__all__ = ["ConnectionClosed", "FrameTooLarge", "FramedConnection", "FrameListener", "connect",
           "MAX_FRAME_BYTES"]

log = logging.getLogger("wehub_ps.wire.frames")

#: The largest frame accepted by default: a push message (64 MiB at most) and a record's headers.
MAX_FRAME_BYTES = (64 << 20) + (1 << 20)
_LENGTH = struct.Struct("<I")
_SOCKET_BUFFER_BYTES = 4 << 20
# A frame's buffer starts at most this large and doubles as its bytes arrive.
_FIRST_READ_BYTES = 1 << 20


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
                 buffer_bytes: int = _SOCKET_BUFFER_BYTES) -> None:
        self._sock = sock
        self.peer = peer
        self.max_frame_bytes = max_frame_bytes
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._send_lock = threading.Lock()
        self._closed = False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # a whole 1 MiB record and more in flight
            sock.setsockopt(socket.SOL_SOCKET, option, buffer_bytes)

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

    def receive(self) -> bytearray:
        """The next frame's bytes; ConnectionClosed at the end (a timeout counts as broken)."""
        header = self._read(_LENGTH.size)
        (size,) = _LENGTH.unpack(header)
        if size > self.max_frame_bytes:
            raise FrameTooLarge(f"{self.peer} sent a frame of {size} bytes (at most {self.max_frame_bytes})",
                                size, self.max_frame_bytes)
        return self._read(size)

    def _read(self, size: int) -> bytearray:
        buffer = bytearray(min(size, _FIRST_READ_BYTES))
        got = 0
        try:
            while got < size:
                if got == len(buffer):  # full: grow (no view of it is held here)
                    buffer.extend(bytes(min(size, 2 * len(buffer)) - len(buffer)))
                with memoryview(buffer) as view:
                    n = self._sock.recv_into(view[got:], len(buffer) - got)
                if n == 0:
                    raise ConnectionClosed(f"{self.peer} closed the connection")
                got += n
        except OSError as error:  # timeouts included
            raise ConnectionClosed(f"receiving from {self.peer}: {error or type(error).__name__}") from error
        return buffer

    def set_timeout(self, seconds: float | None) -> None:
        self._sock.settimeout(seconds)

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


class FrameListener:
    """A server's side of a framed port: accepts connections, each handled on its own thread.

    ``handle`` gets each connection once TLS (if any) is set up; the
    connection is closed when it returns. ``stop`` closes the port and every
    connection still open. ``max_connections``: a connection accepted while
    that many are open (their handshakes included) is closed at once, so
    connections that never say anything cannot pile up threads.
    """

    def __init__(self, host: str, port: int, handle: Callable[[FramedConnection], None],
                 tls: ssl.SSLContext | None = None, name: str = "ps-replication",
                 max_frame_bytes: int = MAX_FRAME_BYTES, max_connections: int | None = None) -> None:
        self._handle = handle
        self._max_connections = max_connections
        # Connections accepted and not yet ended (guarded by _lock).
        self._accepted = 0
        self._tls = tls
        self._name = name
        self._max_frame_bytes = max_frame_bytes
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host.strip("[]"), port))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._connections: set[FramedConnection] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept, name=f"{self._name}-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                full = self._max_connections is not None and self._accepted >= self._max_connections
                if not full:
                    self._accepted += 1
            if full:
                event(log, logging.DEBUG, "connection closed: too many open", port=self.port,
                      listener=self._name, peer=f"{peer[0]}:{peer[1]}", max_connections=self._max_connections)
                sock.close()
                continue
            threading.Thread(target=self._serve_accepted, args=(sock, f"{peer[0]}:{peer[1]}"),
                             name=f"{self._name}-connection", daemon=True).start()

    def _serve_accepted(self, sock: socket.socket, peer: str) -> None:
        try:
            self._serve(sock, peer)
        finally:
            with self._lock:
                self._accepted -= 1

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            if self._tls is not None:
                sock.settimeout(10.0)
                sock = self._tls.wrap_socket(sock, server_side=True)
                sock.settimeout(None)
        except (OSError, ssl.SSLError) as error:
            event(log, logging.WARNING, "connection refused: TLS handshake failed", port=self.port,
                  listener=self._name, peer=peer, error=str(error))
            sock.close()
            return
        connection = FramedConnection(sock, peer, self._max_frame_bytes)
        with self._lock:
            if self._stopped.is_set():
                connection.close()
                return
            self._connections.add(connection)
        try:
            self._handle(connection)
        finally:
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

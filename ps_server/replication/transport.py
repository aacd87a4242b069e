"""The replication stream's transport: length-prefixed messages on one TCP connection (TLS with TLS servers).

Why not a gRPC stream: a backup receives every byte every worker pushes,
and moving those bytes through gRPC Python once more cost the primary about
0.9 and the backup about 1.0 CPU-seconds per GB on a 2-core machine (the
benchmarks' replication section), more than the push itself. On a socket
the primary writes a record's pieces with one scatter-gather ``sendmsg``
(the push's own bytes, never joined) and the backup reads each message
into one buffer, whose views it applies.

A frame is a 4-byte little-endian length and the protobuf encoding of a
``ReplicationMessage`` (primary to backup) or a ``FollowRequest`` (backup to
primary), as ps.proto defines them. Plain sockets use ``sendmsg``; TLS
sockets join the pieces first (``ssl`` has no scatter-gather write).
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable

from wehub_ps.process.logs import event

__all__ = ["FramedConnection", "ReplicationListener", "connect", "MAX_FRAME_BYTES"]

log = logging.getLogger("ps_server.replication")

#: The largest frame accepted: a push message (64 MiB at most) and a record's headers.
MAX_FRAME_BYTES = (64 << 20) + (1 << 20)
_LENGTH = struct.Struct("<I")
_SOCKET_BUFFER_BYTES = 4 << 20


class ConnectionClosed(Exception):
    """The peer closed the connection, or it broke."""


class FramedConnection:
    """One replication connection; ``send`` may be called from one thread and ``receive`` from another."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self.peer = peer
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._send_lock = threading.Lock()
        self._closed = False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # a whole 1 MiB record and more in flight
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)

    def send(self, pieces: list) -> None:
        """One frame made of ``pieces`` (bytes and memoryviews), written whole."""
        size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in pieces)
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
        if size > MAX_FRAME_BYTES:
            raise ConnectionClosed(f"{self.peer} sent a frame of {size} bytes (at most {MAX_FRAME_BYTES})")
        return self._read(size)

    def _read(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        try:
            while got < size:
                n = self._sock.recv_into(view[got:], size - got)
                if n == 0:
                    raise ConnectionClosed(f"{self.peer} closed the connection")
                got += n
        except OSError as error:  # timeouts included
            raise ConnectionClosed(f"receiving from {self.peer}: {error or type(error).__name__}") from error
        return buffer

    def set_timeout(self, seconds: float | None) -> None:
        self._sock.settimeout(seconds)

    def close(self) -> None:
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


class ReplicationListener:
    """The primary's side: accepts backups' connections, each handled on its own thread."""

    def __init__(self, host: str, port: int, handle: Callable[[FramedConnection], None],
                 tls: ssl.SSLContext | None = None) -> None:
        self._handle = handle
        self._tls = tls
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host.strip("[]"), port))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._connections: set[FramedConnection] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept, name="ps-replication-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"),
                             name="ps-replication-backup", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            if self._tls is not None:
                sock.settimeout(10.0)
                sock = self._tls.wrap_socket(sock, server_side=True)
                sock.settimeout(None)
        except (OSError, ssl.SSLError) as error:
            event(log, logging.WARNING, "replication connection refused: TLS handshake failed", peer=peer,
                  error=str(error))
            sock.close()
            return
        connection = FramedConnection(sock, peer)
        with self._lock:
            self._connections.add(connection)
        try:
            self._handle(connection)
        finally:
            connection.close()
            with self._lock:
                self._connections.discard(connection)

    def stop(self) -> None:
        self._stopped.set()
        self._sock.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.close()


def connect(address: str, tls: ssl.SSLContext | None, timeout: float) -> FramedConnection:
    """A backup's connection to its primary's replication address ('host:port')."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
    except (OSError, ssl.SSLError) as error:
        raise ConnectionClosed(f"connecting to {address}: {error}") from error
    return FramedConnection(sock, address)

"""A loopback TCP proxy that is slow to connect, for tests of start-up against a slow or late etcd."""

from __future__ import annotations

import socket
import threading

__all__ = ["DelayingProxy"]


class DelayingProxy:
    """A loopback TCP proxy to etcd that is slow to connect, as when a SYN is lost.

    The first ``hold_first`` connections are held ``delay`` seconds (accepted,
    nothing forwarded either way) before they are joined to the upstream;
    while ``upstream`` is None (etcd not started yet) connections are closed
    at once, as a refused connection. Threads named, joined by stop().
    """

    def __init__(self, *, delay: float, hold_first: int = 1, upstream: str | None = None) -> None:
        self.delay = delay
        self.hold_first = hold_first
        self.upstream = upstream
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        # Guards _sockets and _threads (the acceptor and the pipes add to them).
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept, f"proxy-accept-{self.port}")

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, target, name: str, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            with self._lock:
                self._sockets.append(client)
            self._spawn(self._join, f"proxy-join-{self.connections}", client,
                        self.connections <= self.hold_first)

    def _join(self, client: socket.socket, hold: bool) -> None:
        if hold and self._stopping.wait(self.delay):
            return
        upstream = self.upstream
        try:
            if upstream is None:
                raise OSError("no upstream yet")
            host, _, port = upstream.rpartition(":")
            server = socket.create_connection((host, int(port)), timeout=5)
            server.settimeout(None)
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets.append(server)
        self._spawn(self._pipe, "proxy-up", client, server)
        self._spawn(self._pipe, "proxy-down", server, client)

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        self._stopping.set()
        self._listener.close()
        with self._lock:
            sockets, threads = list(self._sockets), list(self._threads)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for thread in threads:
            thread.join(5)

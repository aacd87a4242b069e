"""A TCP proxy for tests that cuts connections at random points.

Listens on 127.0.0.1 only and forwards to one upstream. Every accepted
connection draws, from a seeded generator, how many bytes it may carry in
each direction before the proxy cuts it (both sockets closed at once); a
fraction of connections is cut before a single byte passes. Cutting the
client-to-server direction lands before a request or in the middle of a
chunked push; cutting the server-to-client direction lands after the server
applied a push but before its acknowledgement arrived. Bounded: at most
``max_connections`` at a time, every thread named and joined on stop().
"""

from __future__ import annotations

import random
import socket
import threading
from dataclasses import dataclass, field

__all__ = ["FaultProxy", "CutStats"]


@dataclass
class CutStats:
    connections: int = 0
    cut_at_start: int = 0
    cut_client_to_server: int = 0
    cut_server_to_client: int = 0
    bytes_up: int = 0
    bytes_down: int = 0

    @property
    def cuts(self) -> int:
        return self.cut_at_start + self.cut_client_to_server + self.cut_server_to_client


@dataclass
class _Connection:
    client: socket.socket
    server: socket.socket
    closed: threading.Event = field(default_factory=threading.Event)

    def cut(self) -> bool:
        """Close both ends; True for the thread that actually cut."""
        if self.closed.is_set():
            return False
        self.closed.set()
        for sock in (self.client, self.server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        return True


class FaultProxy:
    def __init__(self, upstream_port: int, *, seed: int, mean_bytes_up: float, mean_bytes_down: float,
                 cut_at_start: float = 0.05, max_connections: int = 64) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._rng = random.Random(seed)
        self._mean_up = mean_bytes_up
        self._mean_down = mean_bytes_down
        self._cut_at_start = cut_at_start
        self._slots = threading.BoundedSemaphore(max_connections)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.stats = CutStats()
        # Guards stats, _rng, _connections and _threads.
        self._lock = threading.Lock()
        self._connections: list[_Connection] = []
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.cutting = True  # set False to let everything through (e.g. for the final check)
        self._acceptor = threading.Thread(target=self._accept, name=f"proxy-accept-{self.port}", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                client.close()
                continue
            try:
                server = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()
                self._slots.release()
                continue
            server.settimeout(None)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(client, server)
            with self._lock:
                self.stats.connections += 1
                cut_now = self.cutting and self._rng.random() < self._cut_at_start
                budget_up = self._rng.expovariate(1 / self._mean_up) if self.cutting else float("inf")
                budget_down = self._rng.expovariate(1 / self._mean_down) if self.cutting else float("inf")
                if cut_now:
                    self.stats.cut_at_start += 1
                self._connections.append(connection)
            if cut_now:
                connection.cut()
                self._slots.release()
                continue
            done = threading.Barrier(2, action=self._slots.release)
            for source, sink, budget, kind in ((client, server, budget_up, "up"),
                                               (server, client, budget_down, "down")):
                thread = threading.Thread(target=self._pump, args=(connection, source, sink, budget, kind, done),
                                          name=f"proxy-{self.port}-{kind}", daemon=True)
                with self._lock:
                    self._threads.append(thread)
                thread.start()

    def _pump(self, connection: _Connection, source: socket.socket, sink: socket.socket, budget: float,
              kind: str, done: threading.Barrier) -> None:
        moved = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if moved + len(data) > budget:
                    sink.sendall(data[: max(0, int(budget - moved))])
                    if connection.cut():
                        with self._lock:
                            if kind == "up":
                                self.stats.cut_client_to_server += 1
                            else:
                                self.stats.cut_server_to_client += 1
                    break
                sink.sendall(data)
                moved += len(data)
        except OSError:
            pass
        finally:
            with self._lock:
                if kind == "up":
                    self.stats.bytes_up += moved
                else:
                    self.stats.bytes_down += moved
            connection.cut()
            try:
                done.wait(timeout=10)
            except threading.BrokenBarrierError:
                pass

    def cut_open(self) -> int:
        """Cut every connection open now (a network blip); returns how many were cut."""
        with self._lock:
            connections = [c for c in self._connections if not c.closed.is_set()]
            self._connections = connections  # closed ones are done with: keep the list bounded
        return sum(1 for connection in connections if connection.cut())

    def stop(self) -> None:
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor: close() alone does not
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.cut()
        self._acceptor.join(5)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(5)

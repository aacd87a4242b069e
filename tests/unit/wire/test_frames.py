"""The framed ports' handshake (wehub_ps.wire.frames): a deadline for the whole first frame, a small bound
on it, and caps on connections, all before a handler sees anything a peer sent.

A FrameListener on a loopback port with a short handshake; raw sockets play the peers.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest

from wehub_ps.wire.frames import FramedConnection, FrameListener, Handshake, RefusalLog

_LENGTH = struct.Struct("<I")


class _Echo:
    """A handler that records each first frame and echoes frames until the peer goes."""

    def __init__(self) -> None:
        self.firsts: list[bytes] = []
        self.too_large: list[int] = []

    def __call__(self, connection: FramedConnection, first: bytearray) -> None:
        self.firsts.append(bytes(first))
        connection.send([b"hello ", bytes(first)])
        while True:
            try:
                frame = connection.receive()
            except Exception:  # noqa: BLE001 - the peer went
                return
            connection.send([bytes(frame)])


def _listener(handler, handshake: Handshake, max_connections: int = 8, **kw) -> FrameListener:
    listener = FrameListener("127.0.0.1", 0, handler, handshake, max_connections, name="test-frames", **kw)
    listener.start()
    return listener


def _connect(listener: FrameListener) -> socket.socket:
    return socket.create_connection(("127.0.0.1", listener.port), timeout=10)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closed ``sock`` within ``seconds`` (anything it sent is skipped)."""
    sock.settimeout(seconds)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def _read_frame(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while len(data) < 4 or len(data) < 4 + _LENGTH.unpack(data[:4])[0]:
        chunk = sock.recv(65536)
        assert chunk, "closed instead of answering"
        data += chunk
    return data[4:]


def test_a_first_frame_dripped_a_byte_at_a_time_is_cut_off_at_the_handshake_deadline():
    """The deadline holds for the whole first frame, not for each read: a peer sending a byte every
    0.3 s (each read well within any per-read timeout) is closed at 1 s, and its frame never handled."""
    handler = _Echo()
    listener = _listener(handler, Handshake(max_pending=4, seconds=1.0))
    try:
        sock = _connect(listener)
        frame = _LENGTH.pack(40) + bytes(40)
        started = time.monotonic()
        closed_at = None
        for byte in frame:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed_at = time.monotonic()
                break
            if _closed_within(sock, 0.3):
                closed_at = time.monotonic()
                break
        assert closed_at is not None, "the dripping peer was never cut off"
        assert closed_at - started < 2.0, f"cut off after {closed_at - started:.1f}s, the deadline is 1s"
        assert handler.firsts == []
        assert listener.refusals.totals == {"no whole first frame in time": 1}
        _wait_until(lambda: listener.open_connections == (0, 0), listener)
        sock.close()
    finally:
        listener.stop()


def test_a_first_frame_over_its_bound_is_refused_unread_and_a_whole_one_is_handled():
    handler = _Echo()
    answered: list[int] = []
    listener = _listener(handler, Handshake(max_pending=4, max_bytes=1024, seconds=5.0),
                         on_first_too_large=lambda connection, error: answered.append(error.size))
    try:
        sock = _connect(listener)
        sock.sendall(_LENGTH.pack(16 << 20) + bytes(8192))  # a 16 MiB hello begun: refused on its length
        assert _closed_within(sock, 5.0)
        assert answered == [16 << 20] and handler.firsts == []
        sock.close()
        # A first frame within the bound, then a frame past it: the handshake's bound is gone.
        sock = _connect(listener)
        sock.sendall(_LENGTH.pack(3) + b"abc")
        assert _read_frame(sock) == b"hello abc"
        sock.sendall(_LENGTH.pack(4096) + bytes(4096))
        assert _read_frame(sock) == bytes(4096)
        sock.close()
        assert handler.firsts == [b"abc"]
    finally:
        listener.stop()


def test_connections_past_either_cap_are_closed_as_they_are_accepted():
    """At most 2 connections in their handshake and 3 open: silent peers fill the first cap, and a
    connection past it is closed at once; handled connections count toward the second."""
    handler = _Echo()
    listener = _listener(handler, Handshake(max_pending=2, seconds=30.0), max_connections=3)
    sockets: list[socket.socket] = []
    try:
        silent = [_connect(listener), _connect(listener)]
        sockets += silent
        deadline = time.monotonic() + 5
        while listener.open_connections != (2, 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        over = _connect(listener)
        sockets.append(over)
        assert _closed_within(over, 5.0), "a third connection in its handshake was kept"
        silent[0].close()
        deadline = time.monotonic() + 5
        while listener.open_connections != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(2):  # one after the other: the silent one still holds a handshake
            sock = _connect(listener)
            sockets.append(sock)
            sock.sendall(_LENGTH.pack(2) + b"hi")
            assert _read_frame(sock) == b"hello hi"
        assert listener.open_connections == (3, 1)  # 3 open: the next is refused whatever it says
        last = _connect(listener)
        sockets.append(last)
        assert _closed_within(last, 5.0), "a fourth connection was kept"
        assert listener.refusals.totals == {"too many connections": 2}
    finally:
        for sock in sockets:
            sock.close()
        listener.stop()


def test_refusals_are_logged_at_warning_once_per_interval_with_counts(caplog):
    logger = logging.getLogger("test.refusals")
    refusals = RefusalLog(logger, "connection refused", interval=60.0, listener="x")
    with caplog.at_level(logging.DEBUG, logger="test.refusals"):
        for i in range(500):
            refusals.refused("too many connections" if i % 2 else "first frame too large", peer=f"p{i}")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 500
    assert refusals.totals == {"too many connections": 250, "first frame too large": 250}


def test_stop_ends_connections_in_their_handshake_and_after():
    handler = _Echo()
    listener = _listener(handler, Handshake(max_pending=4, seconds=30.0))
    talking = _connect(listener)
    talking.sendall(_LENGTH.pack(1) + b"x")
    assert _read_frame(talking) == b"hello x"
    silent = _connect(listener)
    time.sleep(0.2)
    listener.stop()
    assert _closed_within(talking, 5.0)
    assert _closed_within(silent, 5.0)
    talking.close()
    silent.close()


@pytest.mark.parametrize("bad", [{"max_pending": 0}, {"max_pending": 1, "seconds": 0.0},
                                 {"max_pending": 1, "max_bytes": 0}])
def test_a_handshake_names_a_bad_setting(bad):
    name = next(key for key, value in bad.items() if not value)
    with pytest.raises(ValueError, match=name):
        Handshake(**bad)


def test_threads_end_with_their_connections():
    handler = _Echo()
    listener = _listener(handler, Handshake(max_pending=8, seconds=0.5), max_connections=8)
    try:
        socks = [_connect(listener) for _ in range(8)]
        time.sleep(1.5)  # every handshake past its deadline
        _wait_until(lambda: listener.open_connections == (0, 0), listener)
        names = [t.name for t in threading.enumerate() if t.name == "test-frames-connection"]
        assert names == []
        for sock in socks:
            sock.close()
    finally:
        listener.stop()


def _wait_until(condition, listener: FrameListener, timeout: float = 5.0) -> None:
    """The listener's bookkeeping follows a close on its own thread: poll it."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"open connections still {listener.open_connections}"
        time.sleep(0.01)

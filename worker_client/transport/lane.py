"""A long-lived lane per shard for small pulls and pushes: an Exchange stream, or a TCP lane.

Setting up a gRPC call from Python costs about as much as three round trips
on a bidirectional stream that is already open (measured: unary-stream
1.1 ms, stream-unary 1.5 ms, a bidi round trip 0.4 ms). Steps of small
models are made of such calls, so each shard keeps one stream open and
sends a small request as one message, waiting for its one answer. One
request at a time per lane: a caller that finds the lane busy uses the
ordinary calls instead, so nothing ever queues behind a slow request.

What carries the requests is a :class:`LaneStream`: the gRPC Exchange
stream (:class:`GrpcStream`), or the server's TCP lane when it has one
(worker_client.transport.tcp_lane), the same messages as frames on a
socket, where a round trip costs a sixth as much. The lane opens it, and
opens it again after it broke, through the connection's ``open_stream``.

Errors: a failed request comes back as an ExchangeError and is raised as
the same typed exception the ordinary call would raise; a broken stream is
raised as a gRPC error (translated) and reopened by the next request.

A server bounds its Exchange streams apart from its other calls
(``--max-exchange-streams``, ps_server.core.admission). A stream it refuses
(RESOURCE_EXHAUSTED, reason EXCHANGE_STREAMS) was refused before it read
a request: :class:`LaneRefused` tells the caller to send the same request
as an ordinary call, and the lane stays closed for
:data:`_REFUSED_SECONDS` (its callers use ordinary calls meanwhile) before
it tries to open a stream again.

Deadlines: the stream lives for minutes, so it cannot carry a request's
deadline. Each request gets its own (``request_timeout``, the client's
``data_timeout``, like the ordinary call it replaces): a watchdog thread
cancels the stream when an answer is late, and the wait ends with
``DEADLINE_EXCEEDED``, which the client retries like any other attempt.
A server that stopped answering (hung, or stopped) would otherwise hold
the request until the connection's keepalive or the stream's lifetime ran
out.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from wehub_ps.errors import Reason
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.codec import EXCHANGE_ERROR, decode_envelope, envelope_pieces, join_pieces
from worker_client.errors import PSError, PSUnavailableError, error_for, translate_rpc_error

__all__ = ["ExchangeLane", "GrpcStream", "LaneRefused", "LaneStream", "LIFETIME_SECONDS"]

_CLOSE = object()
#: A stream is replaced after this long, so no call deadline ever runs out mid-request.
LIFETIME_SECONDS = 600.0
# After the server refused a stream: ordinary calls only, for this long (streams
# are freed as other workers leave; asking at every request would cost a round trip each).
_REFUSED_SECONDS = 30.0


class LaneRefused(PSUnavailableError):
    """The server refused to open the lane; the request was not read. Send it as an ordinary call."""


class LaneStream(Protocol):
    """What carries a lane's requests and answers, one request at a time."""

    def send(self, pieces: list) -> None:
        """Send one ExchangeRequest, given as pieces (PSError when the stream broke).

        The pieces may be views of the caller's arrays and of its thread's
        conversion arena: they are sent, or copied, before this returns.
        """

    def receive(self, what: str) -> bytes | bytearray:
        """The next ExchangeResponse; PSError (translated) when the stream failed or ended."""

    def cancel(self) -> None:
        """End the stream from another thread: a waiting ``receive`` fails at once."""

    def close(self) -> None:
        """End the stream; it is not used again."""


class GrpcStream:
    """The Exchange stream: requests through a queue that gRPC's thread reads, answers as they come."""

    def __init__(self, open_call: Callable[..., Any], address: str) -> None:
        self._address = address
        #: Seconds after which the lane replaces this stream (never more than ``LIFETIME_SECONDS``); set
        #: shorter by whoever opened it to be back on another lane sooner.
        self.lifetime = LIFETIME_SECONDS * 0.9
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = open_call(iter(self._requests.get, _CLOSE), timeout=LIFETIME_SECONDS)

    def send(self, pieces: list) -> None:
        self._requests.put(join_pieces(pieces))  # gRPC sends it later, from its own thread

    def receive(self, what: str) -> bytes:
        try:
            return next(self._responses)
        except grpc.RpcError as error:
            raise translate_rpc_error(error, self._address, what) from error
        except StopIteration:
            raise error_for(grpc.StatusCode.UNAVAILABLE, None, "the exchange stream ended", self._address,
                            what) from None

    def cancel(self) -> None:
        self._responses.cancel()

    def close(self) -> None:
        self._requests.put(_CLOSE)
        self._responses.cancel()


class ExchangeLane:
    """One shard connection's lane: one request at a time, each with its own deadline."""

    def __init__(self, open_stream: Callable[[], LaneStream], address: str,
                 request_timeout: float = 300.0) -> None:
        self._open_stream = open_stream
        self._address = address
        self._request_timeout = request_timeout
        # The watchdog looks at the deadline this often: a late answer is given up on within a tenth of
        # request_timeout (at most 1 s) past its deadline, and a request never wakes the watchdog (a
        # thread switch per request would cost a small step more than the check).
        self._watch_seconds = min(1.0, max(0.05, request_timeout / 10))
        # Held by the one request using the lane; guards every field below but those of _watch.
        self._busy = threading.Lock()
        self._stream: LaneStream | None = None
        self._opened_at = 0.0
        # The stream in use is replaced after this long (a GrpcStream's own lifetime).
        self._lifetime = LIFETIME_SECONDS * 0.9
        self._next_id = 1
        # Until then the server refuses this lane's stream (a float read and written whole: no lock).
        self._refused_until = 0.0
        # Guards the deadline of the request waiting for its answer (_deadline,
        # monotonic, None when none waits), _expired (the watchdog cancelled
        # the stream for it), _watched (the stream it would cancel), _watchdog
        # and _shut; notified at shutdown (the watchdog polls deadlines).
        self._watch = threading.Condition(threading.Lock())
        self._deadline: float | None = None
        self._expired = False
        self._watched: LaneStream | None = None
        self._watchdog: threading.Thread | None = None
        self._shut = False

    @property
    def refused(self) -> bool:
        """True while the server's refusal of a stream stands: use ordinary calls."""
        return time.monotonic() < self._refused_until

    def try_acquire(self) -> bool:
        return self._busy.acquire(blocking=False)

    def release(self) -> None:
        self._busy.release()

    def request(self, field: int, payload: bytes | list, what: str) -> tuple[int, memoryview]:
        """Send one request and wait for its answer (the caller holds the lane)."""
        return self.receive(self.send(field, payload), what)

    def send(self, field: int, payload: bytes | list) -> int:
        """Send one request (the caller holds the lane); its id, for :meth:`receive`."""
        if self._stream is None or time.monotonic() - self._opened_at > self._lifetime:
            self._reopen()
        stream = self._stream
        assert stream is not None
        request_id = self._next_id
        self._next_id += 1
        with self._watch:
            self._deadline = time.monotonic() + self._request_timeout
            self._expired = False
            self._watched = stream
            if self._watchdog is None and not self._shut:
                self._watchdog = threading.Thread(target=self._watch_deadlines, daemon=True,
                                                  name=f"ps-lane-deadline-{self._address}")
                self._watchdog.start()
        try:
            stream.send(envelope_pieces(request_id, field, payload))
        except BaseException as error:
            expired = self._disarm()
            self.close()
            if expired:
                raise self._late("exchange") from error
            raise
        return request_id

    def receive(self, request_id: int, what: str) -> tuple[int, memoryview]:
        """Wait for the answer to request ``request_id``, the last one sent."""
        stream = self._stream
        try:
            if stream is None:  # closed by another thread (the client closing)
                raise error_for(grpc.StatusCode.UNAVAILABLE, None, "the exchange lane was closed",
                                self._address, what)
            message = stream.receive(what)
        except PSError as error:
            expired = self._disarm()
            self.close()
            if expired:
                raise self._late(what) from None
            raise self._refusal(error) from error
        except BaseException:
            # Interrupted while waiting (KeyboardInterrupt): the answer still
            # on its way would be read as the next request's. Start afresh.
            self._disarm()
            self.close()
            raise
        if self._disarm():
            # The answer came as the watchdog cancelled the stream: it is good, the stream is not.
            self.close()
        answer_id, answer_field, answer = decode_envelope(message)
        if answer_id == 0 and answer_field == EXCHANGE_ERROR:
            # The whole lane failed (a TCP lane's hello refused, its token no longer valid): never read.
            self.close()
            raise self._refusal(_exchange_error(answer, self._address, what))
        if answer_id != request_id:
            self.close()
            raise error_for(grpc.StatusCode.INTERNAL, None, f"answer {answer_id} to request {request_id}",
                            self._address, what)
        if answer_field == EXCHANGE_ERROR:
            raise _exchange_error(answer, self._address, what)
        return answer_field, answer

    def _late(self, what: str) -> PSError:
        return error_for(grpc.StatusCode.DEADLINE_EXCEEDED, None,
                         f"no answer over the exchange lane within {self._request_timeout:g}s (data_timeout)",
                         self._address, what)

    def _refusal(self, error: PSError) -> PSError:
        """``error`` as raised: LaneRefused when the server refused the lane itself (its bound on lanes)."""
        if error.reason == Reason.EXCHANGE_STREAMS.value:
            self._refused_until = time.monotonic() + _REFUSED_SECONDS
            return LaneRefused(str(error), address=self._address, reason=error.reason, code=error.code)
        return error

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def interrupt(self) -> None:
        """End the stream a request is using, from another thread: its wait fails at once (UNAVAILABLE).

        For a connection being left while a request waits on it: closing a
        gRPC channel ends its Exchange stream, but nothing of the channel
        ends a TCP lane's socket, and a request waiting there for a host
        that was cut off would wait for the kernel to give up on the
        connection (minutes).
        """
        stream = self._stream
        if stream is not None:
            stream.cancel()

    def shutdown(self) -> None:
        """Stop the watchdog thread (the channel is closing); the lane is not used again."""
        with self._watch:
            self._shut = True
            self._watch.notify()
            watchdog = self._watchdog
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join(5)

    def _disarm(self) -> bool:
        """The waiting request has its answer (or error): no deadline now. Whether it had expired."""
        with self._watch:
            self._deadline = None
            self._watched = None
            expired, self._expired = self._expired, False
        return expired

    def _watch_deadlines(self) -> None:
        """Cancel the stream when the request waiting on it is past its deadline."""
        with self._watch:
            while not self._shut:
                if self._deadline is None:
                    self._watch.wait(self._watch_seconds)
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._watch.wait(min(remaining, self._watch_seconds))
                    continue
                self._deadline = None
                self._expired = True
                if self._watched is not None:
                    self._watched.cancel()  # the waiting receive fails at once

    def _reopen(self) -> None:
        self.close()
        self._stream = stream = self._open_stream()
        self._opened_at = time.monotonic()
        self._lifetime = min(LIFETIME_SECONDS * 0.9, getattr(stream, "lifetime", LIFETIME_SECONDS * 0.9))


def _exchange_error(answer: memoryview, address: str, what: str) -> PSError:
    """The typed exception for an ExchangeError answer; a NOT_PRIMARY one names the primary it gave."""
    err = ps_pb2.ExchangeError.FromString(answer)
    return error_for(_status(err.code), err.reason or None, err.message, address, what, err.primary or None)


def _status(code: int) -> grpc.StatusCode:
    for status in grpc.StatusCode:
        if status.value[0] == code:
            return status
    return grpc.StatusCode.UNKNOWN

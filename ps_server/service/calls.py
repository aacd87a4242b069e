"""How a gRPC call of the ParameterServer service enters and leaves.

Every method takes the raw request bytes and parses them itself
(:func:`parse`), so that a request that is not a valid message at all gets
INVALID_ARGUMENT (gRPC's own deserializer would answer INTERNAL). Errors
leave through one table, :data:`STATUS_BY_REASON`, with the reason in
trailing metadata. Each call holds a slot of its bound while it runs
(:class:`CallSlots`, over ps_server.core.admission).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import grpc

from ps_server.core.admission import Admission
from ps_server.core.errors import RequestError
from ps_server.core.pushes import MAX_WORKER_ID_LENGTH
from wehub_ps.errors import REASON_METADATA_KEY, Reason
from wehub_ps.wire.rpc import INCARNATION_METADATA_KEY

__all__ = ["STATUS_BY_REASON", "abort", "parse", "unary", "CallSlots"]

STATUS_BY_REASON: dict[Reason, grpc.StatusCode] = {
    Reason.MALFORMED_MESSAGE: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.INVALID_SPEC: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.INVALID_CHUNK: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.SHAPE_MISMATCH: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.DTYPE_MISMATCH: grpc.StatusCode.INVALID_ARGUMENT,
    Reason.UNKNOWN_VARIABLE: grpc.StatusCode.NOT_FOUND,
    Reason.SPEC_CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    Reason.CLUSTER_MISMATCH: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.NOT_INITIALIZED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.PUSH_INCOMPLETE: grpc.StatusCode.FAILED_PRECONDITION,
    # ABORTED: a sequencer check failed; the client must not retry the same push.
    Reason.PUSH_WRITTEN_OFF: grpc.StatusCode.ABORTED,
    Reason.TOO_MANY_RPCS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.EXCHANGE_STREAMS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.MEMORY_LIMIT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    Reason.NOT_PRIMARY: grpc.StatusCode.UNAVAILABLE,
    Reason.CHECKPOINTS_DISABLED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.DISK_TIER_DISABLED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.STEP_TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    Reason.FINISH_NOT_ALLOWED: grpc.StatusCode.FAILED_PRECONDITION,
    Reason.SWITCHOVER_REFUSED: grpc.StatusCode.FAILED_PRECONDITION,
}

M = TypeVar("M")


def abort(context: grpc.ServicerContext, error: RequestError) -> None:
    """End the call with the status of ``error``'s reason, the reason in trailing metadata."""
    context.set_trailing_metadata(((REASON_METADATA_KEY, error.reason.value), *error.trailers))
    context.abort(STATUS_BY_REASON[error.reason], error.message)


def parse(message_cls: type[M], raw: bytes) -> M:
    """``raw`` as a ``message_cls``; MALFORMED_MESSAGE when it is none."""
    try:
        return message_cls.FromString(raw)
    except Exception as exc:  # DecodeError, or upb's errors for garbage
        raise RequestError(Reason.MALFORMED_MESSAGE,
                           f"request is not a valid {message_cls.DESCRIPTOR.full_name}: {exc}") from None


def unary(method: Callable) -> Callable:
    """A servicer method whose RequestError ends the call (see :func:`abort`)."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except RequestError as error:
            abort(context, error)
    return wrapper


class CallSlots:
    """Wraps handlers so that each holds a slot of its bound; keeps the open Exchange streams."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        # Guards _open_streams: the contexts of the Exchange streams being served.
        self._streams_lock = threading.Lock()
        self._open_streams: set[grpc.ServicerContext] = set()

    @contextlib.contextmanager
    def _call_slot(self, context: grpc.ServicerContext) -> Iterator[None]:
        """An ordinary call's slot for the body; TOO_MANY_RPCS (the call ends) when none is free."""
        try:
            self._admission.enter_call()
        except RequestError as error:
            abort(context, error)
        try:
            yield
        finally:
            self._admission.exit_call()

    def unary(self, method: Callable) -> Callable:
        """``method`` (one answer) holding an ordinary call's slot."""

        def handler(request, context):
            with self._call_slot(context):
                return method(request, context)
        return functools.wraps(method)(handler)

    def streaming(self, method: Callable) -> Callable:
        """``method`` (a stream of answers) holding an ordinary call's slot until its last answer."""

        def handler(request, context):
            with self._call_slot(context):
                yield from method(request, context)
        return functools.wraps(method)(handler)

    def exchange(self, method: Callable) -> Callable:
        """``method`` (an Exchange stream) holding a stream's slot; EXCHANGE_STREAMS at once over a bound."""

        def handler(request_iterator: Iterable[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            incarnation = ""
            for key, value in context.invocation_metadata() or ():
                if key == INCARNATION_METADATA_KEY:
                    incarnation = value if isinstance(value, str) else value.decode("utf-8", "replace")
            try:
                if len(incarnation) > MAX_WORKER_ID_LENGTH:
                    raise RequestError(Reason.INVALID_REQUEST, f"{INCARNATION_METADATA_KEY} must be at most "
                                                               f"{MAX_WORKER_ID_LENGTH} characters")
                self._admission.enter_stream(incarnation)
            except RequestError as error:
                abort(context, error)
                return
            with self._streams_lock:
                self._open_streams.add(context)
            try:
                yield from method(request_iterator, context)
            finally:
                with self._streams_lock:
                    self._open_streams.discard(context)
                self._admission.exit_stream(incarnation)
        return functools.wraps(method)(handler)

    def end_exchange_streams(self) -> int:
        """Cancel every open Exchange stream (CANCELLED: clients retry); returns how many.

        Called once the final checkpoint has sealed the store: an idle stream
        would otherwise hold gRPC's stop grace period open for nothing.
        """
        with self._streams_lock:
            streams = list(self._open_streams)
        for context in streams:
            context.cancel()
        return len(streams)

"""The standard gRPC services a ps-server serves besides its own: health and reflection.

Both take care of two gaps of the stock servicers. grpcio-health-checking's
servicer answers ``Health/List`` with UNIMPLEMENTED although reflection lists
it; ours answers it from the same table as ``Check``. grpc's own request
deserialiser, given a message it cannot parse on a request *stream*, answers
INTERNAL and then, when the handler ends, tries to send a second status: the
call is never released and ``server.stop()`` never completes (a ps-server
that never exits after SIGTERM). Reflection therefore takes raw bytes and
parses them itself, as the ParameterServer service does: garbage gets
INVALID_ARGUMENT and the call ends normally.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

__all__ = ["HealthServicer", "add_reflection"]


class HealthServicer(health.HealthServicer):
    """grpc_health's servicer, with ``List`` answered as ``Check`` answers each service."""

    def __init__(self) -> None:
        super().__init__(experimental_non_blocking=True)
        # Guards _names: the services whose status was ever set.
        self._names_lock = threading.Lock()
        self._names: set[str] = set()

    def set(self, service: str, status) -> None:
        super().set(service, status)
        with self._names_lock:
            self._names.add(service)

    def List(self, request: health_pb2.HealthListRequest, context: grpc.ServicerContext):
        with self._names_lock:
            names = sorted(self._names)
        check = health_pb2.HealthCheckRequest
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=self.Check(check(service=name), context).status)
            for name in names})


def add_reflection(server: grpc.Server, service_names: Iterable[str]) -> None:
    """Serve gRPC server reflection (v1alpha) for ``service_names``, parsing requests itself."""
    servicer = reflection.ReflectionServicer(tuple(service_names))
    request_type = reflection_pb2.ServerReflectionRequest

    def server_reflection_info(raw_requests: Iterator[bytes],
                               context: grpc.ServicerContext) -> Iterator[bytes]:
        def requests() -> Iterator[reflection_pb2.ServerReflectionRequest]:
            for raw in raw_requests:
                try:
                    yield request_type.FromString(raw)
                except Exception as exc:  # DecodeError, or upb's errors for garbage
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"request is not a valid {request_type.DESCRIPTOR.full_name}: {exc}")

        for response in servicer.ServerReflectionInfo(requests(), context):
            yield response.SerializeToString()

    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(reflection.SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(server_reflection_info),
    }),))

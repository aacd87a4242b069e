"""One gRPC channel per ps-server, and raw-bytes callables for its methods.

Requests and responses cross this layer as bytes: the client frames the
data-path messages itself (:mod:`wehub_ps.wire.codec`) to avoid copying tensor
bytes, and parses control responses with the generated classes. Every call
carries a deadline; every ``grpc.RpcError`` is translated here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from wehub_ps.wire.rpc import INCARNATION_METADATA_KEY, MAX_MESSAGE_BYTES, SERVICE_NAME, method_path
from worker_client.errors import PSError, translate_rpc_error
from worker_client.transport.credentials import BearerToken
from worker_client.transport.lane import ExchangeLane

__all__ = ["ShardChannel"]

T = TypeVar("T")


class ShardChannel:
    """The connection to the ps-server of one shard."""

    def __init__(self, index: int, address: str, *, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None,
                 token: BearerToken | None = None, incarnation: str | None = None,
                 request_timeout: float = 300.0) -> None:
        self.index = index
        self.address = address
        # Every call (and every stream when it opens) carries the token's current value as metadata.
        self._token = token if token is not None else BearerToken(None, None)
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Reconnect quickly after a server restart or a cut connection;
            # the client's own retry loop spaces the attempts.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
            # Notice a dead peer (a partitioned host) within ~30 s.
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
        ]
        self._closed = False
        if credentials is not None:
            if server_name:  # the name the certificate was issued for, when the address differs
                options.append(("grpc.ssl_target_name_override", server_name))
            self._channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._describe = self._channel.unary_unary(method_path("Describe"))
        self._create = self._channel.unary_unary(method_path("CreateVariable"))
        self._pull = self._channel.unary_stream(method_path("Pull"))
        self._push = self._channel.stream_unary(method_path("Push"))
        self._heartbeat = self._channel.unary_unary(method_path("Heartbeat"))
        self._checkpoint = self._channel.unary_unary(method_path("Checkpoint"))
        #: The long-lived stream for small requests (see worker_client.transport.lane).
        self._finish = self._channel.unary_unary(method_path("Finish"))
        exchange = self._channel.stream_stream(method_path("Exchange"))
        # The server bounds the Exchange streams of each worker process (incarnation).
        self._incarnation = incarnation
        self.lane = ExchangeLane(lambda requests, timeout: exchange(requests, timeout=timeout,
                                                                    metadata=self._lane_metadata()), address,
                                 request_timeout)

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return self._token.metadata()

    def _lane_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The token's current value, and the incarnation the server bounds this stream under."""
        metadata = tuple(self._metadata or ())
        if self._incarnation:
            metadata += ((INCARNATION_METADATA_KEY, self._incarnation),)
        return metadata or None

    def describe(self, request: bytes, timeout: float) -> bytes:
        return self._guard("describe", lambda: self._describe(request, timeout=timeout, metadata=self._metadata))

    def heartbeat(self, request: bytes, timeout: float) -> bytes:
        return self._guard("heartbeat", lambda: self._heartbeat(request, timeout=timeout, metadata=self._metadata))

    def checkpoint(self, request: bytes, timeout: float) -> bytes:
        return self._guard("checkpoint", lambda: self._checkpoint(request, timeout=timeout,
                                                                   metadata=self._metadata))

    def health(self, timeout: float) -> str:
        """The gRPC health status of the ParameterServer service ('SERVING', ...), or 'UNREACHABLE'."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            answer = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)

    def finish(self, request: bytes, timeout: float) -> bytes:
        return self._guard("finish", lambda: self._finish(request, timeout=timeout, metadata=self._metadata))

    def create_variable(self, request: bytes, timeout: float) -> bytes:
        return self._guard("create_variable", lambda: self._create(request, timeout=timeout,
                                                                   metadata=self._metadata))

    def pull(self, request: bytes, timeout: float, on_message: Callable[[bytes], None]) -> None:
        """Stream a pull, handing each response message to ``on_message``."""
        def run() -> None:
            for message in self._pull(request, timeout=timeout, metadata=self._metadata):
                on_message(message)
        self._guard("pull", run)

    def push(self, messages: Iterator[bytes], timeout: float) -> bytes:
        return self._guard("push", lambda: self._push(messages, timeout=timeout, metadata=self._metadata))

    def exchange(self, field: int, payload: bytes | list, what: str) -> memoryview | None:
        """One small request over the lane; None when the lane is busy (use the ordinary call)."""
        pending = self.exchange_start(field, payload, what)
        return pending.result() if pending is not None else None

    def exchange_start(self, field: int, payload: bytes | list, what: str) -> PendingExchange | None:
        """Send a small request over the lane and return at once; None when the lane is busy.

        The caller must call ``result()`` on what it gets: that reads the
        answer and frees the lane. Sending to every shard first and then
        reading the answers overlaps the shards without a thread per shard.
        """
        if self._closed:
            raise PSError(f"{what}: the client was closed", address=self.address)
        if self.lane.refused or not self.lane.try_acquire():
            return None
        try:
            request_id = self.lane.send(field, payload)
        except BaseException:
            self.lane.release()
            raise
        return PendingExchange(self.lane, request_id, what)

    def close(self) -> None:
        self._closed = True
        if self.lane.try_acquire():
            self.lane.close()
            self.lane.release()
        self.lane.shutdown()
        self._channel.close()

    def _guard(self, what: str, call: Callable[[], T]) -> T:
        if self._closed:
            raise PSError(f"{what}: the client was closed", address=self.address)
        try:
            return call()
        except grpc.RpcError as error:
            raise translate_rpc_error(error, self.address, what) from error


class PendingExchange:
    """A request sent over a shard's lane whose answer has not been read yet."""

    def __init__(self, lane: ExchangeLane, request_id: int, what: str) -> None:
        self._lane = lane
        self._request_id = request_id
        self._what = what

    def result(self) -> memoryview:
        """The answer (or the request's typed error); frees the lane either way."""
        try:
            return self._lane.receive(self._request_id, self._what)[1]
        finally:
            self._lane.release()

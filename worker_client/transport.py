"""One gRPC channel per ps-server, and raw-bytes callables for its methods.

Requests and responses cross this layer as bytes: the client frames the
data-path messages itself (:mod:`wehub_ps.codec`) to avoid copying tensor
bytes, and parses control responses with the generated classes. Every call
carries a deadline; every ``grpc.RpcError`` is translated here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import grpc

from worker_client.errors import PSError, translate_rpc_error
from worker_client.lane import ExchangeLane
from wehub_ps.rpc import MAX_MESSAGE_BYTES, method_path

__all__ = ["ShardChannel"]

T = TypeVar("T")


class ShardChannel:
    """The connection to the ps-server of one shard."""

    def __init__(self, index: int, address: str, *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.index = index
        self.address = address
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
        self._channel = grpc.insecure_channel(address, options=options)
        self._describe = self._channel.unary_unary(method_path("Describe"))
        self._create = self._channel.unary_unary(method_path("CreateVariable"))
        self._pull = self._channel.unary_stream(method_path("Pull"))
        self._push = self._channel.stream_unary(method_path("Push"))
        self._heartbeat = self._channel.unary_unary(method_path("Heartbeat"))
        self._checkpoint = self._channel.unary_unary(method_path("Checkpoint"))
        #: The long-lived stream for small requests (see worker_client.lane).
        self.lane = ExchangeLane(self._channel.stream_stream(method_path("Exchange")), address)

    def describe(self, request: bytes, timeout: float) -> bytes:
        return self._guard("describe", lambda: self._describe(request, timeout=timeout))

    def heartbeat(self, request: bytes, timeout: float) -> bytes:
        return self._guard("heartbeat", lambda: self._heartbeat(request, timeout=timeout))

    def checkpoint(self, request: bytes, timeout: float) -> bytes:
        return self._guard("checkpoint", lambda: self._checkpoint(request, timeout=timeout))

    def create_variable(self, request: bytes, timeout: float) -> bytes:
        return self._guard("create_variable", lambda: self._create(request, timeout=timeout))

    def pull(self, request: bytes, timeout: float, on_message: Callable[[bytes], None]) -> None:
        """Stream a pull, handing each response message to ``on_message``."""
        def run() -> None:
            for message in self._pull(request, timeout=timeout):
                on_message(message)
        self._guard("pull", run)

    def push(self, messages: Iterator[bytes], timeout: float) -> bytes:
        return self._guard("push", lambda: self._push(messages, timeout=timeout))

    def exchange(self, field: int, payload: bytes, what: str) -> memoryview | None:
        """One small request over the lane; None when the lane is busy (use the ordinary call)."""
        if self._closed:
            raise PSError(f"{what}: the client was closed", address=self.address)
        if not self.lane.try_acquire():
            return None
        try:
            return self.lane.request(field, payload, what)[1]
        finally:
            self.lane.release()

    def close(self) -> None:
        self._closed = True
        if self.lane.try_acquire():
            self.lane.close()
            self.lane.release()
        self._channel.close()

    def _guard(self, what: str, call: Callable[[], T]) -> T:
        if self._closed:
            raise PSError(f"{what}: the client was closed", address=self.address)
        try:
            return call()
        except grpc.RpcError as error:
            raise translate_rpc_error(error, self.address, what) from error

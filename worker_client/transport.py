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
            # Loopback and datacenter links: do not wait to coalesce small writes.
            ("grpc.http2.lookahead_bytes", 0),
        ]
        self._closed = False
        self._channel = grpc.insecure_channel(address, options=options)
        self._describe = self._channel.unary_unary(method_path("Describe"))
        self._create = self._channel.unary_unary(method_path("CreateVariable"))
        self._pull = self._channel.unary_stream(method_path("Pull"))
        self._push = self._channel.stream_unary(method_path("Push"))

    def describe(self, request: bytes, timeout: float, wait_for_ready: bool = False) -> bytes:
        return self._guard("describe", lambda: self._describe(request, timeout=timeout,
                                                               wait_for_ready=wait_for_ready))

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

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def _guard(self, what: str, call: Callable[[], T]) -> T:
        if self._closed:
            raise PSError(f"{what}: the client was closed", address=self.address)
        try:
            return call()
        except grpc.RpcError as error:
            raise translate_rpc_error(error, self.address, what) from error

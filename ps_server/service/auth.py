"""Bearer-token authentication for every RPC except health checks.

The token lives in a file (``--auth-token-file``; on Kubernetes a mounted
Secret). It is re-read when the file changes (looked at every
``_RECHECK_SECONDS``), so rotating the Secret takes effect without a restart
once the kubelet has updated the mount. Tokens are compared in constant time
(``hmac.compare_digest``).

A call is checked when it opens, and a call that streams requests (Push,
Exchange) again before each request message is handed on: a worker's
Exchange stream lives for minutes, and a rotated token must cut it off
before its next push is applied, not when it next reconnects.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections.abc import Iterator

import grpc

from wehub_ps.errors import REASON_METADATA_KEY, Reason
from wehub_ps.process.logs import event

__all__ = ["TokenFile", "AuthInterceptor", "STALE_TOKEN", "token_refusal"]

log = logging.getLogger("ps_server.service.auth")

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_RECHECK_SECONDS = 2.0


class TokenFile:
    """The current token, re-read when the file's modification time changes."""

    def __init__(self, path: str) -> None:
        self._path = path
        # Guards _token, _mtime and _checked.
        self._lock = threading.Lock()
        self._token = b""
        self._mtime = -1.0
        self._checked = 0.0
        self._load()
        if not self._token:
            raise ValueError(f"--auth-token-file {path!r} is empty")

    def _load(self) -> None:
        mtime = os.stat(self._path).st_mtime
        if mtime != self._mtime:
            with open(self._path, "rb") as f:
                token = f.read().strip()
            if token:
                if self._mtime >= 0:
                    event(log, logging.INFO, "auth token reloaded", path=self._path)
                self._token, self._mtime = token, mtime

    def current(self) -> bytes:
        now = time.monotonic()
        with self._lock:
            if now - self._checked > _RECHECK_SECONDS:
                self._checked = now
                try:
                    self._load()
                except OSError as exc:  # keep the last good token
                    event(log, logging.WARNING, "auth token file unreadable", path=self._path, error=str(exc))
            return self._token

    def matches(self, presented: bytes) -> bool:
        return hmac.compare_digest(presented, self.current())


def _presented_token(metadata) -> bytes:
    for key, value in metadata or ():
        if key == "authorization":
            raw = value if isinstance(value, bytes) else value.encode()
            if raw[:7].lower() == b"bearer ":
                return raw[7:].strip()
    return b""


def _refuse(context: grpc.ServicerContext, message: str) -> None:
    """End the call with UNAUTHENTICATED (raises)."""
    context.set_trailing_metadata(((REASON_METADATA_KEY, Reason.UNAUTHENTICATED.value),))
    context.abort(grpc.StatusCode.UNAUTHENTICATED, message)


def _denying(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that fails with UNAUTHENTICATED."""

    def deny(request_or_iterator, context):
        _refuse(context, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


#: Why an open stream (or TCP lane) is cut off at its next message after a rotation.
STALE_TOKEN = ("the bearer token of this stream is no longer valid: --auth-token-file of this ps-server was "
               "rotated; reconnect with the new token")


def token_refusal(tokens: TokenFile, presented: bytes) -> str | None:
    """Why a call (or a TCP lane's hello) presenting ``presented`` is refused; None when it may go on."""
    if not presented:
        return "this ps-server requires a bearer token: pass auth_token / PS_AUTH_TOKEN_FILE to the client"
    if not tokens.matches(presented):
        return "the bearer token is not valid for this ps-server"
    return None


def _revalidating(handler: grpc.RpcMethodHandler, tokens: TokenFile,
                  presented: bytes) -> grpc.RpcMethodHandler:
    """``handler`` (request-streaming) with the token checked again before each request message.

    The refusal happens while the service asks for its next message, so that
    message never reaches it: nothing of it is applied.
    """

    def checked(requests: Iterator, context: grpc.ServicerContext) -> Iterator:
        for request in requests:
            if not tokens.matches(presented):
                _refuse(context, STALE_TOKEN)
            yield request

    if handler.response_streaming:
        inner = handler.stream_stream
        return grpc.stream_stream_rpc_method_handler(
            lambda requests, context: inner(checked(requests, context), context),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    inner_unary = handler.stream_unary
    return grpc.stream_unary_rpc_method_handler(
        lambda requests, context: inner_unary(checked(requests, context), context),
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call without the right ``authorization: Bearer <token>``, health excepted.

    Request-streaming calls are checked again before each message (see the module docstring).
    """

    def __init__(self, tokens: TokenFile) -> None:
        self._tokens = tokens

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler
        presented = _presented_token(handler_call_details.invocation_metadata)
        refusal = token_refusal(self._tokens, presented)
        if refusal is not None:
            return _denying(handler, refusal)
        if handler.request_streaming:
            return _revalidating(handler, self._tokens, presented)
        return handler

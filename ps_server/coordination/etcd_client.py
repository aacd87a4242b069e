"""A small etcd v3 client over gRPC: keys, transactions, leases, watches, several endpoints, TLS.

Why our own client, generated from etcd's API, instead of a PyPI package:
the ``etcd3`` package is unmaintained (last release 2020), ships stubs made
for protobuf 3 and pins old grpcio; this project runs protobuf 7 and grpcio
1.85. The other Python clients either wrap the same stale stubs or speak the
JSON gateway (a second HTTP stack, no bidi streams for keepalive and watch).
etcd's wire contract is gRPC and very stable (the v3 API's field numbers
have not changed since 3.0), so protos/ps_server/coordination/etcdpb/etcd.proto
keeps etcd's messages and field numbers for the handful of calls used here
and grpcio-tools generates the stubs with the rest of the project's. What a
client library would add beyond this (retries across endpoints, watch
resumption, lease renewal) lives here and in ``watch`` and ``lease_keeper``,
sized to what shard elections need.

Thread-safety: one client is shared by every thread of a process; gRPC
channels are thread-safe and the endpoint in use changes under a lock.
"""

from __future__ import annotations

import logging
import pathlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from ps_server.coordination.errors import CoordinationError
from ps_server.coordination.etcd_ops import KeyValue, Lease, TxnResult, WatchEvent, key_bytes, prefix_end
from ps_server.coordination.etcdpb import etcd_pb2, etcd_pb2_grpc
from ps_server.coordination.watch import Watcher

__all__ = ["DEFAULT_TIMEOUT", "EtcdClient"]

_log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0

#: Codes that mean "this endpoint did not answer": try the next one.
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

# Reconnect quickly after etcd restarts (gRPC's default backoff grows to 120 s);
# ping idle connections so a silently vanished etcd breaks the streams. etcd
# refuses pings more often than every 5 s (--grpc-keepalive-min-time).
# gRPC gives a connection attempt max(min_reconnect_backoff, the current
# backoff) to complete (TCP and HTTP/2 handshakes): that is the connect
# timeout. It must outlast a lost SYN (Linux resends it after 1 s), or the
# first connection fails whenever one packet is lost; the backoff between
# attempts stays short (initial, max): an etcd back from seconds away must be
# reached again well within a lease's TTL (1 s in the tests), or the lease
# can expire although etcd is back.
_CONNECT_TIMEOUT_MS = 3000
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", _CONNECT_TIMEOUT_MS),
    ("grpc.max_reconnect_backoff_ms", 250),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]

_Reply = TypeVar("_Reply")


class _Connection:
    """One endpoint's channel and stubs."""

    def __init__(self, endpoint: str, credentials: grpc.ChannelCredentials | None) -> None:
        self.endpoint = endpoint
        if credentials is None:
            self.channel = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
        else:
            self.channel = grpc.secure_channel(endpoint, credentials, options=_CHANNEL_OPTIONS)
        self.kv = etcd_pb2_grpc.KVStub(self.channel)
        self.lease = etcd_pb2_grpc.LeaseStub(self.channel)
        self.watch = etcd_pb2_grpc.WatchStub(self.channel)


def _host_port(endpoint: str) -> tuple[str, bool]:
    """``host:port`` and whether the endpoint asks for TLS (``https://``)."""
    text = endpoint.strip().rstrip("/")
    for scheme, tls in (("https://", True), ("http://", False)):
        if text.startswith(scheme):
            return text[len(scheme):], tls
    return text, False


def _read(path: str | pathlib.Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as error:
        raise CoordinationError(f"cannot read the etcd {what} {path}: {error}", unreachable=False) from error


class EtcdClient:
    """Calls to an etcd cluster, trying ``endpoints`` in turn until one answers.

    ``endpoints``: ``host:port`` or ``http(s)://host:port``. TLS is used when
    ``ca`` is given (or an endpoint is ``https://``: system roots); with
    ``cert`` and ``key`` the client also proves itself (mutual TLS).
    ``timeout``: seconds one call may take on one endpoint.
    """

    def __init__(self, endpoints: Sequence[str], *, ca: str | pathlib.Path | None = None,
                 cert: str | pathlib.Path | None = None, key: str | pathlib.Path | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        parsed = [_host_port(e) for e in endpoints if e.strip()]
        if not parsed:
            raise CoordinationError("no etcd endpoint given: pass host:port of at least one etcd member",
                                    unreachable=False)
        if (cert is None) != (key is None):
            raise CoordinationError("the etcd client certificate and key go together: give both or neither",
                                    unreachable=False)
        self._endpoints = [host_port for host_port, _ in parsed]
        credentials = None
        if ca is not None or cert is not None or any(tls for _, tls in parsed):
            credentials = grpc.ssl_channel_credentials(root_certificates=_read(ca, "CA certificate"),
                                                       private_key=_read(key, "client key"),
                                                       certificate_chain=_read(cert, "client certificate"))
        self._credentials = credentials
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._connections: dict[str, _Connection] = {}
        self._current = 0
        self._closed = False

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    @property
    def closed(self) -> bool:
        return self._closed

    # --- keys -----------------------------------------------------------------------------------

    def get(self, key: str | bytes) -> KeyValue | None:
        """The key, or None when it does not exist (a linearizable read)."""
        kvs, _ = self.range(key)
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str | bytes) -> list[KeyValue]:
        """Every key that starts with ``prefix``, in key order."""
        return self.range(prefix, prefix=True)[0]

    def range(self, key: str | bytes, *, prefix: bool = False) -> tuple[list[KeyValue], int]:
        """The key (or every key under the prefix) and the store revision the read saw."""
        request = etcd_pb2.RangeRequest(key=key_bytes(key), range_end=prefix_end(key) if prefix else b"")
        reply = self._call("Range", lambda c: c.kv.Range, request)
        return [KeyValue.from_proto(kv) for kv in reply.kvs], reply.header.revision

    def put(self, key: str | bytes, value: bytes, *, lease: int = 0) -> int:
        """Store ``value`` (attached to ``lease`` when not 0); returns the store revision of the write."""
        request = etcd_pb2.PutRequest(key=key_bytes(key), value=value, lease=lease)
        return self._call("Put", lambda c: c.kv.Put, request).header.revision

    def delete(self, key: str | bytes, *, prefix: bool = False) -> int:
        """Delete the key (or every key under the prefix); returns how many were deleted."""
        request = etcd_pb2.DeleteRangeRequest(key=key_bytes(key),
                                              range_end=prefix_end(key) if prefix else b"")
        return self._call("DeleteRange", lambda c: c.kv.DeleteRange, request).deleted

    def txn(self, compare: Sequence[etcd_pb2.Compare], success: Sequence[etcd_pb2.RequestOp],
            failure: Sequence[etcd_pb2.RequestOp] = ()) -> TxnResult:
        """Apply ``success`` when every compare holds, else ``failure``, atomically (helpers: etcd_ops).

        When the answer is lost (a timeout), the transaction may or may not
        have applied: callers read back what they meant to write.
        """
        request = etcd_pb2.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
        reply = self._call("Txn", lambda c: c.kv.Txn, request)
        ranges = tuple(tuple(KeyValue.from_proto(kv) for kv in r.response_range.kvs)
                       for r in reply.responses if r.HasField("response_range"))
        return TxnResult(reply.succeeded, reply.header.revision, ranges)

    # --- leases ---------------------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> Lease:
        """A lease of ``ttl`` seconds (etcd may raise it to its minimum, about 1.5 election timeouts)."""
        reply = self._call("LeaseGrant", lambda c: c.lease.LeaseGrant, etcd_pb2.LeaseGrantRequest(TTL=ttl))
        if reply.error:
            raise CoordinationError(f"etcd refused a lease of {ttl} s: {reply.error}", unreachable=False)
        return Lease(reply.ID, reply.TTL)

    def lease_revoke(self, lease_id: int) -> bool:
        """Revoke the lease and delete its keys; False when etcd no longer knows the lease."""
        try:
            self._call("LeaseRevoke", lambda c: c.lease.LeaseRevoke, etcd_pb2.LeaseRevokeRequest(ID=lease_id))
        except CoordinationError as error:
            if error.code == grpc.StatusCode.NOT_FOUND.name:
                return False
            raise
        return True

    def keepalive(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Renew the lease once; returns its TTL in seconds, 0 when it has expired or was revoked.

        One request on a LeaseKeepAlive stream, bounded by ``timeout``: the
        caller learns within that time that etcd did not confirm, which a
        long-lived stream would only show through its own deadline logic.
        """
        def renew(connection: _Connection) -> Callable[..., int]:
            def call(request: etcd_pb2.LeaseKeepAliveRequest, timeout: float) -> int:
                responses = connection.lease.LeaseKeepAlive(iter((request,)), timeout=timeout)
                try:
                    for response in responses:
                        return int(response.TTL)
                finally:
                    responses.cancel()
                raise CoordinationError(f"etcd at {connection.endpoint} closed the keepalive stream without "
                                        "an answer", unreachable=True)
            return call

        request = etcd_pb2.LeaseKeepAliveRequest(ID=lease_id)
        return self._call("LeaseKeepAlive", renew, request, timeout=timeout)

    # --- watches --------------------------------------------------------------------------------

    def watch(self, key: str | bytes, callback: Callable[[WatchEvent], None], *, prefix: bool = False,
              start_revision: int = 0, name: str = "etcd-watch") -> Watcher:
        """Call ``callback`` with each change of the key (or prefix) on a thread named ``name``.

        From ``start_revision`` (inclusive; 0: from now). After a lost
        connection the watch resumes from the revision after the last event
        delivered, on whichever endpoint answers, so no change is missed or
        repeated. ``Watcher.stop()`` ends it.
        """
        request = etcd_pb2.WatchCreateRequest(key=key_bytes(key),
                                              range_end=prefix_end(key) if prefix else b"")
        return Watcher(request, start_revision, self._open_watch, self._note_stream_failure, callback,
                       name=name).start()

    def _open_watch(self, requests: Iterator[etcd_pb2.WatchRequest]) -> Any:
        return self._connection().watch.Watch(requests)

    def _note_stream_failure(self, error: grpc.RpcError) -> None:
        if error.code() in _UNREACHABLE:
            with self._lock:
                failed = self._endpoints[self._current]
            self._rotate(failed)

    # --- plumbing -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close every channel (in-flight calls and watches end); idempotent."""
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections.values()), {}
        for connection in connections:
            connection.channel.close()

    def _connection(self) -> _Connection:
        with self._lock:
            if self._closed:
                raise CoordinationError("the etcd client is closed", unreachable=True)
            endpoint = self._endpoints[self._current]
            connection = self._connections.get(endpoint)
            if connection is None:
                connection = self._connections[endpoint] = _Connection(endpoint, self._credentials)
            return connection

    def _rotate(self, failed_endpoint: str) -> None:
        with self._lock:
            if self._endpoints[self._current] == failed_endpoint:
                self._current = (self._current + 1) % len(self._endpoints)

    def _call(self, method: str, pick: Callable[[_Connection], Callable[..., _Reply]], request: Any,
              timeout: float | None = None) -> _Reply:
        """One call, on each endpoint in turn until one answers."""
        failures = []
        for _ in range(len(self._endpoints)):
            connection = self._connection()
            try:
                return pick(connection)(request, timeout=timeout or self.timeout)
            except grpc.RpcError as error:
                code, details = error.code(), error.details()
                if code in _UNREACHABLE:
                    failures.append(f"{connection.endpoint} ({code.name}: {details})")
                    self._rotate(connection.endpoint)
                    continue
                if code == grpc.StatusCode.CANCELLED and self._closed:
                    raise CoordinationError("the etcd client is closed", unreachable=True) from error
                raise CoordinationError(
                    f"etcd at {connection.endpoint} refused {method}: {code.name}: {details}"
                    f"{_hint(code)}", unreachable=False, code=code.name) from error
        raise CoordinationError(
            f"no etcd endpoint answered {method}: {'; '.join(failures)}. Check that etcd runs and that "
            "--etcd-endpoints names it; with TLS, that the CA and client certificate match etcd's",
            unreachable=True)


def _hint(code: grpc.StatusCode) -> str:
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return " (etcd's authentication: check the client certificate and the etcd user's role)"
    return ""

"""One gRPC channel per ps-server, and raw-bytes callables for its methods.

Requests and responses cross this layer as bytes: the client frames the
data-path messages itself (:mod:`wehub_ps.wire.codec`) to avoid copying tensor
bytes, and parses control responses with the generated classes. Every call
carries a deadline; every ``grpc.RpcError`` is translated here.

Replicated shards: a :class:`ShardChannel` knows every replica of its shard
and talks to one, the primary as far as it knows (``address``). When a
call fails because that replica is not the primary or cannot be reached,
:meth:`ShardChannel.follow` moves to the primary it was told of, or to the
next replica, and the retry (worker_client.transport.retry) goes there.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from wehub_ps.errors import Reason
from wehub_ps.v1 import ps_pb2
from wehub_ps.wire.rpc import INCARNATION_METADATA_KEY, MAX_MESSAGE_BYTES, SERVICE_NAME, method_path
from worker_client.errors import NotPrimaryError, PSError, PSUnavailableError, translate_rpc_error
from worker_client.transport.credentials import BearerToken
from worker_client.transport.lane import ExchangeLane, GrpcStream, LaneStream
from worker_client.transport.tcp_lane import TcpLaneOpener, TcpLaneSettings

__all__ = ["ShardChannel"]

log = logging.getLogger("worker_client")

T = TypeVar("T")

#: Unavailability that says nothing about which replica is the primary: the
#: server is up and serving, only busy (its bound on calls or on Exchange streams).
_BUSY_REASONS = frozenset({Reason.TOO_MANY_RPCS.value, Reason.EXCHANGE_STREAMS.value})
#: Failures that may mean the replica died or hangs: another replica is tried.
_MOVE_ON_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})
#: A replicated shard's watch of its primary: a health check this often, each given this long.
_WATCH_SECONDS, _WATCH_TIMEOUT_SECONDS = 0.25, 0.25
#: While the replica in use is silent, the others are asked this often whether one became the primary.
_SEARCH_SECONDS = 0.05
#: A replica in use silent this long is left for the next one even if no other says it is the primary.
_SILENT_SECONDS = 4.0
#: A replica named as the primary by another is not left for saying it is not (yet) the primary for this long:
#: one handed the role takes over within it, and holds the calls sent to it meanwhile.
_NAMED_GRACE_SECONDS = 1.0
# Opening a TCP lane (its Describe and its connection) waits at most this long.
_LANE_CONNECT_SECONDS = 10.0
_DESCRIBE = ps_pb2.DescribeRequest().SerializeToString()


class _Connection:
    """One gRPC channel to one replica: its method callables and its Exchange lane.

    Every callable is made here, before another thread can see the channel:
    gRPC registers a method on the channel's C core without a lock, and
    doing so while another thread closes the channel (a shard moving to
    another replica) crashes the process with SIGSEGV.
    """

    def __init__(self, address: str, options: list[tuple[str, object]],
                 credentials: grpc.ChannelCredentials | None, open_lane_metadata: Callable[[], object],
                 request_timeout: float, tcp_lane: TcpLaneSettings | None = None) -> None:
        self.address = address
        if credentials is not None:
            self.channel = grpc.secure_channel(address, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.describe = self.channel.unary_unary(method_path("Describe"))
        self.create = self.channel.unary_unary(method_path("CreateVariable"))
        self.pull = self.channel.unary_stream(method_path("Pull"))
        self.push = self.channel.stream_unary(method_path("Push"))
        self.heartbeat = self.channel.unary_unary(method_path("Heartbeat"))
        self.checkpoint = self.channel.unary_unary(method_path("Checkpoint"))
        self.finish = self.channel.unary_unary(method_path("Finish"))
        self.switchover = self.channel.unary_unary(method_path("Switchover"))
        self.export_rows = self.channel.unary_stream(method_path("ExportRows"))
        #: The health Check (ps-admin's status, a replicated shard's watch of its primary).
        self.health_check: Callable[..., Any] = health_pb2_grpc.HealthStub(self.channel).Check
        exchange = self.channel.stream_stream(method_path("Exchange"))

        def open_grpc() -> GrpcStream:
            return GrpcStream(lambda requests, timeout: exchange(requests, timeout=timeout,
                                                                 metadata=open_lane_metadata()), address)

        open_stream: Callable[[], LaneStream] = open_grpc
        #: Opens the lane on the server's TCP lane port when it has one (None: the Exchange stream only).
        self.tcp_lane: TcpLaneOpener | None = None
        if tcp_lane is not None:
            self.tcp_lane = TcpLaneOpener(address, tcp_lane,
                                          lambda: self._lane_port(tcp_lane, request_timeout), open_grpc,
                                          min(request_timeout, _LANE_CONNECT_SECONDS))
            open_stream = self.tcp_lane
        #: The long-lived lane for small requests (see worker_client.transport.lane).
        self.lane = ExchangeLane(open_stream, address, request_timeout)

    def _lane_port(self, settings: TcpLaneSettings, request_timeout: float) -> int:
        """The server's TCP lane port from a Describe, 0 when it has none (PSError when it cannot answer)."""
        try:
            raw = self.describe(_DESCRIBE, timeout=min(request_timeout, _LANE_CONNECT_SECONDS),
                                metadata=settings.token.metadata())
        except grpc.RpcError as error:
            raise translate_rpc_error(error, self.address, "exchange") from error
        except ValueError:  # the channel was closed: the client closed, or left this replica
            raise PSUnavailableError(f"exchange: the connection to ps-server {self.address} was closed",
                                     address=self.address, code="CANCELLED") from None
        return ps_pb2.DescribeResponse.FromString(raw).lane_port

    def close(self) -> None:
        """Close the lane (a request using it fails and closes it) and the channel.

        Calls still running on the channel fail (CANCELLED) and are retried by their callers.
        """
        if self.lane.try_acquire():
            self.lane.close()
            self.lane.release()
        else:
            self.lane.interrupt()  # the request using it fails now and is retried on the replica in use
        self.lane.shutdown()
        self.channel.close()


def _health_of(check: Callable[..., Any], timeout: float) -> str:
    """The gRPC health status of the ParameterServer service through ``check``, or 'UNREACHABLE'."""
    try:
        answer = check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout)
    except (grpc.RpcError, ValueError):  # ValueError: the channel was closed (the client left that replica)
        return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


class ShardChannel:
    """The connection to one shard: to its primary, among the replica addresses it was given.

    ``address`` is the replica in use (logs and errors name it). With one
    replica it never changes and nothing of the switching runs.
    """

    def __init__(self, index: int, address: str | Sequence[str], *,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None,
                 token: BearerToken | None = None, incarnation: str | None = None,
                 request_timeout: float = 300.0, tls_context: ssl.SSLContext | None = None,
                 tcp_lane: bool = True) -> None:
        self.index = index
        #: Every replica of the shard, in the order given; the first is tried first.
        self.replicas: tuple[str, ...] = (address,) if isinstance(address, str) else tuple(address)
        if not self.replicas:
            raise ValueError(f"shard {index}: no replica address given")
        # Every call (and every stream when it opens) carries the token's current value as metadata.
        self._token = token if token is not None else BearerToken(None, None)
        self._options: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # Reconnect quickly after a server restart or a cut connection;
            # the client's own retry loop spaces the attempts.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
            # gRPC's least time for one connection attempt (TCP, TLS, HTTP/2 settings): at 100 ms a
            # handshake with a busy or just-elected server was cut off and retried after a backoff.
            ("grpc.min_reconnect_backoff_ms", 1000),
            # Subchannels of this client's own: gRPC otherwise shares one per address among a process's
            # channels, so a channel opened to a replica (one handed the primary role after its restart)
            # took over the reconnect backoff of earlier failures and failed every call until it ran out.
            ("grpc.use_local_subchannel_pool", 1),
            # Notice a dead peer (a partitioned host) within ~30 s; a replicated shard's primary that
            # froze or lost its host within ~3 s, so calls move on to the replica elected next (which
            # takes about a lease): the ping is answered by gRPC's own threads, not the server's Python.
            ("grpc.keepalive_time_ms", 20_000 if len(self.replicas) == 1 else 1_000),
            ("grpc.keepalive_timeout_ms", 10_000 if len(self.replicas) == 1 else 2_000),
        ]
        if len(self.replicas) > 1:  # ping while a call waits for its answer, however long it sends nothing
            self._options += [("grpc.http2.max_pings_without_data", 0),
                              ("grpc.keepalive_permit_without_calls", 1)]
        if credentials is not None and server_name:
            # The name the certificate was issued for, when the address differs.
            self._options.append(("grpc.ssl_target_name_override", server_name))
        self._credentials = credentials
        self._request_timeout = request_timeout
        # The server bounds the Exchange streams of each worker process (incarnation).
        self._incarnation = incarnation
        self._closed = False
        # Small requests go over the server's TCP lane when it has one (tcp_lane), else the Exchange stream.
        self._tcp_lane = (TcpLaneSettings(tls_context, server_name, self._token, incarnation)
                          if tcp_lane and (credentials is None or tls_context is not None) else None)
        # Guards _conn's replacement and _closed's setting (calls read _conn without it: one read, whole).
        self._switch_lock = threading.Lock()
        # Primaries named by a replica that are not in the list, warned about once each.
        self._unknown_hints: set[str] = set()
        self._conn = self._connect(self.replicas[0])
        #: The replica another one named as the primary, and when the shard moved to it (monotonic).
        self._named: tuple[str, float] = ("", 0.0)
        self._watching = threading.Event()
        self._watch: threading.Thread | None = None
        if len(self.replicas) > 1:
            self._watch = threading.Thread(target=self._watch_primary, name=f"ps-replica-watch-{index}",
                                           daemon=True)
            self._watch.start()

    def _watch_primary(self) -> None:
        """Leave a primary that stopped answering (frozen, or its host cut off) without waiting for a call.

        A call to such a primary waits for its deadline (minutes for a push),
        and gRPC's keepalive does not end it sooner here. So every quarter
        second the replica in use is asked its health. While it does not
        answer, the other replicas are asked every 50 ms (and it again every
        quarter second), and the calls move to the first that says it is the primary (an in-sync backup takes over
        --failover-after, 0.6 s by default, after its primary fell silent); failing that,
        after 4 s of silence, to the next replica. One that answers it is not
        the primary (a backup, or a primary that cannot prove its term) is left
        at once. Calls waiting on the replica left fail and are retried by their
        callers, the server's ledger applying each push once.
        """
        silent_since: float | None = None
        checked_at = 0.0
        probes: dict[str, Callable[..., Any]] = {}
        channels: list[grpc.Channel] = []
        try:
            while not self._watching.wait(_WATCH_SECONDS if silent_since is None else _SEARCH_SECONDS):
                conn = self._conn
                now = time.monotonic()
                if silent_since is None or now - checked_at >= _WATCH_SECONDS:
                    checked_at = now
                    # Once silent, asked briefly: the search for a new primary must not wait on it.
                    status = _health_of(conn.health_check,
                                        _WATCH_TIMEOUT_SECONDS if silent_since is None else _SEARCH_SECONDS)
                    if status != "UNREACHABLE":
                        silent_since = None
                        for channel in channels:
                            channel.close()
                        probes, channels = {}, []
                        if status == "NOT_SERVING" and not self._named_lately(conn.address):
                            self.follow(NotPrimaryError(
                                f"ps-server {conn.address} is no longer the primary of its shard",
                                address=conn.address, reason=Reason.NOT_PRIMARY.value, code="UNAVAILABLE"))
                        continue
                    silent_since = silent_since if silent_since is not None else now
                primary = self._serving_replica(conn.address, probes, channels)
                if primary is not None:
                    self.follow(NotPrimaryError(
                        f"ps-server {conn.address} did not answer a health check within "
                        f"{_WATCH_TIMEOUT_SECONDS:g}s and {primary} says it is the primary",
                        address=conn.address, reason=Reason.NOT_PRIMARY.value, code="UNAVAILABLE",
                        primary=primary))
                    silent_since = None
                elif now - silent_since >= _SILENT_SECONDS:
                    self.follow(PSUnavailableError(f"ps-server {conn.address} did not answer health checks "
                                                   f"for {_SILENT_SECONDS:g}s", address=conn.address,
                                                   code="DEADLINE_EXCEEDED"))
                    silent_since = None
        finally:
            for channel in channels:
                channel.close()

    def _serving_replica(self, silent: str, probes: dict[str, Callable[..., Any]],
                         channels: list[grpc.Channel]) -> str | None:
        """The first replica other than ``silent`` whose health says it is the primary (None: none);
        ``probes`` keeps each one's health call on a channel of its own while the silence lasts."""
        for address in self.replicas:
            if address == silent or self._watching.is_set():
                continue
            if address not in probes:
                channel = self._probe_channel(address)
                channels.append(channel)
                probes[address] = health_pb2_grpc.HealthStub(channel).Check
            if _health_of(probes[address], _SEARCH_SECONDS) == "SERVING":
                return address
        return None

    def _connect(self, address: str) -> _Connection:
        return _Connection(address, self._options, self._credentials, self._lane_metadata,
                           self._request_timeout, self._tcp_lane)

    @property
    def address(self) -> str:
        """The replica this shard's calls go to: its primary as far as the client knows."""
        return self._conn.address

    @property
    def lane(self) -> ExchangeLane:
        """The Exchange lane to the replica in use."""
        return self._conn.lane

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        return self._token.metadata()

    def _lane_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The token's current value, and the incarnation the server bounds this stream under."""
        metadata = tuple(self._metadata or ())
        if self._incarnation:
            metadata += ((INCARNATION_METADATA_KEY, self._incarnation),)
        return metadata or None

    # ---- following the primary ----

    def follow(self, error: PSError) -> bool:
        """After ``error`` from a call to this shard: move to the primary, if the error says to.

        NOT_PRIMARY naming a replica of the list: to that one. NOT_PRIMARY
        naming none (or an address not in the list: warned about), or the
        replica unreachable or silent past the deadline: to the next replica.
        A call that failed on another replica than the one in use changes
        nothing (another thread's failure already moved on), so threads that
        fail at once switch once. Whether it switched.
        """
        if len(self.replicas) == 1 or not self._says_move(error):
            return False
        with self._switch_lock:
            old = self._conn
            if self._closed or error.address != old.address:
                return False
            target = self._next_replica(old.address, error)
            if target == old.address:
                return False
            self._conn = self._connect(target)
            if isinstance(error, NotPrimaryError) and error.primary == target:
                self._named = (target, time.monotonic())
        old.close()
        log.info("shard %d: calls go to replica %s, not %s (%s)", self.index, target, old.address, error,
                 extra={"fields": {"shard": self.index, "address": target, "previous": old.address,
                                   "error": str(error)}})
        return True

    def _named_lately(self, address: str) -> bool:
        """Whether the shard moved to ``address`` because another replica named it the primary, lately:
        a backup handed the role answers health checks as a backup until it won its election."""
        named, at = self._named
        return named == address and time.monotonic() - at < _NAMED_GRACE_SECONDS

    @staticmethod
    def _says_move(error: PSError) -> bool:
        if isinstance(error, NotPrimaryError):
            return True
        return (isinstance(error, PSUnavailableError) and error.code in _MOVE_ON_CODES
                and error.reason not in _BUSY_REASONS)

    def _next_replica(self, current: str, error: PSError) -> str:
        """The replica to try after ``current`` failed with ``error``."""
        hint = error.primary if isinstance(error, NotPrimaryError) else None
        if hint and hint in self.replicas and hint != current:
            return hint
        if hint and hint not in self.replicas and hint not in self._unknown_hints:
            self._unknown_hints.add(hint)
            log.warning("shard %d: replica %s names %s as the primary, which is not among the addresses "
                        "given (%s); trying the next one. List the replicas as the servers name each "
                        "other (their advertised addresses).", self.index, current, hint,
                        "|".join(self.replicas), extra={"fields": {
                            "shard": self.index, "address": current, "primary": hint,
                            "replicas": list(self.replicas)}})
        return self.replicas[(self.replicas.index(current) + 1) % len(self.replicas)]

    # ---- the calls ----

    def describe(self, request: bytes, timeout: float) -> bytes:
        conn = self._conn
        return self._guard(conn, "describe", lambda: conn.describe(request, timeout=timeout,
                                                                   metadata=self._metadata))

    def heartbeat(self, request: bytes, timeout: float) -> bytes:
        conn = self._conn
        return self._guard(conn, "heartbeat", lambda: conn.heartbeat(request, timeout=timeout,
                                                                     metadata=self._metadata))

    def checkpoint(self, request: bytes, timeout: float) -> bytes:
        conn = self._conn
        return self._guard(conn, "checkpoint", lambda: conn.checkpoint(request, timeout=timeout,
                                                                       metadata=self._metadata))

    def health(self, timeout: float) -> str:
        """The gRPC health status of the ParameterServer service ('SERVING', ...), or 'UNREACHABLE'."""
        return _health_of(self._conn.health_check, timeout)

    def replica_health(self, timeout: float) -> dict[str, str]:
        """Each replica's health status, by address (the others over a channel opened for the check)."""
        conn = self._conn
        statuses = {}
        for address in self.replicas:
            if address == conn.address:
                statuses[address] = _health_of(conn.health_check, timeout)
                continue
            with self._probe_channel(address) as channel:
                statuses[address] = _health_of(health_pb2_grpc.HealthStub(channel).Check, timeout)
        return statuses

    def describe_each_replica(self, request: bytes, timeout: float) -> dict[str, bytes | PSError]:
        """Each replica's answer to one Describe (no retry), or the error it failed with, by address.

        ``request`` must ask with ``any_replica`` set, or the backups refuse it.
        The replica in use is asked on its channel, the others over a channel
        opened for the call; none of this moves the shard to another replica.
        """
        conn = self._conn
        answers: dict[str, bytes | PSError] = {}
        for address in self.replicas:
            try:
                if address == conn.address:
                    answers[address] = self.describe(request, timeout)
                    continue
                with self._probe_channel(address) as channel:
                    try:
                        answers[address] = channel.unary_unary(method_path("Describe"))(
                            request, timeout=timeout, metadata=self._metadata)
                    except grpc.RpcError as error:
                        raise translate_rpc_error(error, address, "describe") from error
            except PSError as error:
                answers[address] = error
        return answers

    def _probe_channel(self, address: str) -> grpc.Channel:
        """A channel to one replica for a one-off check, with this shard's credentials and options."""
        if self._credentials is not None:
            return grpc.secure_channel(address, self._credentials, options=self._options)
        return grpc.insecure_channel(address, options=self._options)

    def finish(self, request: bytes, timeout: float) -> bytes:
        conn = self._conn
        return self._guard(conn, "finish", lambda: conn.finish(request, timeout=timeout,
                                                               metadata=self._metadata))

    def switchover(self, request: bytes, timeout: float) -> bytes:
        conn = self._conn
        return self._guard(conn, "switchover", lambda: conn.switchover(request, timeout=timeout,
                                                                       metadata=self._metadata))

    def create_variable(self, request: bytes, timeout: float) -> bytes:
        conn = self._conn
        return self._guard(conn, "create_variable", lambda: conn.create(request, timeout=timeout,
                                                                        metadata=self._metadata))

    def pull(self, request: bytes, timeout: float, on_message: Callable[[bytes], None]) -> None:
        """Stream a pull, handing each response message to ``on_message``."""
        conn = self._conn

        def run() -> None:
            for message in conn.pull(request, timeout=timeout, metadata=self._metadata):
                on_message(message)
        self._guard(conn, "pull", run)

    def export_rows(self, request: bytes, timeout: float) -> list[bytes]:
        """Every message of an ExportRows stream (a retry starts the export again)."""
        conn = self._conn
        return self._guard(conn, "export_rows", lambda: list(conn.export_rows(request, timeout=timeout,
                                                                              metadata=self._metadata)))

    def push(self, messages: Iterator[bytes], timeout: float) -> bytes:
        conn = self._conn
        return self._guard(conn, "push", lambda: conn.push(messages, timeout=timeout,
                                                           metadata=self._metadata))

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
        conn = self._conn
        if self._closed:
            raise PSError(f"{what}: the client was closed", address=conn.address)
        lane = conn.lane
        if lane.refused or not lane.try_acquire():
            return None
        try:
            request_id = lane.send(field, payload)
        except ValueError as error:
            lane.release()
            raise self._left(conn, what, error) from error
        except BaseException:
            lane.release()
            raise
        return PendingExchange(lane, request_id, what)

    def close(self) -> None:
        with self._switch_lock:
            self._closed = True
            conn = self._conn
        self._watching.set()
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join()
        conn.close()

    def _guard(self, conn: _Connection, what: str, call: Callable[[], T]) -> T:
        if self._closed:
            raise PSError(f"{what}: the client was closed", address=conn.address)
        try:
            return call()
        except grpc.RpcError as error:
            raise translate_rpc_error(error, conn.address, what) from error
        except ValueError as error:
            raise self._left(conn, what, error) from error

    def _left(self, conn: _Connection, what: str, error: ValueError) -> PSError:
        """The error for a call that found its channel closed: gRPC raises ValueError for it.

        The client closed, or another thread's :meth:`follow` left that
        replica between this call's start and its first message: the retry
        goes to the replica in use. Any other ValueError is not about the
        channel and is raised again, as it is.
        """
        if self._closed:
            return PSError(f"{what}: the client was closed", address=conn.address)
        if conn is not self._conn:
            return PSUnavailableError(f"{what}: the client left ps-server {conn.address} for {self.address}",
                                      address=conn.address, code="CANCELLED")
        raise error


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
